"""Reward model: Bradley-Terry training of a scalar head on the actor's trunk, on preference pairs.

Runs when the RL reward comes from a reward model (`rl.reward = "reward_model"`). The model is
the `reward` role of the cluster, on its own mesh; its trunk starts from the actor (after SFT).
"""
from __future__ import annotations

import functools
import logging

import numpy as np

from jaxrl.config import ExperimentConfig
from jaxrl.data.preferences import pair_batch, pair_dataset, pair_lengths
from train.roles.learner import Learner
from train.stages.base import Stage
from train.task.heldout import chunks
from train.task.pairs import check_pairs_file, load_pairs
from train.updates.preference import pair_scores, reward_model_update
from train.updates.state import make_optimizer

log = logging.getLogger("jaxrl")


class RewardModelStage(Stage):
  name = "reward_model"
  log_every = 10

  @classmethod
  def enabled(cls, cfg: ExperimentConfig) -> bool:
    return cfg.rl.reward == "reward_model" and cfg.reward_model.steps > 0

  @classmethod
  def check(cls, cfg: ExperimentConfig) -> None:
    check_pairs_file("reward_model", cfg.reward_model.pairs_path)

  def start(self, *, restoring: bool = False) -> None:
    rm, ctx, cluster = self.cfg.reward_model, self.ctx, self.ctx.cluster
    self.train_pairs, self.heldout_pairs, skipped = load_pairs(
        ctx, "reward_model", rm.pairs_path, per_prompt=rm.pairs_per_prompt,
        policy_negatives=rm.policy_negatives)
    self.note(skipped)  # a pairs file's bad rows, for the summary
    self.lengths = pair_lengths(self.train_pairs + self.heldout_pairs, ctx.task.enc)
    role = cluster.get("reward")
    if role is None:
      role = cluster.add("reward")
      role.load(cluster.actor_weights(), subtree="decoder")
    self.role = role
    self._scores = role.jit(functools.partial(pair_scores, role.graphdef,
                                              prompt_len=self.lengths[0],
                                              share=rm.share_prefix))
    self.data = pair_dataset(self.train_pairs, ctx.task.enc, batch_size=rm.batch_size,
                             prompt_len=self.lengths[0], response_len=self.lengths[1],
                             seed=self.cfg.seed + 2)
    optimizer = make_optimizer(rm.learning_rate, warmup_steps=rm.warmup_steps,
                                     total_steps=rm.steps)
    update = functools.partial(reward_model_update, prompt_len=self.lengths[0],
                               share=rm.share_prefix)
    self.learner = Learner(role, update, optimizer, initialize=not restoring)
    if not restoring:
      self.accuracy0 = self._accuracy()[0]

  def _accuracy(self) -> tuple[float, float]:
    """Held-out pairwise accuracy (score(chosen) > score(rejected)) and mean score margin."""
    correct = margin = 0.0
    for chunk, n in chunks(self.heldout_pairs, self.cfg.reward_model.batch_size):
      b = pair_batch(chunk, self.ctx.task.enc, *self.lengths)
      b = self.ctx.transfers.to_device(b, self.role.batch_shardings(b), "pairs")
      scores = self.ctx.transfers.to_host(self._scores(self.role.params, b["tokens"], b["valid"]),
                                          "scores")
      chosen_B, rejected_B = np.split(scores, 2)
      correct += float((chosen_B > rejected_B)[:n].sum())
      margin += float((chosen_B - rejected_B)[:n].sum())
    return correct / len(self.heldout_pairs), margin / len(self.heldout_pairs)

  def step(self) -> dict:
    batch = self.data[self.progress.done]
    return self.learner.update(self.ctx.transfers.to_device(
        batch, self.role.batch_shardings(batch), "batch"))

  def evaluate(self) -> dict:
    accuracy, margin = self._accuracy()
    return {"heldout_pair_acc": accuracy, "heldout_margin": margin}

  def finish(self) -> dict:
    accuracy = self.progress.last_eval["heldout_pair_acc"]
    log.info("reward model: held-out pairwise accuracy %.3f -> %.3f (%d pairs)",
             self.accuracy0, accuracy, len(self.heldout_pairs))
    return {"rm_heldout_pair_acc_init": self.accuracy0, "rm_heldout_pair_acc": accuracy,
            "rm_train_pairs": len(self.train_pairs), "rm_heldout_pairs": len(self.heldout_pairs)}

  def learners(self) -> dict[str, Learner]:
    return {"reward": self.learner}

  def state(self) -> dict:
    return {"accuracy0": self.accuracy0}

  def restore(self, state: dict, arrays: dict) -> None:
    self.accuracy0 = state["accuracy0"]
