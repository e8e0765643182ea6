"""Batches between meshes, device to device.

`jax.device_put` copies an array shard for shard between meshes whose shards hold the same
slices, but where they do not (the sampler splits a rollout's rows 2 ways, the trainer 4 ways)
it fetches the whole array to the host and uploads it again. `move` instead cuts each target
shard's rows out of the source shards that hold them, on their own devices, and copies those
pieces device to device: no byte of a rollout visits the host. It handles arrays split along
their first (batch) dimension, as every batch and per-sample result is, on one process or on
several as long as each process already holds the rows its target shards need (placements give
every host its own slice of both meshes); anything else goes through `sharding.reshard.put`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sharding.reshard import put


@functools.cache
def _row_slice(start: int, stop: int):
  return jax.jit(lambda x: jax.lax.slice_in_dim(x, start, stop, axis=0))


_concat = jax.jit(lambda parts: jnp.concatenate(parts, axis=0))


def _row_range(index: tuple, n: int) -> tuple[int, int] | None:
  """The rows [start, stop) of a shard index, or None if it also cuts another dimension."""
  if any(s != slice(None) for s in index[1:]):
    return None
  start, stop, _ = (index[0] if index else slice(None)).indices(n)
  return start, stop


def _shard_rows(x: jax.Array, device, start: int, stop: int) -> jax.Array:
  """Rows [start, stop) of `x` on `device`, cut from the source shards holding them."""
  sources = [(_row_range(s.index, x.shape[0]), s.data) for s in x.addressable_shards]
  parts, at = [], start
  while at < stop:
    holding = [(rows, data) for rows, data in sources if rows[0] <= at < rows[1]]
    (lo, hi), data = next(((r, d) for r, d in holding if d.devices() == {device}), holding[0])
    end = min(hi, stop)
    piece = data if (at, end) == (lo, hi) else _row_slice(at - lo, end - lo)(data)
    parts.append(jax.device_put(piece, device))
    at = end
  return parts[0] if len(parts) == 1 else _concat(parts)


def _movable(x, target) -> bool:
  """Row-split source and target, and this process holds every row its target shards need."""
  if not isinstance(x, jax.Array) or x.ndim == 0:
    return False
  n = x.shape[0]
  have = [_row_range(s.index, n) for s in x.addressable_shards]
  need = [_row_range(i, n) for i in target.addressable_devices_indices_map(x.shape).values()]
  if any(r is None for r in have + need):
    return False
  covered, reach = [], 0  # the rows this process holds, as disjoint intervals
  for lo, hi in sorted(have):
    if covered and lo <= reach:
      reach = max(reach, hi)
      covered[-1] = (covered[-1][0], reach)
    else:
      covered.append((lo, hi))
      reach = hi
  return all(any(lo <= a and b <= hi for lo, hi in covered) for a, b in need)


def move_array(x, target: jax.sharding.Sharding):
  """`x` laid out as `target`, device to device where `x` is on devices."""
  if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(target, x.ndim):
    return jax.device_put(x, target)  # already there, laid out so
  if not _movable(x, target):
    return put(x, target)
  n = x.shape[0]
  shards = [_shard_rows(x, device, *_row_range(index, n))
            for device, index in target.addressable_devices_indices_map(x.shape).items()]
  return jax.make_array_from_single_device_arrays(x.shape, target, shards)


def move(tree, target_shardings):
  """Every leaf of `tree` laid out as the sharding at its place in `target_shardings`."""
  return jax.tree.map(move_array, tree, target_shardings)
