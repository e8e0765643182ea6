"""The single controller: one Python loop drives the executors (LlamaRL's design, in JAX).

One step: the next rollout batch (`RolloutSource`, train/rollout/source.py: generated in turn, or
taken from the async worker that runs ahead by at most `rl.schedule.max_staleness` policy versions),
DAPO's batch filling (train/loop/batch_fill.py), scoring into an Experience (train/loop/scoring.py:
reward, reference, critic and old log-probs overlap on their executors), the actor (+ critic)
update over the minibatches, and the push of the new weights to the sampler (and the worker).
Off-policy samples are corrected in the update (train/updates/policy.py): the policy loss
(`rl.loss.name`, jaxrl/algos/losses.py: PPO's clip around pi_old, AIPO's min(pi / mu, rho),
GSPO, CISPO, decoupled PPO) times the rollout correction of jaxrl/algos/correction.py (a
truncated importance weight min(pi_old / mu, `rl.correction.tis_cap`), a token, sequence, geometric
or IcePop mask, `rl.correction.mask`; a loss that weights by pi_old / mu itself is only capped
and masked). The host sees only the completions' token ids (for the verifier), the rewards it
returns, and the step's metrics; every sample's policy version and its lag are logged.
"""
from __future__ import annotations

import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxrl.config import ConfigError, ExperimentConfig, offload_items
from sharding.reshard import move
from train.io.host_transfers import HostTransfers
from train.io.timeline import Timeline
from train.loop.batch_fill import FilledBatch, fill_batch
from train.loop.engine_replay import EngineReplay
from train.loop.exact import ExactSampler
from train.loop.executors import ExecutorError, Executors
from train.loop.experience import critic_batch
from train.loop.full_kl import check_rows, rows_of
from train.loop.scoring import Scoring
from train.roles.cluster import RoleCluster
from train.roles.learner import Learner
from train.roles.link import Link
from train.roles.offload import Offloader
from train.rollout.batches import WorkerState
from train.rollout.generator import Generator
from train.rollout.source import RolloutSource
from train.rollout.worker import RolloutWorkerError
from train.task.data import TaskData
from train.task.reward import Judge


class Controller:

  def __init__(self, cfg: ExperimentConfig, *, cluster: RoleCluster, generator: Generator,
               task: TaskData, judge: Judge, timeline: Timeline, transfers: HostTransfers,
               actor: Learner, critic: Learner | None, next_index: int, version: int):
    """`next_index`: the first prompt batch not yet trained on; `version`: the policy version;
    `transfers`: the run's named host transfers."""
    self.rl, self.task, self.judge, self.actor, self.critic = cfg.rl, task, judge, actor, critic
    self.transfers = transfers
    self.version = version
    self.executors = Executors(cluster, timeline, reward_model=cfg.rl.reward == "reward_model",
                               critic_mesh=None if critic is None else critic.role.mesh)
    exact = None
    if cfg.rl.replays_engine:
      exact = EngineReplay(cfg.rl, actor.role, generator, transfers)
    elif cfg.rl.rollout.exact:
      exact = ExactSampler(cfg.rl, actor.role, generator.sampler.cfg, transfers)
    self.rollouts = RolloutSource(cfg, generator, cluster.sampler_weights, task.prompts,
                                  prompt_len=task.prompt_len, timeline=timeline,
                                  run=self.executors.sampler, next_index=next_index,
                                  split=cluster.split if cluster.split and cluster.split.generators
                                  else None,
                                  exact=exact)
    pack, new = cfg.rl.batching.pack_length, cfg.rl.rollout.max_new_tokens
    if pack and pack < task.prompt_len + new:
      raise ConfigError(f"config.rl.batching.pack_length: at least a row's {task.prompt_len} "
                        f"prompt + {new} new tokens, got {pack}")
    self.scoring = Scoring(cfg.rl, cluster, actor, critic, judge, self.executors,
                           transfers=transfers, link_of=self._link,
                           engine_replay=exact if cfg.rl.replays_engine else None)
    self._split, self._own_link = cluster.split, None  # (`_link`)
    items = offload_items(cfg.placement.offload)
    self.offload = Offloader(items, cluster, [actor, critic], timeline) if items else None
    self.kl_rows = check_rows(cfg, cluster)  # (train/loop/full_kl.py)
    self.last_rows: dict | None = None  # the first rows of the batch before an evaluation

  @property
  def next_index(self) -> int:
    return self.rollouts.next_index

  @property
  def worker(self):
    """The async generator's worker (None in sync mode)."""
    return self.rollouts.worker

  def _link(self):
    """The session's link to the groups apart: the generator's worker's where it stands apart,
    else (the sampler on the trainer's processes: `interleave`) one for the scorers alone,
    opened at its first request and ended by `close`."""
    if self.worker is not None:
      return self.worker.link
    if self._own_link is None:
      self._own_link = Link(self._split)
    return self._own_link

  def start(self, state: WorkerState | None = None) -> None:
    """Async mode: the generator starts ahead of the trainer (from a checkpoint's `state`)."""
    self.rollouts.start(self.version, state)

  def _enter(self, phase: str) -> None:
    """Idle-role offload (train/roles/offload.py) before a phase of a sync step."""
    if self.offload is not None and self.worker is None:
      self.executors.trainer(self.offload.enter, phase, label=f"{phase} memory")

  def _next(self):
    try:
      return self.rollouts.next(self.version)
    except RolloutWorkerError as e:
      raise ExecutorError("sampler", e.__cause__ or e) from (e.__cause__ or e)

  def _batch(self) -> FilledBatch:
    """The step's batch: the next one, or with dynamic sampling as many as fill it (verifying
    the rounds counts as scoring)."""
    batch, waited = self._next()
    if self.rl.dapo.dynamic_sampling:
      filled = fill_batch(batch, cfg=self.rl, judge=self.judge, next_batch=self._next,
                          transfers=self.transfers)
      filled.waited += waited
      return filled
    return FilledBatch(batch.rollout, batch.prompts, None, batch.version,
                       batch.token_versions(self.rl.rollout.max_new_tokens), waited, {})

  def update(self, exp) -> tuple[dict, dict]:
    """Actor (+ critic) updates over the minibatches, then the new weights go to the sampler."""
    t0 = time.perf_counter()

    def learn():
      metrics = self.actor.update(exp)
      if self.critic is not None:
        metrics = {**metrics, **self._update_critic(exp)}
      return metrics

    metrics = self.executors.trainer(learn, label="update")
    t1 = time.perf_counter()
    self.version += 1
    stats = self.executors.trainer(self.rollouts.publish, self.version,
                                   label="reshard" if self.worker is None else "push")
    return metrics, {"time_update": t1 - t0, "time_reshard": time.perf_counter() - t1,
                     "reshard_gbps": stats.gbps}

  def _update_critic(self, exp) -> dict:
    """The critic's update: on the scorers' processes where it stands apart with them, else on
    its mesh (the batch's critic fields moved there, in the same layout, where it is not the
    actor's)."""
    if self.scoring.critic_apart:
      return self.scoring.remote.update_critic(exp)
    mesh = self.critic.role.mesh
    if mesh == self.actor.role.mesh:
      return self.critic.update(exp)
    batch = critic_batch(exp)
    return self.critic.update(move(batch, jax.tree.map(
        lambda x: NamedSharding(mesh, x.sharding.spec), batch)))

  def bring_critic_home(self) -> None:
    """The critic's state into the trainer's copy, where it trains apart (before a checkpoint)."""
    if self.scoring.critic_apart:
      self.scoring.remote.bring_critic_home()

  def step(self, *, keep_rows: bool = False) -> dict:
    """One RL step; returns its metrics row (host values). `keep_rows`: an evaluation follows,
    whose full-distribution check reads the batch's first rows (`last_rows`); exact sync
    rollouts check their log-probs then (`Scoring.old_pass`: the step's mismatch metrics)."""
    t0, errors = time.perf_counter(), self.task.user_code_errors.total()
    self._enter("generate")
    batch = self._batch()
    extra, lag = dict(batch.metrics), self.version - batch.version
    if self.worker is not None:  # every generated token's lag behind the policy it trains
      extra.update(token_lags(self.version, batch.rollout, batch.versions_BN, self.transfers))
    self._enter("score")
    exp, exp_metrics, verified_B = self.scoring.experience(batch.rollout, batch.prompts,
                                                           batch.verified_B, check=keep_rows)
    t_score = time.perf_counter() - t0 - batch.waited
    if keep_rows and self.kl_rows:
      self.last_rows = rows_of(exp, self.kl_rows)
    self._enter("update")
    metrics, times = self.update(exp)
    self._enter("generate")  # between steps (evaluation, checkpoints) too
    if self.offload is not None:
      extra["time_offload"] = self.offload.take_seconds()
    if self.task.user_code:  # calls of it scored 0 or ended (async: those of this interval)
      extra["user_code_errors"] = self.task.user_code_errors.total() - errors
    if self.rl.sampler_is_trainer and not keep_rows:  # (pi_old was mu: nothing measured)
      metrics = {k: v for k, v in metrics.items() if not k.startswith("mismatch")}
    row = self.transfers.to_host({**exp_metrics, **metrics}, "metrics")
    step_time = time.perf_counter() - t0
    return {**row, **extra, "verified_mean": float(verified_B.mean()), **times,
            "time_generate": batch.waited, "time_score": t_score,
            "policy_version": self.version, "rollout_version": batch.version,
            "policy_lag": lag, "step_time": step_time,
            "tokens_per_s": float(row["response_tokens"]) / step_time}

  def close(self) -> None:
    self.rollouts.close()
    if self._own_link is not None:
      self._own_link.end()
      self._own_link = None
    self.executors.close()


def token_lags(version: int, rollout, versions_BN: np.ndarray,
               transfers: HostTransfers) -> dict:
  """Policy lag of the rollout's tokens behind `version` (the model's: not an environment's):
  mean, max and the count per lag (`token_lags`); the rows' lengths and masks fetched as
  `transfers`'."""
  lengths_B = transfers.to_host(rollout.lengths_B, "lengths")
  own_BN = np.arange(versions_BN.shape[1]) < lengths_B[:, None]
  if rollout.loss_mask_BN is not None:
    own_BN &= transfers.to_host(rollout.loss_mask_BN, "loss mask")[:, :versions_BN.shape[1]]
  lags = (version - versions_BN)[own_BN]
  counts = np.bincount(lags, minlength=1) if lags.size else np.zeros(1, np.int64)
  return {"token_lag_mean": float(lags.mean()) if lags.size else 0.0,
          "token_lag_max": int(lags.max(initial=0)), "token_lags": counts.tolist()}
