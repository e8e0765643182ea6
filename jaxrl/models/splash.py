"""Attention on a TPU: JAX's Pallas splash attention kernel (a Mosaic kernel: causal tiles above
the diagonal skipped, no [T, S] scores in memory, forward or backward), for the cacheless passes
(training, scoring) and a shared prefix's two cached passes (train/updates/prefix.py: the
completions' T queries are the last T of the cache's S slots, the causal mask offset by S - T).
Left padding and packed rows are segment ids: a token attends to earlier tokens of its own
segment (padding is segment 0, whose outputs are unused), so one kernel covers both. Off a TPU
it runs in Pallas' interpret mode (the tests check it against the einsum form on the CPU); a
target compile (train/preflight/target_compile.py) builds the TPU kernel.

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


@functools.partial(jax.tree_util.register_dataclass, data_fields=["ids_BS"],
                   meta_fields=["window"])
@dataclasses.dataclass(frozen=True)
class Segments:
  """The mask of a splash pass: causal within equal segment ids [B, S] of the keys (and within
  `window` positions of each query, if set: a sliding-window layer's); the T queries are the
  last T keys' (T = S but in a shared prefix's completion pass)."""
  ids_BS: jax.Array
  window: int = 0


def _kernel(t: int, s: int, n: int, interpret: bool, window: int = 0, offset: int = 0):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  sizes = sk.BlockSizes(block_q=BLOCK, block_kv=BLOCK, block_kv_compute=BLOCK,
                        block_q_dkv=BLOCK, block_kv_dkv=BLOCK, block_kv_dkv_compute=BLOCK,
                        block_q_dq=BLOCK, block_kv_dq=BLOCK)
  head = (sm.LocalMask((t, s), (window - 1, 0), offset) if window
          else sm.CausalMask((t, s), offset))
  mask = sm.MultiHeadMask([head] * n)
  return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                            interpret=interpret), sk.SegmentIds


def _per_shard(q_BTNH, k_BSKH, v_BSKH, q_ids_BT, ids_BS, *, interpret: bool, window: int,
               offset: int):
  """The kernel on one shard's rows: heads first, as the kernel takes them."""
  (t, n), s = q_BTNH.shape[1:3], k_BSKH.shape[1]
  kernel, segment_ids = _kernel(t, s, n, interpret, window, offset)
  heads_first = lambda x: x.transpose(0, 2, 1, 3)
  out_BNTH = jax.vmap(lambda q, k, v, q_ids, ids: kernel(
      q, k, v, segment_ids=segment_ids(q_ids, ids)))(
          heads_first(q_BTNH), heads_first(k_BSKH), heads_first(v_BSKH), q_ids_BT, ids_BS)
  return heads_first(out_BNTH)


def _widened(x, pad: int, value=0):
  return jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), constant_values=value)


def splash(q_BTNH, k_BSKH, v_BSKH, mask: Segments) -> jax.Array:
  """Causal attention within segments, [B, T, N, H] (queries scaled already): the T queries
  are the last T of the S keys'."""
  t, s = q_BTNH.shape[1], k_BSKH.shape[1]
  ids_BS = mask.ids_BS.astype(jnp.int32)
  # Padded positions: segment -1, attended by no real token. A padded query sees the first
  # padded key (at least one is added for it).
  pad_t = -t % BLOCK
  pad_s = -s % BLOCK or (BLOCK if pad_t and s > t else 0)
  q_ids_BT = _widened(ids_BS[:, s - t:], pad_t, -1)
  q_BTNH, k_BSKH, v_BSKH = (_widened(q_BTNH, pad_t), _widened(k_BSKH, pad_s),
                            _widened(v_BSKH, pad_s))
  ids_BS = _widened(ids_BS, pad_s, -1)
  dt = q_BTNH.dtype
  fn = functools.partial(_per_shard, interpret=platform.backend() != "tpu", window=mask.window,
                         offset=s - t)
  args = (q_BTNH, k_BSKH.astype(dt), v_BSKH.astype(dt), q_ids_BT, ids_BS)
  active = active_spec(("batch", None, "act_heads", None))
  if active is not None:
    mesh, heads_spec = active
    kv_spec = active_spec(("batch", None, "act_kv_heads", None))[1]
    ids_spec = jax.sharding.PartitionSpec(heads_spec[0], None)
    fn = jax.shard_map(fn, mesh=mesh, in_specs=(heads_spec, kv_spec, kv_spec, ids_spec,
                                                ids_spec), out_specs=heads_spec, check_vma=False)
  return fn(*args)[:, :t]
