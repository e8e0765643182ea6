"""The run's deliberate host transfers, each one named; everything else stays on devices.

An RL step moves prompts up, completion token ids down (for the host verifier), rewards up and
the step's metrics down. Each goes through `HostTransfers.to_device` / `to_host`
(sharding.reshard's `to_device` / `to_host`, named and counted), which allow host transfers for
their own thread and call only, so a test can disallow every other host transfer globally
(`jax.transfer_guard_*("disallow_explicit")`) and any hidden round trip of rollout tokens or
log-probs fails loudly. Rollouts move between meshes device to device (sharding/reshard.py).
The weight push is named too (`allowed("weights", ...)`): where the sampler's layout cuts the
weights differently from the trainer's, `jax.device_put` routes the copy through the host.

A run's `HostTransfers` is its RunContext's (train/stages/context.py), handed to the pieces that
move data to or from the host; `record()` is the bytes each name moved. The executors' threads
count into it at once (a `Tally`).
"""
from __future__ import annotations

import contextlib

import jax
import numpy as np

from sharding.reshard import to_device, to_host
from train.io.tally import Tally


class HostTransfers:
  """Named host transfers and the bytes each name moved, counted from any thread."""

  def __init__(self):
    self._bytes = Tally()  # name -> bytes moved

  def count(self, what: str, nbytes: int) -> None:
    self._bytes.add({what: int(nbytes)})

  def record(self) -> dict[str, int]:
    """{name: bytes moved} so far (a copy)."""
    return self._bytes.snapshot()

  def clear(self) -> None:
    self._bytes.clear()

  def to_host(self, tree, what: str):
    """Device arrays -> numpy (on every process, whole)."""
    out = to_host(tree)
    self.count(what, sum(x.nbytes for x in jax.tree.leaves(out)))
    return out

  def to_device(self, tree, shardings, what: str):
    """Host arrays -> device arrays laid out as `shardings` (a tree mirroring `tree`)."""
    out = to_device(tree, shardings)
    self.count(what, sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)))
    return out

  @contextlib.contextmanager
  def allowed(self, what: str, tree):
    """Host transfers allowed for this thread inside the block, counted as `what`."""
    with jax.transfer_guard("allow"):
      yield
    self.count(what, sum(x.nbytes for x in jax.tree.leaves(tree)))
