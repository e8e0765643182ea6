"""DPO: the actor against its own starting point, on preference pairs (sigmoid loss, `dpo.beta`).

The reference log-probs of every pair are computed once, from the actor as the stage starts (the
reference IS that actor), and kept as stage arrays, so a resumed DPO run needs no reference model.
"""
from __future__ import annotations

import functools

import grain
import jax
import numpy as np

from jaxrl.config import ExperimentConfig
from jaxrl.data.preferences import pair_batch, pair_lengths
from train.roles.learner import Learner
from train.stages.base import Stage
from train.task.heldout import chunks
from train.task.pairs import check_pairs_file, load_pairs
from train.updates.preference import dpo_update, pair_logprobs
from train.updates.state import make_optimizer


class DPOStage(Stage):
  name = "dpo"
  log_every = 10

  @classmethod
  def check(cls, cfg: ExperimentConfig) -> None:
    check_pairs_file("dpo", cfg.dpo.pairs_path)

  def start(self, *, restoring: bool = False) -> None:
    d, ctx, actor = self.cfg.dpo, self.ctx, self.ctx.cluster.actor
    self.train_pairs, self.heldout_pairs, skipped = load_pairs(
        ctx, "dpo", d.pairs_path, per_prompt=d.pairs_per_prompt,
        policy_negatives=d.policy_negatives)
    self.note(skipped)  # a pairs file's bad rows, for the summary
    self.lengths = pair_lengths(self.train_pairs + self.heldout_pairs, ctx.task.enc)
    self._seq_logp = actor.jit(functools.partial(pair_logprobs, actor.graphdef,
                                                 prompt_len=self.lengths[0],
                                                 share=d.share_prefix))
    if not restoring:
      self.ref_train = self._logprobs(self.train_pairs)
      self.ref_heldout = self._logprobs(self.heldout_pairs)
      self.margin0 = self._margins()[0]
    optimizer = make_optimizer(d.learning_rate, warmup_steps=d.warmup_steps,
                                     total_steps=d.steps)
    update = functools.partial(dpo_update, beta=d.beta, prompt_len=self.lengths[0],
                               share=d.share_prefix)
    self.learner = Learner(actor, update, optimizer, initialize=not restoring)
    self._data = None

  def _logprobs(self, pairs) -> np.ndarray:
    """[n, 2] summed response log-probs (chosen, rejected) of each pair under the actor."""
    actor, transfers, out = self.ctx.cluster.actor, self.ctx.transfers, []
    for chunk, n in chunks(pairs, self.cfg.dpo.batch_size):
      b = pair_batch(chunk, self.ctx.task.enc, *self.lengths)
      b = transfers.to_device(b, actor.batch_shardings(b), "pairs")
      c, r = np.split(transfers.to_host(self._seq_logp(actor.params, b["tokens"], b["valid"],
                                                       b["completion_mask"]), "logprobs"), 2)
      out.append(np.stack([c, r], 1)[:n])
    return np.concatenate(out)

  def _margins(self) -> tuple[float, float]:
    """(chosen - rejected log-prob margin, DPO implicit-reward margin), held-out means."""
    pi, ref = self._logprobs(self.heldout_pairs), self.ref_heldout
    implicit = self.cfg.dpo.beta * ((pi[:, 0] - ref[:, 0]) - (pi[:, 1] - ref[:, 1]))
    return float((pi[:, 0] - pi[:, 1]).mean()), float(implicit.mean())

  def _batch(self, items) -> dict:
    b = pair_batch([p for p, _ in items], self.ctx.task.enc, *self.lengths)
    ref_N2 = np.stack([r for _, r in items])
    b["ref_logprobs"] = np.concatenate([ref_N2[:, 0], ref_N2[:, 1]]).astype(np.float32)
    return b

  def step(self) -> dict:
    if self._data is None:
      self._data = (grain.MapDataset.source(list(zip(self.train_pairs, self.ref_train)))
                    .seed(self.cfg.seed + 3).shuffle().repeat()
                    .batch(self.cfg.dpo.batch_size, drop_remainder=True, batch_fn=self._batch))
    batch = self._data[self.progress.done]
    return self.learner.update(self.ctx.transfers.to_device(
        batch, self.ctx.cluster.actor.batch_shardings(batch), "batch"))

  def evaluate(self) -> dict:
    margin, implicit = self._margins()
    return {"heldout_logp_margin": margin, "heldout_implicit_margin": implicit,
            "heldout_acc": self.ctx.evaluate()}

  def finish(self) -> dict:
    e = self.progress.last_eval
    return {"dpo_heldout_logp_margin_init": self.margin0,
            "dpo_heldout_logp_margin": e["heldout_logp_margin"],
            "dpo_heldout_implicit_margin": e["heldout_implicit_margin"],
            "heldout_acc_dpo": e["heldout_acc"]}

  def learners(self) -> dict[str, Learner]:
    return {"actor": self.learner}

  def state(self) -> dict:
    return {"margin0": self.margin0}

  def arrays(self) -> dict:
    rep = self.ctx.cluster.actor.replicated
    return self.ctx.transfers.to_device(
        {"ref_train": self.ref_train, "ref_heldout": self.ref_heldout},
        {"ref_train": rep, "ref_heldout": rep}, "checkpoint")

  def abstract_arrays(self, state: dict) -> dict:
    sds = lambda n: jax.ShapeDtypeStruct((n, 2), np.float32,
                                         sharding=self.ctx.cluster.actor.replicated)
    return {"ref_train": sds(len(self.train_pairs)), "ref_heldout": sds(len(self.heldout_pairs))}

  def restore(self, state: dict, arrays: dict) -> None:
    self.margin0 = state["margin0"]
    self.ref_train = self.ctx.transfers.to_host(arrays["ref_train"], "logprobs")
    self.ref_heldout = self.ctx.transfers.to_host(arrays["ref_heldout"], "logprobs")
