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
import itertools
import time

import jax
import numpy as np

from sampler.worker import RolloutWorker, RolloutWorkerError, rollout_key
from train import steps
from train.executors import Executor, ExecutorError
from jaxrl.algos.advantages import informative_groups
from jaxrl.data.pipeline import bucket_length
from train.experience import combine_rollouts, make_experience, trim_rollout
from train.learner import Learner
from train.host_transfers import allowed, to_device, to_host


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
        return steps.map_minibatches(lambda mb: fn(role.graphdef, params, *mb, prompt_len=p_len),
                                     (tokens_BT, valid_BT), n)
      return role.jit(score)
    logp = lambda *args, **kw: steps.completion_logprobs(*args, **kw)[0]
    self._ref_logp, self._old_logp = scorer(self.reference, logp), scorer(actor.role, logp)
    if critic is not None:
      self._values_fn = scorer(critic.role, steps.completion_values)
    if self.reward_model is not None:
      self._scores_fn = self.reward_model.jit(functools.partial(steps.sequence_scores,
                                                                self.reward_model.graphdef))
    self._experience = actor.role.jit(functools.partial(make_experience, cfg=self.cfg))

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
    stats = cluster.push()
    if self.worker is not None:
      self.worker.update_weights(cluster.sampler_params, self.version)
    return stats

  # -- the loop -------------------------------------------------------------------------------
  def start(self) -> None:
    """Async mode: starts the generator ahead of the trainer, from the first batch not yet
    trained on (it draws the same prompts and keys as the sync loop: max_staleness=0
    reproduces it exactly)."""
    if self.cfg.mode != "async":
      return
    data, seed = self.ctx.task.prompts, self.ctx.cfg.seed

    def generate(params, prompts, key):
      with self.ctx.timeline.span("generator", "generate"):  # the device time, not the dispatch
        return jax.block_until_ready(self.ctx.generator.sample(params, prompts, key))

    stream = (data[i] for i in itertools.count(self.next_index))
    self.ctx.cluster.copy_shared = True  # the worker may decode with a copy the trainer replaced
    self.worker = RolloutWorker(generate, stream, self.ctx.cluster.fresh_sampler_params(),
                                version=self.version, max_staleness=self.cfg.max_staleness,
                                queue_size=self.cfg.max_staleness + 1, seed=seed,
                                start_index=self.next_index)

  def next_rollout(self):
    """(rollout, prompts, its batch index, its policy version, seconds waited for it)."""
    t0 = time.perf_counter()
    if self.worker is None:
      index = self.next_index
      prompts = self.ctx.task.prompts[index]
      rollout = self.generator(self.ctx.generator.sample,
                               self.ctx.cluster.fresh_sampler_params(), prompts,
                               rollout_key(self.ctx.cfg.seed, index), label="generate")
      return rollout, prompts, index, self.version, time.perf_counter() - t0
    try:
      batch = self.worker.get()
    except RolloutWorkerError as e:
      raise ExecutorError("generator", e.__cause__ or e) from (e.__cause__ or e)
    return batch.rollout, batch.prompts, batch.index, batch.version, time.perf_counter() - t0

  def fill_batch(self, rollout, prompts, version):
    """DAPO's dynamic sampling: while fewer than `prompts_per_step` groups have rewards that
    differ, the next prompt batch is generated too (at most `dynamic_sampling_rounds` more); the
    step's batch is the informative groups in order, filled up with the others when the rounds
    run out. Returns (rollout, prompts, verified_B, oldest policy version, seconds spent
    generating the extra rounds, metrics)."""
    g, want, parts, rounds, waited = self.cfg.group_size, self.cfg.prompts_per_step, [], 0, 0.0
    while True:
      examples_B = np.repeat(prompts["examples"], g)
      verified_B = self.ctx.rewards(rollout, examples_B)
      parts.append((rollout, prompts["examples"], verified_B,
                    informative_groups(verified_B, g)))
      kept = sum(int(p[3].sum()) for p in parts)
      if kept >= want or rounds == self.cfg.dynamic_sampling_rounds:
        break
      rounds += 1
      rollout, prompts, index, v, w = self.next_rollout()
      self.next_index, version, waited = index + 1, min(version, v), waited + w
    metrics = {"dynamic_rounds": rounds, "informative_frac": min(kept, want) / want}
    if len(parts) == 1:
      return rollout, prompts, verified_B, version, waited, metrics
    order = [(i, j) for keep in (True, False) for i, p in enumerate(parts)
             for j in np.flatnonzero(p[3] == keep)][:want]
    first = np.cumsum([0] + [len(p[1]) for p in parts])
    rows = np.concatenate([(first[i] + j) * g + np.arange(g) for i, j in order])
    with allowed("kept rows", rows):  # the row indices go up; the rollouts stay where they are
      rollout = combine_rollouts(tuple(p[0] for p in parts), rows, parts[0][0].lengths_B.sharding)
    examples = np.array([parts[i][1][j] for i, j in order], dtype=object)
    verified_B = np.concatenate([parts[i][2][j * g:(j + 1) * g] for i, j in order])
    return rollout, {"examples": examples}, verified_B, version, waited, metrics

  def step(self) -> dict:
    """One RL step; returns its metrics row (host values)."""
    t0 = time.perf_counter()
    rollout, prompts, index, version, waited = self.next_rollout()
    self.next_index = index + 1
    verified_B, extra = None, {}
    if self.cfg.dynamic_sampling:  # verifying the rounds counts as scoring
      rollout, prompts, verified_B, version, more, extra = self.fill_batch(rollout, prompts,
                                                                           version)
      waited += more
    lag = self.version - version
    exp, exp_metrics, verified_B = self.experience(rollout, prompts, verified_B)
    t_score = time.perf_counter() - t0 - waited
    metrics, times = self.update(exp)
    row = to_host({**exp_metrics, **metrics}, "metrics")
    step_time = time.perf_counter() - t0
    return {**row, **extra, "verified_mean": float(verified_B.mean()), **times,
            "time_generate": waited, "time_score": t_score, "policy_version": self.version,
            "rollout_version": version, "policy_lag": lag, "step_time": step_time,
            "tokens_per_s": float(row["response_tokens"]) / step_time}

  def close(self) -> None:
    if self.worker is not None:
      self.worker.close()
      self.worker = None
      self.ctx.cluster.copy_shared = False
    for ex in (self.generator, self.reward, self.ref, self.values, self.train):
      if ex is not None:
        ex.close()
