"""Attention on a TPU: JAX's Pallas splash attention kernel (a Mosaic kernel: causal tiles above
the diagonal skipped, no [T, S] scores in memory, forward or backward), for the cacheless passes
(training, scoring). Left padding and packed rows are segment ids: a token attends to earlier
tokens of its own segment (padding is segment 0, whose outputs are unused), so one kernel covers
both. Off a TPU it runs in Pallas' interpret mode (the tests check it against the einsum form on
the CPU); a target compile (train/preflight/target_compile.py) builds the TPU kernel.

The kernel runs per shard (`jax.shard_map` over the active layout's batch and head axes: a
Mosaic call is not partitioned by XLA), vmapped over the shard's rows.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxrl import platform
from jaxrl.partitioning import active_spec

BLOCK = 128  # the kernel's tile (a multiple of the TPU's 128 lanes): sequences are padded to it


@functools.partial(jax.tree_util.register_dataclass, data_fields=["ids_BT"],
                   meta_fields=["window"])
@dataclasses.dataclass(frozen=True)
class Segments:
  """The mask of a cacheless splash pass: causal within equal segment ids [B, T] (and within
  `window` positions of each query, if set: a sliding-window layer's)."""
  ids_BT: jax.Array
  window: int = 0


def _kernel(t: int, n: int, interpret: bool, window: int = 0):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  sizes = sk.BlockSizes(block_q=BLOCK, block_kv=BLOCK, block_kv_compute=BLOCK,
                        block_q_dkv=BLOCK, block_kv_dkv=BLOCK, block_kv_dkv_compute=BLOCK,
                        block_q_dq=BLOCK, block_kv_dq=BLOCK)
  head = sm.LocalMask((t, t), (window - 1, 0), 0) if window else sm.CausalMask((t, t))
  mask = sm.MultiHeadMask([head] * n)
  return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                            interpret=interpret), sk.SegmentIds


def _per_shard(q_BTNH, k_BTKH, v_BTKH, ids_BT, *, interpret: bool, window: int):
  """The kernel on one shard's rows: heads first, as the kernel takes them."""
  t, n = q_BTNH.shape[1], q_BTNH.shape[2]
  kernel, segment_ids = _kernel(t, n, interpret, window)
  heads_first = lambda x: x.transpose(0, 2, 1, 3)
  out_BNTH = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=segment_ids(ids, ids)))(
      heads_first(q_BTNH), heads_first(k_BTKH), heads_first(v_BTKH), ids_BT)
  return heads_first(out_BNTH)


def splash(q_BTNH, k_BTKH, v_BTKH, mask: Segments) -> jax.Array:
  """Causal attention within segments, [B, T, N, H] (queries scaled already)."""
  t = q_BTNH.shape[1]
  pad = -t % BLOCK
  ids_BT = mask.ids_BT.astype(jnp.int32)
  if pad:  # padded positions: segment -1, attended by no real token
    widen = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    q_BTNH, k_BTKH, v_BTKH = widen(q_BTNH), widen(k_BTKH), widen(v_BTKH)
    ids_BT = jnp.pad(ids_BT, ((0, 0), (0, pad)), constant_values=-1)
  dt = q_BTNH.dtype
  fn = functools.partial(_per_shard, interpret=platform.backend() != "tpu", window=mask.window)
  args = (q_BTNH, k_BTKH.astype(dt), v_BTKH.astype(dt), ids_BT)
  active = active_spec(("batch", None, "act_heads", None))
  if active is not None:
    mesh, heads_spec = active
    kv_spec = active_spec(("batch", None, "act_kv_heads", None))[1]
    ids_spec = jax.sharding.PartitionSpec(heads_spec[0], None)
    fn = jax.shard_map(fn, mesh=mesh, in_specs=(heads_spec, kv_spec, kv_spec, ids_spec),
                       out_specs=heads_spec, check_vma=False)
  return fn(*args)[:, :t]
