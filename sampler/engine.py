"""Jitted generation: one prefill call over the prompt batch, then decode in `lax.while_loop`.

Layout: prompts are left-padded to P tokens, so every row's first new token goes to cache slot P
and a decode step writes the same slot for all rows. RoPE positions count valid tokens only, so a
row's result does not depend on how much padding it got. With `n > 1` samples per prompt the
prompt is prefilled once and its KV cache repeated (group-major rows: prompt i -> rows i*n..).
"""
from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl import platform
from jaxrl.models.decoding import LMDecoding
from sampler.methods import SAMPLERS, SamplingConfig
from sampler.stops import StopState

KVCache = Any  # the model's own cache pytree (batch first in every leaf)


@flax.struct.dataclass
class Rollout:
  tokens_BT: jax.Array  # prompt (P, left-padded) followed by N completion slots
  valid_BT: jax.Array  # prompt validity, then completion_mask
  completion_mask_BN: jax.Array  # generated tokens up to and including EOS / a stop sequence
  logprobs_BN: jax.Array  # log mu(token) under the sampling distribution; 0 where masked
  lengths_B: jax.Array
  # Multi-turn rollouts (train/rollout/multiturn.py), where completion_mask_BN also covers what the
  # environment appended: the tokens the policy emitted (the ones it is trained on) and the
  # environment's rewards. None for a single completion.
  loss_mask_BN: jax.Array | None = None
  rewards_B: jax.Array | None = None
  # A mixture of experts: the experts each token went through in each layer, [B, T, L, k] (-1:
  # not routed, e.g. the last token, which needs no forward pass), for routing replay.
  routes_BTLK: jax.Array | None = None


@flax.struct.dataclass
class DecodeState:
  step: jax.Array
  logits_BV: jax.Array  # next-token logits
  kv_cache: KVCache
  tokens_BN: jax.Array
  mask_BN: jax.Array
  logprobs_BN: jax.Array
  stop: StopState  # what ends a row: its last ids, its stop-text state (sampler/stops.py)
  done_B: jax.Array
  routes_BNLK: jax.Array | None = None  # the generated tokens' experts (a mixture of experts)


def emit_tokens(logits_BV, u_B, done_B, stop: StopState, cfg: SamplingConfig, forced_B=None):
  """The token-emit step of both engines (this one and sampler/inflight.py): each row's next
  token drawn with its uniform (PAD for rows already done), its stop state moved on
  (sampler/stops.py), and whether the token ends the row (a stop sequence or string or, unless
  ignored, EOS); `forced_B`: tokens emitted instead where >= 0 (a replay's). Returns (tok_B,
  logp_B, stop, finished_B)."""
  tok_B, logp_B = SAMPLERS[cfg.method](logits_BV, u_B, cfg, forced_B)
  tok_B = jnp.where(done_B, cfg.pad_id, tok_B)
  stop, finished_B = stop.after(tok_B, cfg)
  if not cfg.ignore_eos:
    finished_B |= tok_B == cfg.eos_id
  return tok_B, logp_B, stop, finished_B


def bucket(size: int, buckets: Sequence[int]) -> int:
  """The smallest of `buckets` (sorted) that holds `size`: shapes padded to a few sizes reuse a
  few compiled programs."""
  at = bisect.bisect_left(buckets, size)
  if at == len(buckets):
    raise ValueError(f"size {size} is larger than the largest bucket {buckets[-1]}")
  return buckets[at]


MIN_SEGMENT = 8  # decode steps


def segment_ends(forwards: int, segments: int) -> list[int]:
  """Where the decode loop's segments end (exclusive), over `forwards` decode forward passes."""
  if forwards == 0:
    return []
  count = min(segments, max(1, forwards // MIN_SEGMENT))
  chunk = -(-forwards // count)
  return list(range(chunk, forwards, chunk)) + [forwards]


class DecodeModel(Protocol):
  """What the engine needs of a model (`jaxrl.models.decoding.LMDecoding` is one): a KV cache, RoPE
  tables, a prefill and a one-token step, nothing of the model's internals. It is a pytree, so
  the in-flight generator (sampler/inflight.py) builds it (casts the weights) once per call and
  passes it to each of its jitted pieces."""

  def init_cache(self, batch: int, slots: int) -> KVCache: ...

  def grow_cache(self, kv_cache: KVCache, slots: int) -> KVCache: ...

  @property
  def stacked_cache(self) -> bool:
    """Whether the cache holds every layer in one array per leaf (growing it copies it all)."""

  def rope(self, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]: ...

  def prefill(self, tokens_BP: jax.Array, valid_BP: jax.Array) -> tuple[jax.Array, KVCache,
                                                                        jax.Array | None]: ...

  def decode_fn(self, layout: str) -> Callable: ...


def resolve_layout(cfg: SamplingConfig) -> str:
  """The decode step's activation layout: `cfg.decode_layout`, with "auto" picking "features" on
  a CPU and "rows" elsewhere."""
  if cfg.decode_layout != "auto":
    return cfg.decode_layout
  return "features" if platform.backend() == "cpu" else "rows"


def decode_forward(model: DecodeModel, layout: str, key_valid_BS, next_pos_B, steps: int,
                   p: int):
  """`forward(tok_B, i, kv_cache, slots) -> (logits_BV, kv_cache, routes_BLK or None)`: the
  decode step for the token sampled at step i (cache slot p + i), in the `layout` the step runs
  in."""
  sin_NBH, cos_NBH = model.rope(next_pos_B[None, :] + jnp.arange(steps)[:, None])
  step = model.decode_fn(layout)

  def forward(tok_B, i, kv_cache, slots):
    return step(tok_B, (sin_NBH[i], cos_NBH[i]), key_valid_BS[:, :slots], kv_cache, p + i)
  return forward


def _emitter(cfg: SamplingConfig, uniforms_NB, max_new_B):
  """`emit(state) -> (state, tok_B)`: samples token `state.step` from `state.logits_BV` and
  records it (PAD, masked out, for rows that are done)."""

  def emit(s: DecodeState) -> tuple[DecodeState, jax.Array]:
    done_B = s.done_B | (s.step >= max_new_B)
    tok_B, logp_B, stop, finished_B = emit_tokens(s.logits_BV, uniforms_NB[s.step], done_B,
                                                  s.stop, cfg)
    write = lambda buf, col: jax.lax.dynamic_update_slice_in_dim(buf, col[:, None], s.step, axis=1)
    return s.replace(step=s.step + 1, tokens_BN=write(s.tokens_BN, tok_B),
                     mask_BN=write(s.mask_BN, ~done_B),
                     logprobs_BN=write(s.logprobs_BN, jnp.where(done_B, 0.0, logp_B)),
                     stop=stop, done_B=done_B | finished_B), tok_B
  return emit


def generate(graphdef: nnx.GraphDef, params: nnx.State, prompt_tokens_BP: jax.Array,
             prompt_valid_BP: jax.Array, key: jax.Array, max_new_B: jax.Array | None = None, *,
             cfg: SamplingConfig, n: int = 1, all_done=jnp.all) -> Rollout:
  """Samples `n` completions per prompt; `max_new_B` (per output row) caps each row's length.
  The loop stops early once `all_done(done_B)`: under shard_map a caller whose shards must stay
  in step (they share collectives) passes a reduction over its data axes.

  Token i is sampled from the logits of forward pass i - 1 (the prefill for i = 0), so N tokens
  take N - 1 decode forwards; they run in `cfg.decode_segments` while loops whose attention
  covers only the cache slots filled by the segment's end."""
  # Weights in the compute dtype once per call, not per forward (bf16 keeps float32 params)
  model: DecodeModel = LMDecoding.of(nnx.merge(graphdef, params))
  p, steps = prompt_tokens_BP.shape[1], cfg.max_new_tokens
  logits_BV, kv_cache, routes_BPLK = model.prefill(prompt_tokens_BP, prompt_valid_BP)
  key_valid_BS = jnp.concatenate(
      [prompt_valid_BP, jnp.ones((prompt_tokens_BP.shape[0], steps), bool)], axis=1)
  if n > 1:  # share the prefix: prefill once, then give each sample its own copy of the cache
    repeat = lambda x: jnp.repeat(x, n, axis=0)
    kv_cache = jax.tree.map(repeat, kv_cache)
    prompt_tokens_BP, prompt_valid_BP, key_valid_BS, logits_BV = map(
        repeat, (prompt_tokens_BP, prompt_valid_BP, key_valid_BS, logits_BV))
    routes_BPLK = None if routes_BPLK is None else repeat(routes_BPLK)
  b = prompt_tokens_BP.shape[0]
  max_new_B = jnp.full((b,), steps, jnp.int32) if max_new_B is None else max_new_B
  forward = decode_forward(model, resolve_layout(cfg), key_valid_BS,
                           prompt_valid_BP.sum(axis=1).astype(jnp.int32), steps, p)
  # All of the call's randomness, drawn once.
  emit = _emitter(cfg, jax.random.uniform(key, (steps, b)), max_new_B)

  def body(s: DecodeState, slots: int) -> DecodeState:
    s, tok_B = emit(s)
    logits_BV, kv_cache, routes_BLK = forward(tok_B, s.step - 1, s.kv_cache, slots)
    if routes_BLK is not None:  # the experts of the token just emitted
      routes_BNLK = jax.lax.dynamic_update_slice_in_dim(s.routes_BNLK, routes_BLK[:, None],
                                                        s.step - 1, axis=1)
      s = s.replace(routes_BNLK=routes_BNLK)
    return s.replace(logits_BV=logits_BV, kv_cache=kv_cache)

  state = DecodeState(step=jnp.int32(0), logits_BV=logits_BV, kv_cache=kv_cache,
                      tokens_BN=jnp.full((b, steps), cfg.pad_id, jnp.int32),
                      mask_BN=jnp.zeros((b, steps), bool), logprobs_BN=jnp.zeros((b, steps)),
                      stop=StopState.start(b, cfg), done_B=jnp.zeros((b,), bool),
                      routes_BNLK=None if routes_BPLK is None else jnp.full(
                          (b, steps) + routes_BPLK.shape[2:], -1, routes_BPLK.dtype))
  ends = segment_ends(steps - 1, cfg.decode_segments)
  for end in ends:  # (a stacked cache grows once: growing it copies every layer's)
    grown = model.grow_cache(state.kv_cache, p + (ends[-1] if model.stacked_cache else end))
    state = jax.lax.while_loop(lambda s, end=end: (s.step < end) & ~all_done(s.done_B),
                               functools.partial(body, slots=p + end),
                               state.replace(kv_cache=grown))
  state, _ = emit(state)  # the last token needs no forward pass (a no-op if every row is done)
  # The mask comes from the done flags, not from comparing with PAD, so a sampled PAD token
  # mid-answer stays a real (masked-in) token for the trainer as it was for the sampler.
  return Rollout(tokens_BT=jnp.concatenate([prompt_tokens_BP, state.tokens_BN], axis=1),
                 valid_BT=jnp.concatenate([prompt_valid_BP, state.mask_BN], axis=1),
                 completion_mask_BN=state.mask_BN, logprobs_BN=state.logprobs_BN,
                 lengths_B=state.mask_BN.sum(axis=1),
                 routes_BTLK=None if routes_BPLK is None else jnp.concatenate(
                     [routes_BPLK, state.routes_BNLK], axis=1))
