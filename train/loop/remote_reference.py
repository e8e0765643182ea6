"""The frozen reference on processes of its own (`placement.reference_apart`): its log-prob
pass runs there, on a mesh of the trainer's shape, while the trainer computes its own.

The trainer's processes keep the reference's weights in the trainer's layout, in pinned host
memory (a checkpoint reads them there; a resumed run puts them back); the first scoring request
after they change carries them across, and they leave the devices once its reply has come (the
reference's processes have pulled them in full by then). Each request carries the batch as the
reference's pass takes it (tokens, valid, completion mask; or the packed rows' plan) on the
actor's mesh, which crosses as it is to the reference's mesh of the same shape, and the reply
carries its [B, N] log-probs back: the same program on the same shapes, so the same numbers as
on the trainer's devices. Requests go through the session's link (train/roles/link.py), so the
generator's processes take part in these crossings too.
"""
from __future__ import annotations

import logging

import jax

from jaxrl.config import ConfigError
from sharding import crossing
from train.loop.passes import logprobs, packed_scorer, scorer
from train.roles.link import GroupHost
from train.roles.offload import DEVICE, HOST
from train.updates.packing import Pack

log = logging.getLogger("jaxrl")


def _inputs(arrays: dict, packed: bool) -> tuple:
  """The pass's inputs from their leaves: (tokens, valid, mask) or (tokens, mask, pack)."""
  leaves = crossing.in_order(arrays)
  return (*leaves[:2], Pack(*leaves[2:])) if packed else tuple(leaves)


class RemoteReference:
  """The trainer's side: `logprobs(inputs, packed)` as the reference's pass would return them
  on the actor's mesh."""

  def __init__(self, role, link_of):
    """`role`: the trainer's copy of the reference (the actor's mesh); `link_of()`: the
    session's link (the generator's worker has it)."""
    self.role, self._link_of = role, link_of

  def logprobs(self, inputs: tuple, packed: bool) -> jax.Array:
    link, role = self._link_of(), self.role
    arrays = {"inputs": crossing.numbered(inputs)}
    fresh = role.sent_version != role.version
    if fresh:  # (from a restore, on the devices already; from RL's start, too)
      role.move(DEVICE)
      arrays["params"] = crossing.numbered(role.params)
    link.post({"op": "score", "replica": "reference", "packed": packed}, arrays)
    reply = link.replies.take(link.n - 1)
    if "error" in reply:
      cause = ConfigError(reply["error"]) if reply.get("config") else None
      raise RuntimeError(f"the reference's processes failed: {reply['error']}") from cause
    home, there = link.ends("reference")
    out = crossing.receive(reply["arrays"], there, home)["logprobs"]
    if fresh:
      role.move(HOST)
      role.sent_version = role.version
    return out


class ReferenceHost(GroupHost):
  """The reference's processes: each scoring request's pass, on the reference's mesh."""

  target = name = "reference"

  def __init__(self, ctx):
    """`ctx`: the run's context on these processes (train/stages/context.py), its cluster
    abstract; the reference's weights come with the first request."""
    super().__init__(ctx.cluster.split, ctx.cluster.split.scorer_processes)
    self.role = ctx.cluster.add("reference", initialize=False)
    self.fns = {False: scorer(ctx.cfg.rl, self.role, logprobs),
                True: packed_scorer(ctx.cfg.rl, self.role)}

  def _score(self, request: dict) -> dict:
    arrays = self.arrived(request)
    if "params" in arrays:
      log.info("reference: its weights arrived (%d arrays)", len(arrays["params"]))
      self.role.adopt(crossing.unnumbered(self.role.abstract(), arrays["params"]))
    packed = request["packed"]
    out = self.fns[packed](self.role.params, *_inputs(arrays["inputs"], packed))
    home, _ = self.link.ends("reference")
    return {"arrays": crossing.send({"logprobs": out}, home)}
