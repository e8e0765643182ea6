"""Scoring a rollout batch: the reward (the host verifier or the reward model), the reference's
and the actor's old log-probs, the critic's values, each on its role's executor so they overlap,
and the Experience they make on the trainer's mesh (train/rl/experience.py)."""
from __future__ import annotations

import functools

import numpy as np

from jaxrl.config import RLConfig
from jaxrl.data.pipeline import bucket_length
from train.io.host_transfers import to_device, to_host
from train.rl.executors import Executors
from train.rl.experience import make_experience, trim_rollout
from train.roles.cluster import RoleCluster
from train.roles.learner import Learner
from train.task.task import Judge
from train.updates.batching import map_minibatches
from train.updates.forward import completion_logprobs, completion_values, sequence_scores


def _moved(role, rollout, *, mask: bool = True, routes: bool = False) -> tuple:
  """(tokens, valid[, completion mask[, routes]]) of the rollout moved to `role`'s mesh, device
  to device (`routes`: a mixture of experts' recorded routes, for the log-prob passes).
  Moves are issued from the controller's thread before the passes start on their executors, so
  no source array is read by several threads at once."""
  extra = (rollout.routes_BTLK,) if routes and rollout.routes_BTLK is not None else ()
  return role.put((rollout.tokens_BT, rollout.valid_BT)
                  + ((rollout.completion_mask_BN,) + extra if mask else ()))


def _on(role, fn, arrays: tuple):
  """`fn(params, *arrays)` on `role`'s mesh (`arrays`: `_moved` there)."""
  return fn(role.params, *arrays)


def logprobs(graphdef, params, tokens_BT, valid_BT, routes_BTLK=None, *, prompt_len: int):
  """The completion tokens' log-probs (completion_logprobs without its entropies)."""
  return completion_logprobs(graphdef, params, tokens_BT, valid_BT, prompt_len, routes_BTLK)[0]


def scorer(cfg: RLConfig, role, fn):
  """`fn` (logprobs, completion_values) over a rollout batch on `role`'s mesh, jitted:
  (params, tokens [B, T], valid [B, T], completion mask [B, N][, routes [B, T, L, k]]) ->
  [B, N], in the update's pieces of `cfg.pass_rows` rows."""
  n = cfg.rollouts // cfg.pass_rows

  def score(params, tokens_BT, valid_BT, mask_BN, *routes):  # the prompt length: the shapes
    p_len = tokens_BT.shape[1] - mask_BN.shape[1]
    return map_minibatches(lambda mb: fn(role.graphdef, params, *mb, prompt_len=p_len),
                           (tokens_BT, valid_BT, *routes), n)
  return role.jit(score)


class Scoring:

  def __init__(self, cfg: RLConfig, cluster: RoleCluster, actor: Learner, critic: Learner | None,
               judge: Judge, executors: Executors):
    self.cfg, self.actor, self.critic, self.judge, self.ex = cfg, actor, critic, judge, executors
    self.reference, self.reward_model = cluster.get("reference"), cluster.get("reward")
    self.ref_logprobs_fn = scorer(cfg, self.reference, logprobs)
    self.old_logprobs_fn = scorer(cfg, actor.role, logprobs)
    if critic is not None:
      self.values_fn = scorer(cfg, critic.role, completion_values)
    if self.reward_model is not None:
      self.scores_fn = self.reward_model.jit(functools.partial(sequence_scores,
                                                               self.reward_model.graphdef))
    self.experience_fn = actor.role.jit(functools.partial(
        make_experience, cfg=cfg, stop_ids=tuple(judge.tok.stop_ids) if judge else ()))

  def _rewards(self, rollout, examples_B, verified_B=None, scored=None):
    """(rewards on the trainer's mesh, verified_B on the host; given: already verified).
    `scored`: the rollout `_moved` to the reward model (with one)."""
    if verified_B is None:
      verified_B = self.judge.rewards(rollout, examples_B)
    role = self.actor.role
    if self.reward_model is None:
      return to_device(verified_B, role.batch_shardings(verified_B), "rewards"), verified_B
    return role.put(_on(self.reward_model, self.scores_fn, scored)), verified_B

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
    rollout, ex = self.trimmed(rollout), self.ex
    scored = (None if self.reward_model is None else
              _moved(self.reward_model, rollout, mask=False))
    calls = {"reward": (ex.reward, (self._rewards, rollout, examples_B, verified_B, scored),
                        "score"),
             "ref": (ex.reference, (_on, self.reference, self.ref_logprobs_fn,
                                    _moved(self.reference, rollout)), "ref logprobs")}
    if self.cfg.needs_old_logprobs:
      calls["old"] = (ex.trainer, (_on, self.actor.role, self.old_logprobs_fn,
                                   _moved(self.actor.role, rollout, routes=True)),
                      "old logprobs")
    if self.critic is not None:
      calls["values"] = (ex.critic, (_on, self.critic.role, self.values_fn,
                                     _moved(self.critic.role, rollout)), "values")
    futures = {k: (e, e.submit(*args, label=label)) for k, (e, args, label) in calls.items()}
    out = {k: e.result(f) for k, (e, f) in futures.items()}
    (rewards_B, verified_B), on_actor = out["reward"], self.actor.role.put
    values_BN = on_actor(out["values"]) if "values" in out else None
    exp, metrics = self.experience_fn(on_actor(rollout), rewards_B, out.get("old"),
                                      on_actor(out["ref"]), values_BN)
    return exp, metrics, verified_B
