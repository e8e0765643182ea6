"""Resharding transfers: move a parameter pytree into another layout, in bounded buckets.

Used after every update in the `separate` placement (trainer devices -> sampler devices) and to
switch layouts in place in `colocate` (fsdp for training -> tensor parallel for decoding). Leaves
are moved a bucket at a time and each bucket is finished before the next starts, so the extra
memory in flight stays under `bucket_bytes` (a single leaf larger than that is its own bucket).
With `donate=True` each source leaf is freed as soon as its bucket has landed.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax


@dataclasses.dataclass(frozen=True)
class TransferStats:
  bytes: int
  seconds: float
  buckets: int
  largest_bucket_bytes: int

  @property
  def gbps(self) -> float:
    return self.bytes / max(self.seconds, 1e-12) / 1e9


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
  """Greedy, order-preserving grouping of leaf indices into buckets of <= bucket_bytes."""
  buckets, current, filled = [], [], 0
  for i, size in enumerate(sizes):
    if current and filled + size > bucket_bytes:
      buckets.append(current)
      current, filled = [], 0
    current.append(i)
    filled += size
  if current:
    buckets.append(current)
  return buckets


def reshard(tree, target_shardings, *, bucket_bytes: int = 256 << 20, donate: bool = False,
            on_bucket: Callable[[int], None] | None = None):
  """Returns (tree in the target layout, TransferStats). `target_shardings` mirrors `tree`
  (or is a prefix of it); `on_bucket(i)` runs when bucket i has landed, before its sources are
  freed (the moment of peak memory)."""
  leaves, treedef = jax.tree.flatten(tree)
  targets = treedef.flatten_up_to(target_shardings)
  sizes = [x.nbytes for x in leaves]
  buckets = plan_buckets(sizes, bucket_bytes)
  out = [None] * len(leaves)
  t0 = time.perf_counter()
  for b, idx in enumerate(buckets):
    moved = jax.device_put([leaves[i] for i in idx], [targets[i] for i in idx])
    jax.block_until_ready(moved)
    if on_bucket is not None:
      on_bucket(b)
    for i, x in zip(idx, moved):
      out[i] = x
      if donate and x is not leaves[i] and not leaves[i].is_deleted():
        leaves[i].delete()
  seconds = time.perf_counter() - t0
  stats = TransferStats(bytes=sum(sizes), seconds=seconds, buckets=len(buckets),
                        largest_bucket_bytes=max((sum(sizes[i] for i in idx) for idx in buckets),
                                                 default=0))
  return jax.tree.unflatten(treedef, out), stats
