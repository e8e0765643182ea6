"""The single controller: one Python loop drives the executors (LlamaRL's design, in JAX).

Executors: generator (sampler mesh), reward (verifier on the host or the reward model on its
mesh), reference and critic (their meshes), trainer (actor + critic updates and the weight push).

Modes (`rl.mode`):
  sync   generate -> {reward, reference, critic, old log-probs} -> update -> reshard, in turn
         (the four scoring calls overlap: they are independent).
  async  the generator is a background RolloutWorker that runs ahead by at most
         `rl.max_staleness` policy versions; the trainer consumes the oldest batch within that
         bound, and pushes new weights (a reshard) after every update. Off-policy samples are
         corrected by the configured loss (AIPO, or PPO with the truncated-IS weight).
Every sample's policy version and its lag behind the trainer are logged.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxrl.algos import KL_ESTIMATORS
from jaxrl.data.tokenizer import ByteTokenizer
from sampler.worker import RolloutWorker, RolloutWorkerError
from train.executors import Executor, ExecutorError
from train.experience import verify
from train.timeline import Timeline

log = logging.getLogger("jaxrl")


class Controller:

  def __init__(self, trainer, tok: ByteTokenizer, verifier, timeline: Timeline):
    self.trainer, self.tok, self.verifier, self.timeline = trainer, tok, verifier, timeline
    self.cfg = trainer.cfg.rl
    t = trainer
    self.generator = Executor("generator", t.sample, timeline, t.sampler_mesh)
    self.reward = Executor("reward", self._score, timeline,
                           t.reward.mesh if self.cfg.reward == "reward_model" else None)
    self.reference = Executor("reference", lambda ro: t.completion_logprobs(t.reference, ro),
                              timeline, t.reference.mesh)
    self.critic = (Executor("critic", t.critic_values, timeline, t.critic.mesh)
                   if t.critic is not None else None)
    self.train = Executor("trainer", self._train_call, timeline, t.actor.mesh)
    self.worker: RolloutWorker | None = None
    self.version = 0  # policy version = completed RL steps

  # -- stages -------------------------------------------------------------------------------
  def _score(self, rollout, answers_B):
    verified_B = verify(self.tok, rollout, answers_B, self.verifier)
    if self.cfg.reward == "reward_model":
      return np.asarray(self.trainer.reward_scores(rollout.tokens_BT, rollout.valid_BT)), verified_B
    return verified_B, verified_B

  @staticmethod
  def _train_call(fn, *args):
    return fn(*args)

  def experience(self, rollout, prompts) -> tuple[dict, dict]:
    """Scores one rollout batch; the reward, reference, critic and old-log-prob calls overlap."""
    t0 = time.perf_counter()
    answers_B = np.repeat(prompts["answers"], self.cfg.group_size)
    futures = {
        "reward": (self.reward, self.reward.submit(rollout, answers_B, label="score")),
        "ref": (self.reference, self.reference.submit(rollout, label="ref logprobs")),
        "old": (self.train, self.train.submit(
            self.trainer.completion_logprobs, self.trainer.actor, rollout, label="old logprobs")),
    }
    if self.critic is not None:
      futures["values"] = (self.critic, self.critic.submit(rollout, label="values"))
    out = {k: ex.result(f) for k, (ex, f) in futures.items()}
    rewards_B, verified_B = out["reward"]
    mask_BN = np.asarray(rollout.completion_mask_BN)
    old_BN, ref_BN = np.asarray(out["old"]), np.asarray(out["ref"])
    values_BN = None if self.critic is None else np.asarray(out["values"]) * mask_BN
    kl_BN = np.asarray(KL_ESTIMATORS[self.cfg.kl_estimator](old_BN, ref_BN)) * mask_BN
    adv_BN, raw_BN = self.trainer.advantages(rewards_B, mask_BN, kl_BN, values_BN)
    batch = {"tokens": rollout.tokens_BT, "valid": rollout.valid_BT, "completion_mask": mask_BN,
             "old_logprobs": old_BN, "ref_logprobs": ref_BN,
             "sampler_logprobs": rollout.logprobs_BN, "advantages": adv_BN}
    if values_BN is not None:
      batch.update(old_values=values_BN, returns=np.asarray(raw_BN) + values_BN)
    batch = {k: np.asarray(v) for k, v in batch.items()}
    info = {"rewards_B": np.asarray(rewards_B), "verified_B": verified_B,
            "lengths_B": np.asarray(rollout.lengths_B),
            "time_score": time.perf_counter() - t0}
    return batch, info

  def _update(self, batch: dict) -> dict:
    n_mb = self.cfg.num_minibatches
    metrics = [self.trainer.rl_step({k: np.array_split(v, n_mb)[i] for k, v in batch.items()})
               for i in range(n_mb)]
    return {k: float(np.mean([jax.device_get(x[k]) for x in metrics])) for k in metrics[0]}

  def update(self, batch: dict) -> tuple[dict, dict]:
    """Actor (+ critic) minibatch updates, then the new weights go to the sampler."""
    t0 = time.perf_counter()
    metrics = self.train(self._train_call, self._update, batch, label="update")
    t1 = time.perf_counter()
    self.version += 1
    if self.worker is None:
      stats = self.train(self._train_call, self.trainer.sync_sampler, label="reshard")
    else:
      stats = self.train(self._train_call, self._push, label="push weights")
    return metrics, {"time_update": t1 - t0, "time_reshard": time.perf_counter() - t1,
                     "reshard_gbps": stats.gbps}

  def _push(self):
    params, stats = self.trainer.sampler_copy()
    self.worker.update_weights(params, self.version)
    return stats

  # -- the loop -----------------------------------------------------------------------------
  def start(self, prompts_iter, seed: int) -> None:
    """Async mode: starts the generator ahead of the trainer (it samples the same prompt and
    key sequence as the sync loop, so max_staleness=0 reproduces it exactly)."""
    if self.cfg.mode != "async":
      self._prompts, self._key = prompts_iter, jax.random.key(seed)
      return

    def generate(params, prompts, key):
      with self.timeline.span("generator", "generate"):
        return self.trainer.sample(prompts, key, params=params)

    # Weights reach the worker already in the sampler's layout (trainer.sampler_copy).
    self.worker = RolloutWorker(generate, prompts_iter, self.trainer.sampler_params, version=0,
                                max_staleness=self.cfg.max_staleness,
                                queue_size=self.cfg.max_staleness + 1, seed=seed)

  def next_rollout(self):
    """(rollout, prompts, rollout_version, seconds waited for it)."""
    t0 = time.perf_counter()
    if self.worker is None:
      prompts = next(self._prompts)
      self._key, sub = jax.random.split(self._key)
      rollout = self.generator(prompts, sub, label="generate")
      return rollout, prompts, self.version, time.perf_counter() - t0
    try:
      batch = self.worker.get()
    except RolloutWorkerError as e:
      raise ExecutorError("generator", e.__cause__ or e) from (e.__cause__ or e)
    return batch.rollout, batch.prompts, batch.version, time.perf_counter() - t0

  def sampler_params(self):
    """The sampler-layout weights of the newest policy (for evaluation)."""
    return self.trainer.sampler_params if self.worker is None else self.worker.params

  def step(self) -> tuple[dict, dict]:
    """One RL step: (batch info, metrics row)."""
    t0 = time.perf_counter()
    rollout, prompts, version, waited = self.next_rollout()
    lag = self.version - version
    batch, info = self.experience(rollout, prompts)
    metrics, times = self.update(batch)
    row = {**metrics, **times, "time_generate": waited, "time_score": info["time_score"],
           "policy_version": self.version, "rollout_version": version, "policy_lag": lag,
           "step_time": time.perf_counter() - t0}
    return info, row

  def close(self) -> None:
    if self.worker is not None:
      self.worker.close()
    for ex in (self.generator, self.reward, self.reference, self.critic, self.train):
      if ex is not None:
        ex.close()


def run_rl(controller: Controller, steps: int, on_step: Callable[[int, dict, dict], None],
           should_stop: Callable[[], bool] = lambda: False) -> int:
  """Runs up to `steps` RL steps; returns the number done (fewer when a stop was requested)."""
  done = 0
  for step in range(1, steps + 1):
    if should_stop():
      break
    info, row = controller.step()
    on_step(step, info, row)
    done = step
  return done
