"""In-flight (continuous) batching of one batch: R row slots (sampler/slots.py) decode together,
and a slot whose row has finished (EOS, a stop sequence or its own budget) takes the next pending
row, so rows of uneven lengths do not keep finished rows computing until the longest one ends.
`sampler.sampler.Sampler` decodes through `jit_inflight` when given `inflight_slots`: it returns
the same `Rollout` as the static engine, so callers need not know which one ran.

Host loop: decode runs in segments of `CHECK_EVERY` steps (a `lax.while_loop` that also stops
once every slot is done). Between segments the host reads the R done flags and one jitted call
moves the finished rows into the output buffers and refills the free slots with a prefill of
just the new rows (their count bucketed to powers of two: a handful of programs). Once no row
is pending, the tail keeps only its live rows, in a batch of R / 4, R / 16, .. slots as soon as
they fit one (a few more decode programs), so the last long rows do not run at R rows' cost.

Greedy results equal the static engine's row by row. Rows are group-major (row i * n + s is
sample s of prompt i); each sample is its own row (its own prefill), with one queue of pending
rows.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.partitioning import Rules
from sampler.engine import DecodeModel, Rollout, bucket
from sampler.methods import SamplingConfig
from sampler.slots import (CHECK_EVERY, Outputs, Slots, caster, decode, empty_outputs,
                           empty_slots, harvest, jitter, put_rows, refill_buckets, ring_width,
                           row_state, row_uniforms)
from sharding.reshard import to_device, to_host
from sharding.rules import SAMPLER_RULES, batch_ways

def init(model: DecodeModel, tokens_BP, *, cfg: SamplingConfig, slots: int, n: int,
         forced: bool = False):
  """Every slot free, the output buffers empty, global step 0."""
  p = tokens_BP.shape[1]
  state = empty_slots(model, cfg=cfg, slots=slots, p=p, ring=ring_width(p, cfg.max_new_tokens),
                      forced=forced)
  return state, empty_outputs(tokens_BP.shape[0] * n, cfg, state.routes_RTLK), jnp.int32(0)


def refill(model: DecodeModel, state: Slots, out: Outputs, g, tokens_BP, valid_BP, key,
           max_new_B, rows_K, src_R, forced_BN=None, *, cfg: SamplingConfig, n: int):
  """Harvests the finished rows, then starts rows `rows_K` in the slots r with src_R[r] >= 0
  (row rows_K[src_R[r]]); entries of rows_K that no slot names are bucket padding.
  `forced_BN`: each output row's tokens to replay (-1: draw)."""
  out = harvest(state, out)
  budget_K = jnp.full(rows_K.shape, cfg.max_new_tokens, jnp.int32)
  if max_new_B is not None:
    budget_K = jnp.minimum(max_new_B[rows_K], cfg.max_new_tokens)
  p = tokens_BP.shape[1]
  new = row_state(model, cfg, tokens_BP[rows_K // n], valid_BP[rows_K // n], rows_K, budget_K,
                   row_uniforms(key, rows_K, cfg.max_new_tokens), g,
                   ring_width(p, cfg.max_new_tokens),
                   None if forced_BN is None else forced_BN[rows_K])
  return jax.tree.map(functools.partial(put_rows, src_R=src_R), state, new), out


def shrink(state: Slots, out: Outputs, keep_K) -> tuple[Slots, Outputs]:
  """Harvests the finished rows, then keeps only slots `keep_K` (the live ones, padded with
  finished ones): once no row is pending, the tail decodes in a smaller batch."""
  return jax.tree.map(lambda x: x[keep_K], state), harvest(state, out)


def finish(state: Slots, out: Outputs, tokens_BP, valid_BP, *, n: int) -> Rollout:
  out = harvest(state, out)
  prompt_tokens_BP, prompt_valid_BP = (jnp.repeat(x, n, axis=0) for x in (tokens_BP, valid_BP))
  return Rollout(tokens_BT=jnp.concatenate([prompt_tokens_BP, out.tokens_BN], axis=1),
                 valid_BT=jnp.concatenate([prompt_valid_BP, out.mask_BN], axis=1),
                 completion_mask_BN=out.mask_BN, logprobs_BN=out.logprobs_BN,
                 lengths_B=out.mask_BN.sum(axis=1), routes_BTLK=out.routes_BTLK)


def _plan(done_R: np.ndarray, queued: int, total: int, buckets: tuple[int, ...]):
  """(rows_K, src_R) that start rows queued, queued + 1, .. in the free slots: rows_K padded to a
  bucket size, src_R[r] the index into rows_K of the row slot r takes (-1: it keeps its row)."""
  free = np.flatnonzero(done_R)[:total - queued]
  rows_K = np.full(bucket(len(free), buckets), queued, np.int32)
  rows_K[:len(free)] = np.arange(queued, queued + len(free))
  src_R = np.full(done_R.shape, -1, np.int32)
  src_R[free] = np.arange(len(free))
  return rows_K, src_R


def _keep(done_R: np.ndarray, sizes: tuple[int, ...]) -> np.ndarray | None:
  """The slots a smaller batch keeps (the live ones, padded to one of `sizes` with finished
  ones), or None where no smaller size holds the live rows."""
  live_K = np.flatnonzero(~done_R)
  size = bucket(max(len(live_K), 1), sizes)
  if size >= len(done_R):
    return None
  return np.concatenate([live_K, np.flatnonzero(done_R)[:size - len(live_K)]]).astype(np.int32)


class RowPrograms(NamedTuple):
  """`jit_inflight`'s programs: the host loop calls them with refills of `buckets` rows and,
  once no row is pending, tails of `tails` slots."""
  cast: Callable
  start: Callable
  refill: Callable
  decode: Callable
  shrink: Callable
  finish: Callable
  buckets: tuple[int, ...]
  tails: tuple[int, ...]


def row_programs(graphdef: nnx.GraphDef, cfg: SamplingConfig, *, slots: int, n: int = 1,
                 mesh: Mesh | None = None, rules: Rules = SAMPLER_RULES,
                 forced: bool = False) -> RowPrograms:
  buckets, shards = refill_buckets(mesh, rules, slots), batch_ways(mesh, rules)
  # The tail: a quarter at a time (each batch size is another decode program to compile).
  tails = tuple(sorted(slots // 4**i for i in range(slots.bit_length())
                       if slots % 4**i == 0 and (slots // 4**i) % shards == 0))
  jit = jitter(mesh, rules)
  return RowPrograms(caster(graphdef), jit(init, cfg=cfg, slots=slots, n=n, forced=forced),
                     jit(refill, (1, 2), cfg=cfg, n=n), jit(decode, (1,), cfg=cfg),
                     jit(shrink, (1,)), jit(finish, n=n), buckets, tails)


def jit_inflight(graphdef: nnx.GraphDef, cfg: SamplingConfig, *, slots: int, n: int = 1,
                 mesh: Mesh | None = None, rules: Rules = SAMPLER_RULES, forced: bool = False):
  """`fn(params, tokens_BP, valid_BP, key, max_new_B=None, forced_BN=None) -> Rollout` as the
  static engine's, decoding in `slots` row slots that are refilled as their rows finish.

  `forced`: the programs also replay (`rl.rollout.exact="replay"`). Given `forced_BN` (the rows'
  completions) and as budgets their lengths, each row emits its own tokens again, so every
  refill, decode segment and tail batch runs as when they were drawn, in one compiled program
  each for both: the log-probs reported are the drawing run's bit for bit at the same weights."""
  p = row_programs(graphdef, cfg, slots=slots, n=n, mesh=mesh, rules=rules, forced=forced)

  def run(params, tokens_BP, valid_BP, key, max_new_B=None, forced_BN=None) -> Rollout:
    model = p.cast(params)  # weights in the compute dtype once per call
    state, out, g = p.start(model, tokens_BP)
    if forced and forced_BN is None:  # (drawing: no token forced)
      forced_BN = jnp.full(out.tokens_BN.shape, -1, jnp.int32)
    segment, total, queued = to_device(np.int32(CHECK_EVERY)), tokens_BP.shape[0] * n, 0
    while True:
      done_R = to_host(state.done_R)  # the host's look, every CHECK_EVERY steps
      if queued == total and done_R.all():
        break
      if queued < total and done_R.any():
        rows_K, src_R = _plan(done_R, queued, total, p.buckets)
        state, out = p.refill(model, state, out, g, tokens_BP, valid_BP, key, max_new_B,
                              to_device(rows_K), to_device(src_R), forced_BN)
        queued += int((src_R >= 0).sum())
      elif queued == total and (keep_K := _keep(done_R, p.tails)) is not None:
        state, out = p.shrink(state, out, to_device(keep_K))
      state, g = p.decode(model, state, g, segment)
    return p.finish(state, out, tokens_BP, valid_BP)
  return run
