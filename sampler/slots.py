"""In-flight slots: what every in-flight engine shares (the batch's rows, sampler/inflight.py;
the stream of batches, sampler/stream.py; the requests of conversations' turns,
sampler/requests.py). `Slots` is the decode state of R row slots, and the pure functions here
start rows in them (`row_state`, `admit_rows`), decode them in segments (`decode`), move their
finished rows to output buffers (`harvest`), build the engines' programs for a mesh (`jitter`,
`refill_buckets`, `caster`) and save them as checkpoint items (`numbered`).

Cache: per slot a ring of S = P + N - 1 KV slots and one scratch slot (index S). At global step
g every row's decode step writes its key and value to the scratch slot (so the step's causal
mask, slots <= S, admits the whole ring), and step g + 1 first copies them to ring slot g mod S.
A row started before step g has its left-padded prompt at ring slots g - P .. g - 1 (mod S), so
the ring slots its tokens go to are never its own live keys; `key_valid_RS` is reset at the
start and set as slots are written, so attention sees exactly the row's own past (in another
slot order than the static engine's). RoPE positions and step counters are per row.

Randomness: row r draws its uniforms from `fold_in(key, r)`, indexed by its own token index, so
a sample does not depend on the slot or the time it ran in. On a mesh the slot batch is split
over the data axes by automatic partitioning; other axes follow `rules`.
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.models.decoding import LMDecoding
from jaxrl.partitioning import Rules
from sampler.engine import DecodeModel, KVCache, emit_tokens, resolve_layout
from sampler.methods import SamplingConfig
from sampler.stops import StopState
from sharding.rules import batch_ways, data_axes, jit_on

CHECK_EVERY = 8  # decode steps between the host's looks at the done flags


def ring_width(prompt_width: int, max_new_tokens: int) -> int:
  """A slot's ring of KV slots (S): a prompt and what it generates but its last token, whose
  key and value no step reads. Every user of in-flight slots sizes its ring here."""
  return prompt_width + max_new_tokens - 1


@flax.struct.dataclass
class Slots:
  """Decode state per row slot; every leaf is batch-first, so a refill is one `where` per leaf."""
  row_R: jax.Array  # the output row decoded in the slot; -1: none yet
  prompt_len_R: jax.Array  # valid prompt tokens: the RoPE position of the first new token
  budget_R: jax.Array
  uniforms_RN: jax.Array  # one draw per token index of the row
  logits_RV: jax.Array  # next-token logits
  kv_cache: KVCache
  key_valid_RS: jax.Array  # S ring slots, then the scratch slot (always valid)
  tokens_RN: jax.Array
  mask_RN: jax.Array
  logprobs_RN: jax.Array
  stop: StopState  # what ends a row: its last ids, its stop-text state (sampler/stops.py)
  step_R: jax.Array  # tokens emitted so far
  done_R: jax.Array
  # A mixture of experts: the row's tokens' experts per layer, its P prompt slots then its N
  # tokens (-1: not routed), as the static engine's `Rollout.routes_BTLK`.
  routes_RTLK: jax.Array | None = None
  # A replay's tokens (sampler/inflight.py): token index i of the row is forced_RN[i] where >= 0
  forced_RN: jax.Array | None = None


@flax.struct.dataclass
class Outputs:
  tokens_BN: jax.Array
  mask_BN: jax.Array
  logprobs_BN: jax.Array
  routes_BTLK: jax.Array | None = None


def slot_axes(model: DecodeModel):
  """The slot axis of each KV-cache leaf: the one that grows with the number of slots."""
  one, two = (jax.eval_shape(lambda s=s: model.init_cache(1, s)) for s in (1, 2))
  return jax.tree.map(lambda a, b: [x != y for x, y in zip(a.shape, b.shape)].index(True), one, two)


def _ring_cache(model: DecodeModel, cache_KP: KVCache, ring: int, g) -> KVCache:
  """A prefill cache (P slots) in the ring layout for rows starting at global step `g`: the
  prompt at ring slots g - P .. g - 1 (mod S), and its last key and value in the scratch slot
  too, where the next step expects the key and value it commits to ring slot g - 1."""
  def place(grown, prompt, axis):
    p = prompt.shape[axis]
    return jnp.concatenate([jnp.roll(grown, (g - p) % ring, axis=axis),
                            jax.lax.slice_in_dim(prompt, p - 1, p, axis=axis)], axis=axis)
  return jax.tree.map(place, model.grow_cache(cache_KP, ring), cache_KP, slot_axes(model))


def row_uniforms(key, rows_K, n: int):
  """Row r's N uniform draws, one per token index: `fold_in(key, r)`, whatever slot or time it
  decodes in."""
  return jax.vmap(lambda row: jax.random.uniform(jax.random.fold_in(key, row), (n,)))(rows_K)


def keyed_uniforms(keys_K2, index_K, n: int):
  """Row k's N uniform draws from its own key data: `fold_in(keys_K2[k], index_K[k])`."""
  return jax.vmap(lambda kd, r: jax.random.uniform(
      jax.random.fold_in(jax.random.wrap_key_data(kd), r), (n,)))(keys_K2, index_K)


def row_state(model: DecodeModel, cfg: SamplingConfig, tokens_KP, valid_KP, rows_K, budget_K,
               uniforms_KN, g, ring: int, forced_KN=None) -> Slots:
  """Fresh state for K rows whose decoding starts at global step `g` in a ring of `ring` slots
  (at least the prompt width P): their prefill in the ring layout, their own random draws
  (`row_uniforms`) or tokens to replay (`forced_KN`), nothing generated yet."""
  (k, p), n = tokens_KP.shape, cfg.max_new_tokens
  logits_KV, cache_KP, routes_KPLK = model.prefill(tokens_KP, valid_KP)
  routes_KTLK = None if routes_KPLK is None else jnp.concatenate(
      [routes_KPLK, jnp.full((k, n) + routes_KPLK.shape[2:], -1, routes_KPLK.dtype)], axis=1)
  key_valid_KS = jnp.roll(jnp.pad(valid_KP, ((0, 0), (0, ring - p))), (g - p) % ring, axis=1)
  return new_rows(cfg, rows_K, budget_K, uniforms_KN, logits_KV,
                  _ring_cache(model, cache_KP, ring, g), key_valid_KS,
                  valid_KP.sum(axis=1, dtype=jnp.int32), routes_KTLK, forced_KN)


def new_rows(cfg: SamplingConfig, rows_K, budget_K, uniforms_KN, logits_KV, kv_cache,
             key_valid_KS, length_K, routes_KTLK=None, forced_KN=None) -> Slots:
  """The state of K rows about to decode: their next-token logits, their cache in the ring
  layout (`key_valid_KS` over the ring; the scratch slot is added) holding `length_K` tokens
  (the RoPE position of the first new one), nothing generated yet (`forced_KN`: a replay's
  tokens, -1: draw)."""
  k, n = rows_K.shape[0], cfg.max_new_tokens
  return Slots(row_R=rows_K, prompt_len_R=length_K, budget_R=budget_K, uniforms_RN=uniforms_KN,
               logits_RV=logits_KV, kv_cache=kv_cache,
               key_valid_RS=jnp.pad(key_valid_KS, ((0, 0), (0, 1)), constant_values=True),
               tokens_RN=jnp.full((k, n), cfg.pad_id, jnp.int32),
               mask_RN=jnp.zeros((k, n), bool), logprobs_RN=jnp.zeros((k, n)),
               stop=StopState.start(k, cfg),
               step_R=jnp.zeros((k,), jnp.int32), done_R=budget_K <= 0, routes_RTLK=routes_KTLK,
               forced_RN=forced_KN)


def put_rows(old, new_K, src_R):
  """`old` with row r replaced by new_K[src_R[r]] where src_R[r] >= 0 (a select, which keeps
  the slot batch split over the data axes)."""
  picked = jnp.take(new_K, jnp.maximum(src_R, 0), axis=0)
  return jnp.where((src_R >= 0).reshape((-1,) + (1,) * (old.ndim - 1)), picked, old)


def harvest(slots: Slots, out: Outputs) -> Outputs:
  """Finished rows copied to their output rows (again and again until refilled: idempotent)."""
  rows_R = jnp.where(slots.done_R & (slots.row_R >= 0), slots.row_R, out.tokens_BN.shape[0])
  put = lambda buf, val: buf.at[rows_R].set(val, mode="drop")
  routes = None if out.routes_BTLK is None else put(out.routes_BTLK, slots.routes_RTLK)
  return Outputs(put(out.tokens_BN, slots.tokens_RN), put(out.mask_BN, slots.mask_RN),
                 put(out.logprobs_BN, slots.logprobs_RN), routes)


def empty_slots(model: DecodeModel, *, cfg: SamplingConfig, slots: int, p: int,
                ring: int, forced: bool = False) -> Slots:
  """`slots` free slots (done, no row) for prompts up to `p` tokens in a ring of `ring`
  (`forced`: with room for a replay's tokens)."""
  zeros_R, n = jnp.zeros((slots,), jnp.int32), cfg.max_new_tokens
  shapes = jax.eval_shape(lambda: row_state(
      model, cfg, jnp.zeros((slots, p), jnp.int32), jnp.ones((slots, p), bool), zeros_R, zeros_R,
      jnp.zeros((slots, n)), 0, ring, jnp.zeros((slots, n), jnp.int32) if forced else None))
  state = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
  return state.replace(row_R=zeros_R - 1, done_R=jnp.ones((slots,), bool))


def empty_outputs(rows: int, cfg: SamplingConfig, routes=None) -> Outputs:
  """Empty output buffers; `routes`: the slots' routes, whose shape (but rows) they take."""
  n = cfg.max_new_tokens
  routes = None if routes is None else jnp.full((rows,) + routes.shape[1:], -1, routes.dtype)
  return Outputs(jnp.full((rows, n), cfg.pad_id, jnp.int32), jnp.zeros((rows, n), bool),
                 jnp.zeros((rows, n)), routes)


def _emit(s: Slots, cfg: SamplingConfig) -> tuple[Slots, jax.Array]:
  """Samples each live row's next token (its token index `step_R`) and records it; done rows
  emit PAD and record nothing."""
  n = s.tokens_RN.shape[1]

  def at(x_RN):  # each row's entry at its token index
    return jnp.take_along_axis(x_RN, jnp.minimum(s.step_R, n - 1)[:, None], 1)[:, 0]
  forced_R = None if s.forced_RN is None else at(s.forced_RN)
  tok_R, logp_R, stop, finished_R = emit_tokens(s.logits_RV, at(s.uniforms_RN), s.done_R,
                                                s.stop, cfg, forced_R)
  live_R = ~s.done_R
  at_RN = live_R[:, None] & (jnp.arange(n) == s.step_R[:, None])
  step_R = s.step_R + live_R
  return s.replace(tokens_RN=jnp.where(at_RN, tok_R[:, None], s.tokens_RN),
                   mask_RN=s.mask_RN | at_RN,
                   logprobs_RN=jnp.where(at_RN, logp_R[:, None], s.logprobs_RN),
                   stop=stop, step_R=step_R,
                   done_R=s.done_R | (live_R & (finished_R | (step_R >= s.budget_R)))), tok_R


def _commit(s: Slots, g, axes) -> Slots:
  """The scratch slot's key and value (the previous step's token) copied to ring slot g - 1,
  for the live rows only: a row is live at step g when the token it emitted at g - 1 was not
  its last, so a finished row's ring keeps its context and every token but its last (a kept
  multi-turn cache, `extend_rows`) instead of filling with the padding it decodes. Done before
  the step rather than after it: reading the scratch slot right after the step's own write made
  XLA copy the whole cache every step."""
  ring = s.key_valid_RS.shape[1] - 1
  j = (g - 1) % ring
  live_R = ~s.done_R

  def move(x, axis):  # rows are every cache leaf's axis 0
    old = jax.lax.dynamic_slice_in_dim(x, j, 1, axis=axis)
    new = jax.lax.slice_in_dim(x, ring, ring + 1, axis=axis)
    pick = jnp.where(live_R.reshape((-1,) + (1,) * (x.ndim - 1)), new, old)
    return jax.lax.dynamic_update_slice_in_dim(x, pick, j, axis=axis)
  return s.replace(kv_cache=jax.tree.map(move, s.kv_cache, axes),
                   key_valid_RS=s.key_valid_RS.at[:, j].set(s.key_valid_RS[:, j] | live_R))


def decode(model: DecodeModel, state: Slots, g, limit, *, cfg: SamplingConfig):
  """Up to `limit` decode steps (fewer once every slot is done); returns the state and the new
  global step."""
  ring = state.key_valid_RS.shape[1] - 1
  forward, axes = model.decode_fn(resolve_layout(cfg)), slot_axes(model)

  def body(carry):
    s, g, i = carry
    live_R = ~s.done_R
    s, tok_R = _emit(_commit(s, g, axes), cfg)
    sin_R1H, cos_R1H = model.rope((s.prompt_len_R + s.step_R - 1)[:, None])
    logits_RV, cache, routes_RLK = forward(tok_R, (sin_R1H[:, 0], cos_R1H[:, 0]),
                                           s.key_valid_RS, s.kv_cache, ring)  # the scratch slot
    if s.routes_RTLK is not None:  # the experts of the token each live row just emitted
      t = s.routes_RTLK.shape[1]
      p = t - s.tokens_RN.shape[1]
      at_RT = live_R[:, None] & (jnp.arange(t) == (p + s.step_R - 1)[:, None])
      s = s.replace(routes_RTLK=jnp.where(at_RT[:, :, None, None], routes_RLK[:, None],
                                          s.routes_RTLK))
    return s.replace(logits_RV=logits_RV, kv_cache=cache), g + 1, i + 1

  state, g, _ = jax.lax.while_loop(lambda c: (c[2] < limit) & ~jnp.all(c[0].done_R), body,
                                   (state, g, jnp.int32(0)))
  return state, g


def jitter(mesh: Mesh | None, rules: Rules):
  """`jit(fn, donate, **static)`: `fn` jitted under the activation rules, the slot state it
  returns split over the mesh's data axes (its other axes left to the compiler)."""
  data = data_axes(mesh, rules)

  def split(x):
    if not data or not isinstance(x, Slots):
      return x
    spec = lambda a: PartitionSpec(data, *[PartitionSpec.UNCONSTRAINED] * (a.ndim - 1))
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(
        a, NamedSharding(mesh, spec(a))), x)

  def jit(fn, donate=(), **static):
    @functools.wraps(fn)
    def split_slots(*args):
      return jax.tree.map(split, fn(*args, **static), is_leaf=lambda x: isinstance(x, Slots))
    return jit_on(mesh, rules, split_slots, donate_argnums=donate)
  return jit


def refill_buckets(mesh: Mesh | None, rules: Rules, slots: int) -> tuple[int, ...]:
  """The sizes a refill's new rows are padded to: powers of two times the mesh's data shards (a
  prefill's padding is waste), then `slots`; a ValueError unless `slots` is a positive multiple
  of the data shards (each shard decodes its own slots)."""
  shards = batch_ways(mesh, rules)
  if slots < 1 or slots % shards:
    raise ValueError(f"expected a positive multiple of the mesh's {shards} data shards, "
                     f"got {slots}")
  return tuple(shards * 2**i for i in range(slots.bit_length()) if shards * 2**i < slots) + (
      slots,)


def caster(graphdef: nnx.GraphDef):
  """jit: parameters -> the model as the sampler decodes it (weights in the compute dtype), done
  once per call or weight swap rather than once per step."""
  return jax.jit(lambda params: LMDecoding.of(nnx.merge(graphdef, params)))


def admit_rows(model, state: Slots, g, tokens_KP, valid_KP, rows_K, budget_K, keys_K2, index_K,
           src_R, forced_KN=None, *, cfg, ring: int) -> Slots:
  """Starts rows `rows_K` (output rows; `index_K` their row in their batch, `keys_K2` their
  batch's key data, `budget_K` their most tokens; `forced_KN`: tokens to replay, -1: draw) in
  the slots r with src_R[r] >= 0."""
  new = row_state(model, cfg, tokens_KP, valid_KP, rows_K, budget_K,
                  keyed_uniforms(keys_K2, index_K, cfg.max_new_tokens), g, ring, forced_KN)
  if state.routes_RTLK is None:  # (slots that record no experts: sampler/requests.py)
    new = new.replace(routes_RTLK=None)
  return jax.tree.map(functools.partial(put_rows, src_R=src_R), state, new)


def numbered(tree) -> dict:
  """A pytree as {"0000": leaf, ...} (an orbax item: plain dicts with string keys)."""
  return {f"{i:04d}": leaf for i, leaf in enumerate(jax.tree.leaves(tree))}


def unnumbered(like, numbered: dict):
  return jax.tree.unflatten(jax.tree.structure(like), [numbered[k] for k in sorted(numbered)])
