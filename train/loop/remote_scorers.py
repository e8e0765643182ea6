"""The frozen scorers on processes of their own (`placement.scorers_apart`): the reference's
log-prob pass and, where RL has one, the reward model's scores run there, on a mesh of the
trainer's shape, while the trainer computes its own old log-probs and the verifier's rewards.

The trainer's processes keep the scorers' weights in the trainer's layout, in pinned host
memory (a checkpoint reads them there; a resumed run puts them back); the first scoring request
after they change carries them across, and they leave the devices once its reply has come (the
scorers' processes have pulled them in full by then). Each request carries the batch as the
passes take it (the reference's: tokens, valid, completion mask, or the packed rows' plan; the
reward model's: tokens, valid) on the actor's mesh, which crosses as it is to the scorers' mesh
of the same shape, and the reply carries the [B, N] log-probs and the [B] scores back: the same
programs on the same shapes, so the same numbers as on the trainer's devices. One request holds
both (the crossings of one thread, in one order on every process). Requests go through the
session's link (train/roles/link.py), so the generator's processes take part in these crossings
too.
"""
from __future__ import annotations

import functools
import logging

from sharding import crossing
from train.loop.passes import packed_scorer, policy_logprobs, scorer
from train.roles.link import GroupHost
from train.roles.offload import DEVICE, HOST
from train.updates.forward import sequence_scores
from train.updates.packing import Pack

log = logging.getLogger("jaxrl")
TARGET = "scorers"  # the link's name for this group's requests


def _inputs(arrays: dict, packed: bool) -> tuple:
  """The reference pass's inputs from their leaves: (tokens, valid, mask) or (tokens, mask,
  pack)."""
  leaves = crossing.in_order(arrays)
  return (*leaves[:2], Pack(*leaves[2:])) if packed else tuple(leaves)


class RemoteScorers:
  """The trainer's side: `score(...)` returns what the scorers' passes would on the actor's
  mesh."""

  def __init__(self, roles: dict, link_of):
    """`roles`: the trainer's copies of the scorers on the actor's mesh (the reference's, and the
    reward model's where RL has one); `link_of()`: the session's link (the generator's worker
    has it)."""
    self.roles, self._link_of = roles, link_of

  def score(self, inputs: tuple, packed: bool, scored: tuple | None = None) -> tuple:
    """(the reference's [B, N] log-probs, the reward model's [B] scores or None): `inputs` the
    reference pass's, `scored` the reward model's (tokens, valid), both on the actor's mesh."""
    link = self._link_of()
    arrays = {"inputs": crossing.numbered(inputs)}
    if scored is not None:
      arrays["scored"] = crossing.numbered(scored)
    fresh = [r for r in self.roles.values() if r.sent_version != r.version]
    for role in fresh:  # (from a restore, on the devices already; from RL's start, too)
      role.move(DEVICE)
      arrays[f"{role.name}_params"] = crossing.numbered(role.params)
    link.post({"op": "score", "replica": TARGET, "packed": packed}, arrays)
    reply = link.reply(RuntimeError, "the scorers' processes")
    home, there = link.ends(TARGET)
    out = crossing.receive(reply["arrays"], there, home)
    for role in fresh:
      role.move(HOST)
      role.sent_version = role.version
      log.info("scorers: the %s's weights crossed to their processes (version %d)", role.name,
               role.version)
    return out["logprobs"], out.get("scores")


class ScorersHost(GroupHost):
  """The scorers' processes: each scoring request's passes, on the scorers' mesh."""

  target = name = TARGET

  def __init__(self, ctx):
    """`ctx`: the run's context on these processes (train/stages/context.py), its cluster
    abstract; the scorers' weights come with the first request."""
    cluster, rl = ctx.cluster, ctx.cfg.rl
    super().__init__(cluster.split, cluster.split.scorer_processes)
    self.roles = {"reference": cluster.add("reference", initialize=False)}
    if rl.reward == "reward_model":
      self.roles["reward"] = cluster.add("reward", initialize=False)
      reward = self.roles["reward"]
      self.scores_fn = reward.jit(functools.partial(sequence_scores, reward.graphdef))
    reference = self.roles["reference"]
    self.fns = {False: scorer(rl, reference, policy_logprobs(rl)),
                True: packed_scorer(rl, reference)}

  def _score(self, request: dict) -> dict:
    arrays = self.arrived(request)
    for name, role in self.roles.items():
      if f"{name}_params" in arrays:
        log.info("scorers: the %s's weights arrived", name)
        role.adopt(crossing.unnumbered(role.abstract(), arrays[f"{name}_params"]))
    packed = request["packed"]
    out = {"logprobs": self.fns[packed](self.roles["reference"].params,
                                        *_inputs(arrays["inputs"], packed))}
    if "scored" in arrays:
      out["scores"] = self.scores_fn(self.roles["reward"].params,
                                     *crossing.in_order(arrays["scored"]))
    home, _ = self.link.ends(TARGET)
    return {"arrays": crossing.send(out, home)}

