"""The single controller: one Python loop drives the executors (LlamaRL's design, in JAX).

Executors: generator (sampler mesh), reward (the host verifier, and the reward model on its mesh
when the reward comes from one), reference and critic (their meshes), trainer (actor + critic
updates and the weight push).

Modes (`rl.mode`):
  sync   generate -> {reward, reference, critic, old log-probs} -> experience -> update -> push,
         in turn (the four scoring calls overlap: they are independent).
  async  the generator is a background RolloutWorker that runs ahead by at most
         `rl.max_staleness` policy versions; the trainer consumes the oldest batch within that
         bound and pushes new weights (a reshard) after every update. Off-policy samples are
         corrected by the configured loss (AIPO, or PPO with the truncated-IS weight).
Data flow: the rollout moves device to device from the sampler to each scorer and to the trainer
(train/experience.py); the host sees only the completions' token ids (for the verifier), the
rewards it returns, and the step's metrics. Every sample's policy version and its lag behind the
trainer are logged.
"""
from __future__ import annotations

import functools
import time

import jax
import numpy as np

from train.rollout.partial import PartialRolloutWorker
from train.rollout.worker import (RolloutBatch, RolloutWorker, RolloutWorkerError, WorkerState, rollout_key)
from jaxrl.config import offload_items
from train.roles import offload
from train.updates.batching import map_minibatches
from train.updates.forward import completion_logprobs, completion_values, sequence_scores
from train.rl.executors import Executor, ExecutorError
from jaxrl.algos.advantages import informative_groups
from jaxrl.data.pipeline import bucket_length
from train.rl.experience import combine_rollouts, make_experience, trim_rollout
from train.roles.learner import Learner
from train.io.host_transfers import allowed, to_device, to_host


class Controller:

  def __init__(self, ctx, actor: Learner, critic: Learner | None, *, next_index: int,
               version: int):
    """`ctx` (train/context.py): config, tokenizer, task, cluster, generator, timeline.
    `next_index`: the first prompt batch not yet trained on; `version`: the policy version."""
    self.ctx, self.cfg, self.actor, self.critic = ctx, ctx.cfg.rl, actor, critic
    self.next_index, self.version, self.worker = next_index, version, None
    cluster, timeline = ctx.cluster, ctx.timeline
    self.reference, self.reward_model = cluster.get("reference"), cluster.get("reward")
    inline = jax.process_count() > 1  # every process must launch the same programs in order
    ex = lambda name, mesh: Executor(name, timeline, mesh, inline=inline)
    self.generator = ex("generator", cluster.meshes["sampler"])
    self.reward = ex("reward", cluster.meshes["reward"] if self.cfg.reward == "reward_model"
                     else None)
    self.ref = ex("reference", self.reference.mesh)
    self.values = ex("critic", critic.role.mesh) if critic is not None else None
    self.train = ex("trainer", actor.role.mesh)
    n = self.cfg.rollouts // self.cfg.pass_rows  # scoring passes run in the update's pieces

    def scorer(role, fn):
      def score(params, tokens_BT, valid_BT, mask_BN):  # the prompt length: from the shapes
        p_len = tokens_BT.shape[1] - mask_BN.shape[1]
        return map_minibatches(lambda mb: fn(role.graphdef, params, *mb, prompt_len=p_len),
                                     (tokens_BT, valid_BT), n)
      return role.jit(score)
    logp = lambda *args, **kw: completion_logprobs(*args, **kw)[0]
    self._ref_logp, self._old_logp = scorer(self.reference, logp), scorer(actor.role, logp)
    if critic is not None:
      self._values_fn = scorer(critic.role, completion_values)
    if self.reward_model is not None:
      self._scores_fn = self.reward_model.jit(functools.partial(sequence_scores,
                                                                self.reward_model.graphdef))
    self._experience = actor.role.jit(functools.partial(make_experience, cfg=self.cfg))
    items = offload_items(ctx.cfg.placement.offload)
    self.offload = offload.Offloader(items, cluster, [actor, critic], timeline) if items else None

  def _enter(self, phase: str) -> None:
    """Idle-role offload (train/offload.py) before a phase of a sync step."""
    if self.offload is not None and self.worker is None:
      self.train(self.offload.enter, phase, label=f"{phase} memory")

  # -- one batch ------------------------------------------------------------------------------
  def _score(self, rollout, examples_B, verified_B=None):
    """(rewards on the trainer's mesh, verified_B on the host; given: already verified)."""
    if verified_B is None:
      verified_B = self.ctx.rewards(rollout, examples_B)
    if self.reward_model is None:
      rewards_B = to_device(verified_B, self.actor.role.batch_shardings(verified_B), "rewards")
    else:
      rewards_B = self.actor.role.put(self._on(self.reward_model, self._scores_fn, rollout,
                                               mask=False))
    return rewards_B, verified_B

  @staticmethod
  def _on(role, fn, rollout, *, mask: bool = True):
    """`fn(params, tokens, valid[, completion mask])` on `role`'s mesh, the rollout moved there
    device to device."""
    arrays = (rollout.tokens_BT, rollout.valid_BT) + ((rollout.completion_mask_BN,) if mask else ())
    return fn(role.params, *role.put(arrays))

  def trimmed(self, rollout):
    """The rollout with its completion slots cut to the bucket (`rl.length_buckets`) of its
    longest response: scoring and the update then skip the slots no row reached."""
    budget = rollout.completion_mask_BN.shape[1]
    longest = int(to_host(rollout.lengths_B, "lengths").max(initial=0))
    n = bucket_length(longest, budget, self.cfg.length_buckets)
    return rollout if n == budget else trim_rollout(rollout, n)

  def experience(self, rollout, prompts, verified_B=None):
    """Scores one rollout batch (the reward, reference, critic and old-log-prob calls overlap)
    and assembles its Experience on the trainer's mesh: (experience, metrics, verified_B)."""
    examples_B = np.repeat(prompts["examples"], self.cfg.group_size)
    rollout = self.trimmed(rollout)
    futures = {
        "reward": (self.reward, self.reward.submit(self._score, rollout, examples_B, verified_B,
                                                   label="score")),
        "ref": (self.ref, self.ref.submit(self._on, self.reference, self._ref_logp, rollout,
                                          label="ref logprobs")),
    }
    if self.cfg.needs_old_logprobs:
      futures["old"] = (self.train, self.train.submit(self._on, self.actor.role, self._old_logp,
                                                      rollout, label="old logprobs"))
    if self.critic is not None:
      futures["values"] = (self.values, self.values.submit(
          self._on, self.critic.role, self._values_fn, rollout, label="values"))
    out = {k: ex.result(f) for k, (ex, f) in futures.items()}
    (rewards_B, verified_B), on_actor = out["reward"], self.actor.role.put
    values_BN = on_actor(out["values"]) if "values" in out else None
    exp, metrics = self._experience(on_actor(rollout), rewards_B, out.get("old"),
                                    on_actor(out["ref"]), values_BN)
    return exp, metrics, verified_B

  def update(self, exp) -> tuple[dict, dict]:
    """Actor (+ critic) updates over the minibatches, then the new weights go to the sampler."""
    t0 = time.perf_counter()

    def learn():
      metrics = self.actor.update(exp)
      if self.critic is not None:
        metrics = {**metrics, **self.critic.update(exp)}
      return metrics

    metrics = self.train(learn, label="update")
    t1 = time.perf_counter()
    self.version += 1
    stats = self.train(self._push, label="reshard" if self.worker is None else "push")
    return metrics, {"time_update": t1 - t0, "time_reshard": time.perf_counter() - t1,
                     "reshard_gbps": stats.gbps}

  def _push(self):
    cluster = self.ctx.cluster
    stats = cluster.sampler.push()
    if self.worker is not None:
      self.worker.update_weights(cluster.sampler.params, self.version)
    return stats

  # -- the loop -------------------------------------------------------------------------------
  def start(self, state: WorkerState | None = None) -> None:
    """Async mode: starts the generator ahead of the trainer, from the first batch not yet
    trained on (it draws the same prompts and keys as the sync loop: max_staleness=0
    reproduces it exactly), or from a checkpoint's generator `state`."""
    if self.cfg.mode != "async":
      return
    ctx, cluster = self.ctx, self.ctx.cluster
    cluster.sampler.in_use = True  # the worker may decode with a copy the trainer replaced
    params = cluster.sampler.fresh()
    common = dict(version=self.version, max_staleness=self.cfg.max_staleness, seed=ctx.cfg.seed,
                  start_index=self.next_index, schedule=self.cfg.async_schedule, state=state)
    if self.cfg.partial_rollouts:
      stream = ctx.generator.stream(params, prompt_width=ctx.task.prompt_len,
                                    live=self.cfg.max_staleness + 1)
      self.worker = PartialRolloutWorker(
          stream, ctx.task.prompts, params,
          span=lambda: ctx.timeline.span("generator", "decode"), **common)
      return

    def generate(params, prompts, key):
      with ctx.timeline.span("generator", "generate"):  # the device time, not the dispatch
        return jax.block_until_ready(ctx.generator.sample(params, prompts, key))

    self.worker = RolloutWorker(generate, ctx.task.prompts, params, **common)

  def next_rollout(self) -> tuple[RolloutBatch, float]:
    """The next batch (its rollout, prompts, index, policy version) and the seconds waited."""
    t0 = time.perf_counter()
    if self.worker is None:
      index = self.next_index
      prompts = self.ctx.task.prompts[index]
      rollout = self.generator(self.ctx.generator.sample,
                               self.ctx.cluster.sampler.fresh(), prompts,
                               rollout_key(self.ctx.cfg.seed, index), label="generate")
      return RolloutBatch(rollout, prompts, self.version, index, 0.0), time.perf_counter() - t0
    try:
      batch = self.worker.get()
    except RolloutWorkerError as e:
      raise ExecutorError("generator", e.__cause__ or e) from (e.__cause__ or e)
    return batch, time.perf_counter() - t0

  def fill_batch(self, batch: RolloutBatch):
    """DAPO's dynamic sampling: while fewer than `prompts_per_step` groups have rewards that
    differ, the next prompt batch is generated too (at most `dynamic_sampling_rounds` more); the
    step's batch is the informative groups in order, filled up with the others when the rounds
    run out. Returns (rollout, prompts, verified_B, oldest policy version, token versions,
    seconds spent generating the extra rounds, metrics)."""
    g, want, parts, rounds, waited = self.cfg.group_size, self.cfg.prompts_per_step, [], 0, 0.0
    n = self.cfg.max_new_tokens
    while True:
      examples_B = np.repeat(batch.prompts["examples"], g)
      verified_B = self.ctx.rewards(batch.rollout, examples_B)
      parts.append((batch, verified_B, informative_groups(verified_B, g)))
      kept = sum(int(p[2].sum()) for p in parts)
      if kept >= want or rounds == self.cfg.dynamic_sampling_rounds:
        break
      rounds += 1
      batch, w = self.next_rollout()
      self.next_index, waited = batch.index + 1, waited + w
    metrics = {"dynamic_rounds": rounds, "informative_frac": min(kept, want) / want}
    version = min(p[0].version for p in parts)
    if len(parts) == 1:
      return (batch.rollout, batch.prompts, verified_B, version, batch.token_versions(n),
              waited, metrics)
    order = [(i, j) for keep in (True, False) for i, p in enumerate(parts)
             for j in np.flatnonzero(p[2] == keep)][:want]
    first = np.cumsum([0] + [len(p[0].prompts["examples"]) for p in parts])
    rows = np.concatenate([(first[i] + j) * g + np.arange(g) for i, j in order])
    with allowed("kept rows", rows):  # the row indices go up; the rollouts stay where they are
      rollout = combine_rollouts(tuple(p[0].rollout for p in parts), rows,
                                 parts[0][0].rollout.lengths_B.sharding)
    examples = np.array([parts[i][0].prompts["examples"][j] for i, j in order], dtype=object)
    verified_B = np.concatenate([parts[i][1][j * g:(j + 1) * g] for i, j in order])
    versions_BN = np.concatenate([p[0].token_versions(n) for p in parts])[rows]
    return rollout, {"examples": examples}, verified_B, version, versions_BN, waited, metrics

  def step(self) -> dict:
    """One RL step; returns its metrics row (host values)."""
    t0, errors = time.perf_counter(), self.ctx.task.user_code_errors.total()
    self._enter("generate")
    batch, waited = self.next_rollout()
    self.next_index = batch.index + 1
    verified_B, extra = None, {}
    if self.cfg.dynamic_sampling:  # verifying the rounds counts as scoring
      rollout, prompts, verified_B, version, versions_BN, more, extra = self.fill_batch(batch)
      waited += more
    else:
      rollout, prompts, version = batch.rollout, batch.prompts, batch.version
      versions_BN = batch.token_versions(self.cfg.max_new_tokens)
    lag = self.version - version
    if self.worker is not None:  # every generated token's lag behind the policy it trains
      extra.update(self._token_lags(rollout, versions_BN))
    self._enter("score")
    exp, exp_metrics, verified_B = self.experience(rollout, prompts, verified_B)
    t_score = time.perf_counter() - t0 - waited
    self._enter("update")
    metrics, times = self.update(exp)
    self._enter("generate")  # between steps (evaluation, checkpoints) too
    if self.offload is not None:
      extra["time_offload"] = self.offload.take_seconds()
    if self.ctx.user_code:  # calls of it scored 0 or ended (async: those of this interval)
      extra["user_code_errors"] = self.ctx.task.user_code_errors.total() - errors
    row = to_host({**exp_metrics, **metrics}, "metrics")
    step_time = time.perf_counter() - t0
    return {**row, **extra, "verified_mean": float(verified_B.mean()), **times,
            "time_generate": waited, "time_score": t_score, "policy_version": self.version,
            "rollout_version": version, "policy_lag": lag, "step_time": step_time,
            "tokens_per_s": float(row["response_tokens"]) / step_time}

  def _token_lags(self, rollout, versions_BN: np.ndarray) -> dict:
    """Policy lag of the rollout's tokens: mean, max and the count per lag (`token_lags`)."""
    lengths_B = to_host(rollout.lengths_B, "lengths")
    lags = (self.version - versions_BN)[np.arange(versions_BN.shape[1]) < lengths_B[:, None]]
    counts = np.bincount(lags, minlength=1) if lags.size else np.zeros(1, np.int64)
    return {"token_lag_mean": float(lags.mean()) if lags.size else 0.0,
            "token_lag_max": int(lags.max(initial=0)), "token_lags": counts.tolist()}

  def close(self) -> None:
    if self.worker is not None:
      self.worker.close()
      self.worker = None
      self.ctx.cluster.sampler.in_use = False
    for ex in (self.generator, self.reward, self.ref, self.values, self.train):
      if ex is not None:
        ex.close()
