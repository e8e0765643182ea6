"""Idle-role offload: what a phase of the RL step does not use waits in pinned host memory.

In a sync step the phases run in turn: generate (the sampler's copy, the KV cache), score (the
frozen models, the actor's old log-probs), update (the trained parameters, their optimizer
state). `placement.offload` names what waits off the devices outside its phase:

  optimizer  the trained roles' optimizer states (Adam: 8 bytes per trained parameter) live on
             the devices only during the update
  frozen     the reference's and the reward model's parameters only while scoring (a LoRA
             reference that is the actor's own base stays: it is the actor)
  sampler    the sampler's copy of the actor is dropped before the update; the push after the
             update rebuilds it, as it would anyway (nothing is copied to the host)

A move is `jax.device_put` to the same sharding in another memory kind (`pinned_host` <->
`device`): every array comes back bit-identical, in its own layout. Moves run on the trainer's
executor, so they appear in trace.json as `offload` / `onload` slices with their bytes, and
the step's metrics count their seconds (`time_offload`).
"""
from __future__ import annotations

import time

import jax

HOST, DEVICE = "pinned_host", "device"


def moved(tree, kind: str):
  """(`tree` in memory `kind`, same shardings otherwise; the bytes moved). The copies are
  complete and their sources freed on return; leaves already there are kept as they are."""
  def put(x):
    return x if x.sharding.memory_kind == kind else jax.device_put(
        x, x.sharding.with_memory_kind(kind))
  out = jax.block_until_ready(jax.tree.map(put, tree))
  size = 0
  for old, new in zip(jax.tree.leaves(tree), jax.tree.leaves(out)):
    if old is not new:
      size += new.nbytes
      old.delete()
  return out, size


class Offloader:
  """Moves the configured items for each phase of a sync RL step (`enter(phase)`)."""

  RESIDENT = {"generate": (), "score": ("frozen",), "update": ("optimizer",)}

  def __init__(self, items, cluster, learners, timeline):
    self.items, self.cluster, self.timeline = tuple(items), cluster, timeline
    self.learners = [l for l in learners if l is not None]
    self.seconds = 0.0

  def _frozen_roles(self):
    return [r for name, r in self.cluster.roles.items() if name in ("reference", "reward")
            and name not in self.cluster.shared | self.cluster.apart]

  def _move(self, item: str, kind: str) -> None:
    start, size = time.perf_counter(), 0
    if item == "optimizer":
      size = sum(learner.move_state(kind) for learner in self.learners)
    elif item == "frozen":
      size = sum(role.move(kind) for role in self._frozen_roles())
    if size:
      end = time.perf_counter()
      self.seconds += end - start
      label = "offload" if kind == HOST else "onload"
      self.timeline.add("trainer", f"{label} {item}", start, end, bytes=size)

  def enter(self, phase: str) -> None:
    """Before `phase` (generate | score | update): the items it does not use off the devices
    first (the sampler's copy dropped for an update), then its own onto them, so the devices
    never hold both at once."""
    items = [i for i in ("optimizer", "frozen") if i in self.items]
    for item in items:
      if item not in self.RESIDENT[phase]:
        self._move(item, HOST)
    if phase == "update" and "sampler" in self.items:
      self.cluster.sampler_weights.drop()
    for item in items:
      if item in self.RESIDENT[phase]:
        self._move(item, DEVICE)

  def take_seconds(self) -> float:
    out, self.seconds = self.seconds, 0.0
    return out
