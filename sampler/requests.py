"""In-flight slots serving requests whose results come back to the host: in-flight batching
across the turns of multi-turn rollouts (train/rollout/multiturn.py), made by `Sampler.requests`.

A request is the token ids of a context (a prompt, or a conversation so far), a budget of new
tokens, and its random key and row: it waits for a free slot, is prefilled there (its context
left-padded to one of a few widths), decodes until EOS, a stop sequence or its budget, and
returns to the host as (tag, token ids, log-probs). The host may submit a follow-up at once (the
conversation's next turn after the environment's reply), which continues in the slot that kept
the conversation's KV cache (only the reply is prefilled, at the cache's end) while the other
rows keep decoding: a row whose turn ended never waits for the others' turns to end, and a
conversation of k turns prefills its context once, not k times.

Rows draw as the in-flight engine's do: request row r with key k takes its uniforms from
`fold_in(k, r)`, indexed by its token index, so a turn's tokens do not depend on which slot or
step it ran in. Slots hold at most `context_width + max_new_tokens - 1` tokens (a context plus
what it generates must fit: a conversation never exceeds its prompt and its token budget).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sampler import slots
from sampler.engine import bucket
from sampler.slots import CHECK_EVERY, Slots, admit_rows, numbered, unnumbered
from sampler.spec import DecodeSpec
from sharding.reshard import to_device, to_host

WIDTH_STEP = 16  # contexts are left-padded to WIDTH_STEP * 2^k tokens (a prefill program each)


class RequestPrograms(NamedTuple):
  """`Requests`' programs: the host loop prefills buckets of up to the slots' count, of widths
  up to the ring's."""
  cast: Callable
  empty: Callable
  admit: Callable
  extend: Callable
  decode: Callable


def request_programs(spec: DecodeSpec, ring: int) -> RequestPrograms:
  """The jitted pieces for `spec` with slots of `ring` tokens, built once (in the spec's cache:
  a `Requests` is made per batch of conversations)."""
  def build():
    cfg, jit = spec.cfg, slots.jitter(spec.mesh, spec.rules)
    return RequestPrograms(
        slots.caster(spec.graphdef),
        jit(_unrouted_slots, cfg=cfg, slots=spec.inflight_slots, p=ring, ring=ring,
            forced=spec.forced),
        jit(admit_rows, (1,), cfg=cfg, ring=ring), jit(extend_rows, (1,), cfg=cfg, ring=ring),
        jit(slots.decode, (1,), cfg=cfg))
  return spec.cached(build, "requests", ring)


def _unrouted_slots(model, **kw) -> Slots:
  """Empty slots that record no experts: a request returns none (multi-turn rollouts replay no
  routes: jaxrl/config_checks.py), so a mixture of experts' prefills of any width and its
  kept caches fit the slots as a dense model's do."""
  return slots.empty_slots(model, **kw).replace(routes_RTLK=None)


def kept_ring(model, cache_KX, valid_KS, chunk_valid_KW, g, ring: int):
  """Each continued slot's ring rebuilt for decoding from global step `g`: its kept keys
  (`valid_KS` over the ring, in any slot order) then the chunk's (the last W slots of `cache_KX`,
  left-padded) as the newest slots, ending at ring slot g - 1, the chunk's last key in the
  scratch slot too; so the turn's own tokens go to slots no kept key is in. (cache, the ring's
  validity [K, ring])."""
  w = chunk_valid_KW.shape[1]
  t_K, l_K = (x.sum(axis=1, dtype=jnp.int32)[:, None] for x in (chunk_valid_KW, valid_KS))
  order_KS = jnp.argsort(~valid_KS, axis=1, stable=True)  # the kept slots first, in slot order
  age_KS = ((g - 1 - jnp.arange(ring)) % ring)[None]  # 0: the newest slot
  kept_KS = jnp.take_along_axis(order_KS, jnp.clip(l_K - 1 - (age_KS - t_K), 0, ring - 1), 1)
  src_KS = jnp.where(age_KS < t_K, ring + w - 1 - age_KS, kept_KS)
  src_KS = jnp.concatenate([src_KS, jnp.full_like(src_KS[:, :1], ring + w - 1)], axis=1)

  def take(x, axis):
    shape = [1] * x.ndim
    shape[0], shape[axis] = src_KS.shape
    return jnp.take_along_axis(x, src_KS.reshape(shape), axis=axis)
  return jax.tree.map(take, cache_KX, slots.slot_axes(model)), age_KS < t_K + l_K


def extend_rows(model, state: Slots, g, tokens_KW, valid_KW, slot_K, budget_K, keys_K2, index_K,
                src_R, forced_KN=None, *, cfg, ring: int) -> Slots:
  """Continues the conversations kept in slots `slot_K`: chunk k (left-padded: the turn's last
  token, whose key a finished row never commits, then the environment's reply) is prefilled
  after the slot's kept keys, and the row decodes its next turn (budget, uniforms `fold_in(key,
  index)`, or `forced_KN`'s tokens where >= 0) in the slots r with src_R[r] >= 0 (chunk
  src_R[r])."""
  axes = slots.slot_axes(model)
  valid_KS = jnp.take(state.key_valid_RS, slot_K, axis=0)[:, :ring]
  cache_KS = jax.tree.map(lambda x, axis: jax.lax.slice_in_dim(
      jnp.take(x, slot_K, axis=0), 0, ring, axis=axis), state.kv_cache, axes)
  length_K = valid_KS.sum(axis=1, dtype=jnp.int32)
  logits_KV, cache_KX = model.extend(tokens_KW, valid_KW, length_K, cache_KS, valid_KS)
  cache, key_valid_KS = kept_ring(model, cache_KX, valid_KS, valid_KW, g, ring)
  new = slots.new_rows(cfg, jnp.zeros_like(slot_K), budget_K,
                       slots.keyed_uniforms(keys_K2, index_K, cfg.max_new_tokens),
                       logits_KV, cache, key_valid_KS,
                       length_K + valid_KW.sum(axis=1, dtype=jnp.int32), forced_KN=forced_KN)
  return jax.tree.map(functools.partial(slots.put_rows, src_R=src_R), state, new)


@dataclasses.dataclass(frozen=True)
class Request:
  tag: Any  # the caller's name for it
  ids: tuple[int, ...]  # the context
  budget: int  # most new tokens
  key: np.ndarray  # uint32 key data
  row: int  # its uniforms: fold_in(key, row)
  forced: tuple[int, ...] = ()  # tokens to emit instead of drawing (a replay; forced engines)

  def meta(self) -> list:
    return [self.tag, list(self.ids), self.budget, np.asarray(self.key).tolist(), self.row,
            list(self.forced)]

  @classmethod
  def of(cls, meta: list) -> Request:
    """The request `meta` describes (a JSON list tag comes back as a tuple)."""
    tag, ids, budget, key, row, *forced = meta
    return cls(tuple(tag) if isinstance(tag, list) else tag, tuple(ids), budget,
               np.asarray(key, np.uint32), row, tuple(forced[0]) if forced else ())


class Finished(NamedTuple):
  tag: Any
  ids: list[int]  # the tokens it drew
  logprobs: list[float]  # each one's log-prob under the weights that drew it
  versions: list[int]  # each one's policy version (`install`, `swap`)


class Requests:
  """`spec.inflight_slots` slots serving requests (`submit`); `poll` returns the finished
  ones, `advance` admits the waiting ones into free slots and decodes one segment.

  With `keep`, a finished request's slot keeps its cache for its tag:
  the tag's next request, whose context starts with the kept one (the conversation so far, then
  the turn and the environment's reply), prefills only its new tokens there (`extend_rows`).
  A kept slot is freed by `release` (the conversation ended), by a request of its tag that does
  not continue it, or, oldest first, when a waiting request finds no free slot: then that
  conversation's next turn prefills its whole context again.

  Weights may change between segments (`swap`): the requests in flight continue with them
  (their caches computed by the older ones), and every token records the version it was drawn
  from, as `sampler.stream.Stream` does. `snapshot` / `restore` save and put back everything in
  flight, the caches included, so a restored engine continues bit for bit."""

  def __init__(self, spec: DecodeSpec, params, *, context_width: int, keep: bool = True,
               version: int = 0):
    cfg, count = spec.cfg, spec.inflight_slots
    self._buckets = slots.refill_buckets(spec.mesh, spec.rules, count)
    self.cfg, self.ring = cfg, slots.ring_width(context_width, cfg.max_new_tokens)
    self.forced = spec.forced  # (its requests may carry tokens to replay)
    self._widths = tuple(WIDTH_STEP << k for k in range(self.ring.bit_length())
                         if WIDTH_STEP << k < self.ring) + (self.ring,)
    (self._cast, empty, self._admit, self._extend,
     self._decode) = request_programs(spec, self.ring)
    self.install(params, version)
    self.state = empty(self._model)
    self.keep = keep
    self.g, self._segment = to_device(np.int32(0)), to_device(np.int32(CHECK_EVERY))
    self._pending: collections.deque[Request] = collections.deque()
    self._continuing: list[tuple[Request, int, int]] = []  # (request, its kept slot, cached)
    # tag -> (slot, the ids its cache holds), oldest first
    self._kept: collections.OrderedDict[Any, tuple[int, tuple[int, ...]]] = (
        collections.OrderedDict())
    self._serving: list[Request | None] = [None] * count
    # per slot, (first token index, version) each time its request's weights changed
    self._switches: list[list[tuple[int, int]]] = [[] for _ in range(count)]
    self._done_R, self._step_R = np.ones(count, bool), np.zeros(count, np.int32)
    # prefill_tokens: the prefills' padded [K, W] sizes; new_tokens: the ids they computed;
    # admitted / continued: requests prefilled whole / after a kept cache; evicted: kept caches
    # dropped for a waiting request
    self.stats = collections.Counter()

  def install(self, params, version: int) -> None:
    """The weights to decode with, nothing recorded (no request is in flight)."""
    self._model, self.version = self._cast(params), version

  def swap(self, params, version: int) -> None:
    """New weights from the next segment on; every request in flight records where they
    began (the step counts of the last `poll`)."""
    for s, r in enumerate(self._serving):
      if r is not None and not self._done_R[s]:
        self._switches[s].append((int(self._step_R[s]) + 1, version))
    self.install(params, version)

  def submit(self, request: Request) -> None:
    if request.forced and not self.forced:
      raise ValueError("a request with tokens to replay needs a forced engine "
                       "(Sampler(forced=True))")
    if len(request.ids) > self.ring or len(request.ids) + request.budget > self.ring + 1:
      raise ValueError(f"a context of {len(request.ids)} tokens and {request.budget} new ones "
                       f"do not fit a slot of {self.ring + 1}")
    slot, cached = self._kept.pop(request.tag, (None, ()))
    if slot is not None and len(request.ids) > len(cached) and (
        request.ids[:len(cached)] == cached):
      self._continuing.append((request, slot, len(cached)))
    else:
      self._pending.append(request)

  def release(self, tag) -> None:
    """Frees the slot kept for `tag` (its conversation has ended)."""
    self._kept.pop(tag, None)

  @property
  def busy(self) -> bool:
    return bool(self._pending or self._continuing) or any(r is not None for r in self._serving)

  @property
  def slots(self) -> int:
    return len(self._serving)

  @property
  def waiting(self) -> int:
    """Requests waiting for a free slot (not those continuing a kept cache)."""
    return len(self._pending)

  @property
  def free(self) -> int:
    """Slots neither serving, nor kept, nor held for a continued request."""
    held = {s for s, _ in self._kept.values()} | {s for _, s, _ in self._continuing}
    return sum(r is None and s not in held for s, r in enumerate(self._serving))

  def poll(self) -> list[Finished]:
    """The requests that finished since the last look."""
    self._done_R, self._step_R = (np.array(x) for x in to_host((self.state.done_R,
                                                             self.state.step_R)))
    finished = [s for s, r in enumerate(self._serving) if r is not None and self._done_R[s]]
    if not finished:
      return []
    tokens, mask, logp = to_host((self.state.tokens_RN, self.state.mask_RN, self.state.logprobs_RN))
    out = []
    for s in finished:
      request, ids = self._serving[s], tokens[s][mask[s]].tolist()
      versions = [0] * len(ids)
      for first, version in self._switches[s]:
        versions[first:] = [version] * len(versions[first:])
      out.append(Finished(request.tag, ids, logp[s][mask[s]].tolist(), versions))
      self._serving[s] = None
      if self.keep and ids:  # every id but the last is in the cache (`slots._commit`)
        self._kept[request.tag] = (s, request.ids + tuple(ids[:-1]))
    return out

  def advance(self) -> None:
    self.admit()
    self.decode()

  def admit(self) -> None:
    """Continues the kept conversations and admits waiting requests into the free slots
    (evicting the oldest kept caches if there are too few)."""
    if self._continuing:
      items, self._continuing = self._continuing, []
      self._prefill(self._extend, items)
    held = {slot for slot, _ in self._kept.values()}
    free = [s for s, r in enumerate(self._serving) if r is None and s not in held]
    while len(free) < len(self._pending) and self._kept:
      free.append(self._kept.popitem(last=False)[1][0])
      self.stats["evicted"] += 1
    take = [self._pending.popleft() for _ in range(min(len(free), len(self._pending)))]
    if take:
      self._prefill(self._admit, [(r, s, 0) for r, s in zip(take, free)])

  def decode(self) -> None:
    """One segment of up to CHECK_EVERY decode steps, if any request is in a slot."""
    if any(r is not None for r in self._serving):
      self.state, self.g = self._decode(self._model, self.state, self.g, self._segment)

  def _prefill(self, fn, items: list[tuple[Request, int, int]]) -> None:
    """One call of `fn` (`admit_rows` or `extend_rows`) for (request, slot, ids cached there):
    each request's ids past the cached ones, left-padded to a width bucket."""
    k = bucket(len(items), self._buckets)
    width = bucket(max(len(r.ids) - n for r, _, n in items), self._widths)
    tokens_KW = np.full((k, width), self.cfg.pad_id, np.int32)
    valid_KW = np.zeros((k, width), bool)
    budget_K, index_K, slot_K = np.ones(k, np.int32), np.zeros(k, np.int32), np.zeros(k, np.int32)
    keys_K2 = np.zeros((k, 2), np.uint32)
    src_R = np.full(len(self._serving), -1, np.int32)
    forced_KN = np.full((k, self.cfg.max_new_tokens), -1, np.int32) if self.forced else None
    for j, (r, slot, n) in enumerate(items):
      if self.forced:
        forced_KN[j, :len(r.forced)] = r.forced
      new = r.ids[n:]
      tokens_KW[j, width - len(new):], valid_KW[j, width - len(new):] = new, True
      budget_K[j], index_K[j], keys_K2[j], slot_K[j], src_R[slot] = r.budget, r.row, r.key, slot, j
      self._serving[slot], self._switches[slot] = r, [(0, self.version)]
      self._done_R[slot], self._step_R[slot] = False, 0
      self.stats["new_tokens"] += len(new)
    valid_KW[len(items):, -1] = True  # bucket padding rows: one token, so attention is defined
    self.stats["prefill_tokens"] += k * width
    self.stats["continued" if fn is self._extend else "admitted"] += len(items)
    # admit_rows takes output rows (unused here: a request's results come back by its slot)
    first = slot_K if fn is self._extend else np.zeros(k, np.int32)
    forced = () if forced_KN is None else (forced_KN,)
    self.state = fn(self._model, self.state, self.g, *to_device(
        (tokens_KW, valid_KW, first, budget_K, keys_K2, index_K, src_R) + forced))

  # -- run state ------------------------------------------------------------------------------
  def snapshot(self) -> tuple[dict, dict]:
    """(device arrays, JSON meta) of everything in flight: the slots with their caches, the
    requests served, continuing and waiting, the kept caches and the token versions."""
    arrays = {"slots": numbered(self.state), "g": self.g}
    meta = {"version": self.version, "ring": self.ring,
            "serving": [None if r is None else r.meta() for r in self._serving],
            "switches": self._switches, "pending": [r.meta() for r in self._pending],
            "continuing": [[r.meta(), s, n] for r, s, n in self._continuing],
            "kept": [[tag, s, list(ids)] for tag, (s, ids) in self._kept.items()]}
    return arrays, meta

  def restore(self, arrays: dict, meta: dict) -> None:
    """Puts back a `snapshot` of an engine of the same shape."""
    self.state, self.g = unnumbered(self.state, arrays["slots"]), arrays["g"]
    self.version = meta["version"]
    self._serving = [None if m is None else Request.of(m) for m in meta["serving"]]
    self._switches = [[tuple(x) for x in row] for row in meta["switches"]]
    self._pending = collections.deque(Request.of(m) for m in meta["pending"])
    self._continuing = [(Request.of(m), s, n) for m, s, n in meta["continuing"]]
    self._kept = collections.OrderedDict(
        (tuple(t) if isinstance(t, list) else t, (s, tuple(ids))) for t, s, ids in meta["kept"])
    # The host's copies of the slot flags and step counts are read by the next `poll`.
