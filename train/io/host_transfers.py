"""The run's deliberate host transfers, each one named; everything else stays on devices.

An RL step moves prompts up, completion token ids down (for the host verifier), rewards up and
the step's metrics down. Each goes through `to_device` / `to_host` (sharding.reshard's `send` /
`fetch`, named and counted), which allow host transfers for their own thread and call only, so
a test can disallow every other host transfer globally
(`jax.transfer_guard_*("disallow_explicit")`) and any hidden round trip of rollout tokens or
log-probs fails loudly. Rollouts move between meshes device to device (sharding/reshard.py).
The weight push is named too (`allowed("weights", ...)`): where the sampler's layout cuts the
weights differently from the trainer's, `jax.device_put` routes the copy through the host.
`RECORD` counts the named transfers and their bytes.
"""
from __future__ import annotations

import collections
import contextlib

import jax
import numpy as np

from sharding.reshard import fetch, send

RECORD: collections.Counter = collections.Counter()  # name -> bytes moved


def to_host(tree, what: str):
  """Device arrays -> numpy (on every process, whole)."""
  out = fetch(tree)
  RECORD[what] += sum(x.nbytes for x in jax.tree.leaves(out))
  return out


def to_device(tree, shardings, what: str):
  """Host arrays -> device arrays laid out as `shardings` (a tree mirroring `tree`)."""
  out = send(tree, shardings)
  RECORD[what] += sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))
  return out


@contextlib.contextmanager
def allowed(what: str, tree):
  """Host transfers allowed for this thread inside the block, counted as `what`."""
  with jax.transfer_guard("allow"):
    yield
  RECORD[what] += sum(x.nbytes for x in jax.tree.leaves(tree))
