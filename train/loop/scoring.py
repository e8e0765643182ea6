"""Scoring a rollout batch: the reward (the host verifier or the reward model), the reference's
and the actor's old log-probs, the critic's values, each on its role's executor so they overlap,
and the Experience they make on the trainer's mesh (train/loop/experience.py)."""
from __future__ import annotations

import functools

import jax
import numpy as np

from jaxrl.config_rl import RLConfig
from jaxrl.data.pipeline import bucket_length
from train.io.host_transfers import HostTransfers
from train.loop.executors import Executors
from train.loop.experience import make_experience, trim_rollout
from train.loop.passes import (critic_values, logprob_scorer, packed_scorer, reward_scores,
                               scorer)
from train.loop.remote_scorers import RemoteScorers
from train.roles.cluster import RoleCluster
from train.roles.learner import Learner
from train.task.reward import Judge
from sharding.reshard import move
from sharding.rules import batch_ways
from train.updates import packing


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


class Scoring:

  def __init__(self, cfg: RLConfig, cluster: RoleCluster, actor: Learner, critic: Learner | None,
               judge: Judge, executors: Executors, *, transfers: HostTransfers | None = None,
               link_of=None, engine_replay=None):
    """`transfers`: the run's named host transfers (rewards up, rows' lengths down);
    `link_of()`: the session's link to the groups apart (the scorers', where they are one);
    `engine_replay`: where the engine drew exact rows, their replay, which is then the actor's
    old log-prob pass (train/loop/engine_replay.py)."""
    self.cfg, self.actor, self.critic, self.judge, self.ex = cfg, actor, critic, judge, executors
    self.transfers = HostTransfers() if transfers is None else transfers
    self.reference, self.reward_model = cluster.get("reference"), cluster.get("reward")
    self.remote = None  # (the reference's and the reward model's passes, on their processes)
    self.critic_apart = critic is not None and "critic" in cluster.apart
    if "reference" in cluster.apart:
      self.remote = RemoteScorers({r.name: r for r in (self.reference, self.reward_model)
                                   if r is not None}, link_of,
                                  critic if self.critic_apart else None)
    # (reference, old) log-prob passes over the [B, T] batch, and over packed rows (`experience`
    # takes the actor's [B, T] one either way under `exact="replay"`: the decode loop's rows)
    self.replays = cfg.rollout.exact == "replay"
    self.logprob_fns = {packed: tuple(
        packed_scorer(cfg, r) if packed else logprob_scorer(cfg, r, r is actor.role)
        for r in (self.reference, actor.role)) for packed in (False, True)}
    self.engine_replay = engine_replay
    if critic is not None:
      self.values_fn = scorer(cfg, critic.role, critic_values(cfg))
    if self.reward_model is not None and self.remote is None:
      self.scores_fn = self.reward_model.jit(reward_scores(cfg, self.reward_model.graphdef))
    self.experience_fn = actor.role.jit(functools.partial(
        make_experience, cfg=cfg, stop_ids=tuple(judge.tok.stop_ids) if judge else ()))

  def _rewards(self, rollout, examples_B, verified_B=None, scored=None):
    """(rewards on the trainer's mesh, verified_B on the host; given: already verified).
    `scored`: the rollout `_moved` to the reward model (with one, None where it scores apart:
    then no rewards here)."""
    if verified_B is None:
      verified_B = self.judge.rewards(rollout, examples_B)
    role = self.actor.role
    if scored is not None:
      return role.put(_on(self.reward_model, self.scores_fn, scored)), verified_B
    if self.reward_model is not None:  # (its scores come with the reference's reply)
      return None, verified_B
    return (self.transfers.to_device(verified_B, role.batch_shardings(verified_B), "rewards"),
            verified_B)

  def trimmed(self, rollout, lengths_B: np.ndarray):
    """The rollout with its completion slots cut to the bucket (`rl.batching.length_buckets`) of its
    longest response (`lengths_B`: its rows' lengths, fetched): scoring and the update then skip
    the slots no row reached."""
    if self.cfg.rollout.exact:  # (its log-probs were the pass's over every slot)
      return rollout
    budget = rollout.completion_mask_BN.shape[1]
    n = bucket_length(int(lengths_B.max(initial=0)), budget, self.cfg.batching.length_buckets)
    return rollout if n == budget else trim_rollout(rollout, n)

  def pack(self, rollout, lengths_B: np.ndarray, valid_B: np.ndarray):
    """`rl.batching.pack_length`: the plan of the trimmed rollout's packed rows
    (train/updates/packing.py, from its rows' completion lengths and valid tokens, fetched), and
    the share of its slots that are padding."""
    p = rollout.tokens_BT.shape[1] - rollout.completion_mask_BN.shape[1]
    shards = batch_ways(self.actor.role.mesh, self.actor.role.rules)
    rows = self.cfg.pass_rows
    # eighths of a piece's rows (multiples of the data shards): at most 8 programs a pass,
    # at most 1/8 of the packed rows padding (powers of two left up to half)
    buckets = tuple(sorted({min(rows, -(-rows * k // (8 * shards)) * shards)
                            for k in range(1, 9)}))
    pack = packing.plan(valid_B - lengths_B, lengths_B, prompt_width=p,
                        completion_slots=rollout.completion_mask_BN.shape[1],
                        pieces=self.cfg.rollouts // rows, length=self.cfg.batching.pack_length,
                        row_buckets=buckets,
                        group=self.cfg.group_size if self.cfg.shares_prefix else 1)
    return pack, 1.0 - valid_B.sum() / pack.packed_tokens

  def _inputs(self, role, rollout, pack, routes: bool = False):
    """What `role`'s log-prob pass takes, moved to its mesh (`pack`: already there)."""
    if pack is None:
      return _moved(role, rollout, routes=routes)
    arrays = role.put((rollout.tokens_BT, rollout.completion_mask_BN))
    extra = role.put((rollout.routes_BTLK,)) if routes and rollout.routes_BTLK is not None else ()
    return arrays + (pack,) + extra

  def _packed(self, rollout):
    """(the trimmed rollout, its pack or None, the packed rows' padding share): the rows'
    lengths fetched once for both."""
    if not self.cfg.batching.pack_length:
      return self.trimmed(rollout, self.transfers.to_host(rollout.lengths_B, "lengths")), None, None
    lengths_B, valid_B = self.transfers.to_host((rollout.lengths_B, rollout.valid_BT.sum(axis=1)),
                                                "lengths")
    rollout = self.trimmed(rollout, lengths_B)
    pack, padding = self.pack(rollout, lengths_B, valid_B)
    if pack.packed_tokens >= rollout.tokens_BT.size:
      return rollout, None, None  # packing would not save slots (rows near the budget)
    return rollout, pack, padding

  def old_pass(self, check: bool) -> bool:
    """Whether this step runs the actor's old log-prob pass: where the update needs them apart,
    except under exact sync rollouts (`sampler_is_trainer`: the sampler's are those, bit for bit),
    which run it only to `check` that (then the mismatch metrics measure it; else pi_old is
    the sampler's)."""
    cfg = self.cfg
    return check if cfg.sampler_is_trainer else cfg.needs_old_logprobs

  def experience(self, rollout, prompts, verified_B=None, *, check: bool = False):
    """Scores one rollout batch (the reward, reference, critic and old-log-prob calls overlap)
    and assembles its Experience on the trainer's mesh: (experience, metrics, verified_B).
    `check`: exact sync rollouts' check step (`old_pass`)."""
    examples_B = np.repeat(prompts["examples"], self.cfg.group_size)
    (rollout, pack, packed_padding), ex = self._packed(rollout), self.ex
    # the pack, replicated on each log-prob pass's mesh (the actor's also feeds the update)
    packs = {} if pack is None else {
        r: move(pack, jax.tree.map(lambda _, r=r: r.replicated, pack))
        for r in (self.reference, self.actor.role)}
    scored = (None if self.reward_model is None else
              _moved(self.reward_model, rollout))
    old_packed = pack is not None and not self.replays
    ref_fn, old_fn = self.logprob_fns[pack is not None][0], self.logprob_fns[old_packed][1]
    ref_in, remote = self._inputs(self.reference, rollout, packs.get(self.reference)), self.remote
    values_in = _moved(self.actor.role, rollout) if self.critic_apart else None
    calls = {"reward": (ex.reward, (self._rewards, rollout, examples_B, verified_B,
                                    scored if remote is None else None), "score"),
             "ref": (ex.reference, (_on, self.reference, ref_fn, ref_in) if remote is None
                     else (remote.score, ref_in, pack is not None, scored, values_in),
                     "ref logprobs")}
    if self.old_pass(check):
      old_pack = packs[self.actor.role] if old_packed else None
      if self.engine_replay is not None:  # (the engine's host loop, run again)
        old_fn, old_in = self.engine_replay.replayed, (rollout,)
      else:
        old_in = self._inputs(self.actor.role, rollout, old_pack, routes=True)
      calls["old"] = (ex.trainer, (_on, self.actor.role, old_fn, old_in), "old logprobs")
    if self.critic is not None and not self.critic_apart:
      calls["values"] = (ex.critic, (_on, self.critic.role, self.values_fn,
                                     _moved(self.critic.role, rollout)), "values")
    futures = {k: (e, e.submit(*args, label=label)) for k, (e, args, label) in calls.items()}
    out = {k: e.result(f) for k, (e, f) in futures.items()}
    (rewards_B, verified_B), on_actor = out["reward"], self.actor.role.put
    if remote is not None:  # ([B, N] log-probs, [B] scores or None, [B, N] values or None)
      out["ref"], scores_B, values_BN = out["ref"]
      rewards_B = rewards_B if scores_B is None else on_actor(scores_B)
      if values_BN is not None:
        out["values"] = values_BN
    values_BN = on_actor(out["values"]) if "values" in out else None
    rollout = on_actor(rollout)
    old_BN = rollout.logprobs_BN if self.cfg.sampler_is_trainer else None  # (`old_pass`)
    exp, metrics = self.experience_fn(rollout, rewards_B, out.get("old", old_BN),
                                      on_actor(out["ref"]), values_BN)
    if pack is not None:  # the update's forward runs over the packed rows too
      exp = exp.replace(pack=packs[self.actor.role])
      metrics = {**metrics, "padding_fraction": packed_padding}
    return exp, metrics, verified_B
