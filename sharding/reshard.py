"""Arrays between layouts and meshes: weights in bounded buckets, batches device to device.

Weights (`reshard`): after every update in the `separate` placement (trainer devices -> sampler
devices) and to switch layouts in place in `colocate` (fsdp for training -> tensor parallel for
decoding). Leaves move a bucket at a time and each bucket is finished before the next starts, so
the extra memory in flight stays under `bucket_bytes` (a single leaf larger than that is its own
bucket). With `donate=True` each source leaf is freed as soon as its bucket has landed. A
trainer sharded across hosts (each process holding part of each weight) reshards by device
programs over its own devices, collectives inside them (`put`), with device-to-host transfers
disallowed: no weight passes through a host.

Batches (`move`): `jax.device_put` copies an array shard for shard between meshes whose shards
hold the same slices, but where they do not (the sampler splits a rollout's rows 2 ways, the
trainer 4 ways) it fetches the whole array to the host and uploads it again. `move` instead cuts
each target shard's rows out of the source shards that hold them, on their own devices, and
copies those pieces device to device: no byte of a rollout visits the host. It handles arrays
split along their first (batch) dimension, as every batch and per-sample result is, on one
process or on several as long as each process already holds the rows its target shards need
(placements give every host its own slice of both meshes); anything else goes through `put`
(a device program where the array is spread over several processes).

Host (`to_host`, `to_device`): the deliberate host transfers, each let through JAX's transfer
guard for its own call only, so that a test disallowing every other host transfer lets exactly
these pass (train/io/host_transfers.py names and counts the run's; in-flight batching moves its
control bytes).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec


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


def cast_sizes(leaves, casts) -> list[int]:
  """Each leaf's bytes in the dtype it moves in (`casts[i]`; None: its own)."""
  return [x.size * np.dtype(c or x.dtype).itemsize for x, c in zip(leaves, casts)]


def _spread_put(x: jax.Array, target) -> jax.Array:
  """An array spread over several processes (a trainer sharded across hosts) laid out as
  `target` by device programs over its own devices: collectives inside them, no byte through
  the host. On the same devices, one reshard; on a whole fraction of them (the sampler's
  `mirror` over the first of the trainer's), `_first_replica`; elsewhere (the sampler's own
  devices on the same hosts), `_from_local_copies`."""
  devices = x.sharding.device_set
  if target.device_set == devices:
    return jax.device_put(x, target)  # (jax: a jitted reshard over the same devices)
  mesh = getattr(target, "mesh", None)
  if mesh is not None and target.device_set < devices and len(devices) % mesh.size == 0:
    return _first_replica(x, target)
  return _from_local_copies(x, target)


def replicas_over(target: NamedSharding, devices) -> NamedSharding:
  """`target`'s layout repeated over all of `devices` (of which its own are a whole fraction,
  the first replica): its mesh with a leading replica axis."""
  mesh = target.mesh
  rest = sorted(set(devices) - target.device_set, key=lambda d: (d.process_index, d.id))
  grid = np.concatenate([mesh.devices.reshape(1, -1), np.asarray(rest, object).reshape(
      -1, mesh.size)]).reshape(-1, *mesh.devices.shape)
  return NamedSharding(Mesh(grid, ("replica", *mesh.axis_names)), target.spec)


def _first_replica(x: jax.Array, target: NamedSharding) -> jax.Array:
  """`target` on a whole fraction of `x`'s devices: the first replica of a layout over all of
  them (`replicas_over`); each process keeps its own shards of that replica."""
  spread = jax.device_put(x, replicas_over(target, x.sharding.device_set))
  local = {s.device: s.data for s in spread.addressable_shards}
  return jax.make_array_from_single_device_arrays(
      x.shape, target, [local[d] for d in target.addressable_devices_indices_map(x.shape)],
      dtype=x.dtype)  # (a process with none of the target's devices holds no shard)


def _from_local_copies(x: jax.Array, target) -> jax.Array:
  """`target` on other devices of the same processes: `x` made whole on each of its devices
  (one reshard over them: a gather inside each host where each holds a whole copy already),
  then each of this process's target shards cut from its own copy, device to device."""
  whole = jax.device_put(x, NamedSharding(x.sharding.mesh, PartitionSpec()))
  local = whole.addressable_shards[0].data
  pieces = [jax.device_put(local[index], device)
            for device, index in target.addressable_devices_indices_map(x.shape).items()]
  return jax.make_array_from_single_device_arrays(x.shape, target, pieces)


def put(x: jax.Array, target, may_alias: bool = False) -> jax.Array:
  """`jax.device_put`; for an array spread over several processes, a device program
  (`_spread_put`)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return jax.device_put(x, target, may_alias=may_alias)
  with jax.transfer_guard_device_to_host("disallow"):
    return _spread_put(x, target)


def _aliases(moved: jax.Array, source: jax.Array) -> bool:
  """Whether `moved` may hold `source`'s buffers: the same array, or a layout equivalent to its
  (over the same devices, e.g. another mesh's shape with the same shards), which `device_put`
  with `may_alias` gives as a new array over the same buffers: deleting the source would delete
  it too."""
  return moved is source or (moved.dtype == source.dtype and
                             moved.sharding.is_equivalent_to(source.sharding, source.ndim))


def reshard(tree, target_shardings, *, bucket_bytes: int = 256 << 20, donate: bool = False,
            on_bucket: Callable[[int], None] | None = None, dtypes=None):
  """Returns (tree in the target layout, TransferStats). `target_shardings` mirrors `tree`
  (or is a prefix of it); `on_bucket(i)` runs when bucket i has landed, before its sources are
  freed (the moment of peak memory). `dtypes` (a tree like `target_shardings`; None leaves:
  unchanged) casts leaves on their source devices before they move, a bucket at a time: the
  sampler's compute-dtype copy of float32 weights moves and holds half the bytes in bf16."""
  leaves, treedef = jax.tree.flatten(tree)
  targets = treedef.flatten_up_to(target_shardings)
  casts = ([None] * len(leaves) if dtypes is None else
           treedef.flatten_up_to(dtypes))
  sizes = cast_sizes(leaves, casts)
  buckets = plan_buckets(sizes, bucket_bytes)
  out = [None] * len(leaves)
  t0 = time.perf_counter()
  for b, idx in enumerate(buckets):
    sources = [leaves[i] if casts[i] in (None, leaves[i].dtype) else leaves[i].astype(casts[i])
               for i in idx]
    # Without donation the result never aliases the source, even where the layouts match (one
    # device): the caller keeps the source, and the trainer donates it to its next update.
    moved = [put(x, targets[i], may_alias=donate or x is not leaves[i])
             for i, x in zip(idx, sources)]
    jax.block_until_ready(moved)
    if on_bucket is not None:
      on_bucket(b)
    for i, x, src in zip(idx, moved, sources):
      out[i] = x
      if src is not leaves[i] and not _aliases(x, src):
        src.delete()  # the cast's temporary
      if donate and not _aliases(x, leaves[i]) and not leaves[i].is_deleted():
        leaves[i].delete()
  seconds = time.perf_counter() - t0
  stats = TransferStats(bytes=sum(sizes), seconds=seconds, buckets=len(buckets),
                        largest_bucket_bytes=max((sum(sizes[i] for i in idx) for idx in buckets),
                                                 default=0))
  return jax.tree.unflatten(treedef, out), stats


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


def _host_value(x):
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return multihost_utils.process_allgather(x, tiled=True)  # every process sees all rows
  return np.asarray(jax.device_get(x))


def to_host(tree):
  """Device arrays -> numpy (on every process, whole); host transfers allowed for this call."""
  with jax.transfer_guard_device_to_host("allow"):
    return jax.tree.map(_host_value, tree)


def to_device(tree, shardings=None):
  """Host arrays -> device arrays laid out as `shardings` (a tree mirroring `tree`; None: on the
  default device); host transfers allowed for this call."""
  upload = lambda x, s=None: jax.device_put(np.asarray(x), s)
  with jax.transfer_guard_host_to_device("allow"):
    if shardings is None:
      return jax.tree.map(upload, tree)
    return jax.tree.map(upload, tree, shardings)
