"""In-flight slots serving requests whose results come back to the host: in-flight batching
across the turns of multi-turn rollouts (train/rollout/multiturn.py), made by `Sampler.requests`.

A request is the token ids of a context (a prompt, or a conversation so far), a budget of new
tokens, and its random key and row: it waits for a free slot, is prefilled there (its context
left-padded to one of a few widths), decodes until EOS, a stop sequence or its budget, and
returns to the host as (tag, token ids, log-probs). The host may submit a follow-up at once (the
conversation's next turn after the environment's reply), which takes the next free slot while
the other rows keep decoding: a row whose turn ended never waits for the others' turns to end.

Rows draw as the in-flight engine's do: request row r with key k takes its uniforms from
`fold_in(k, r)`, indexed by its token index, so a turn's tokens do not depend on which slot or
step it ran in. Slots hold at most `context_width + max_new_tokens - 1` tokens (a context plus
what it generates must fit: a conversation never exceeds its prompt and its token budget).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from sampler import inflight
from sampler.engine import bucket
from sampler.inflight import CHECK_EVERY
from sampler.stream import admit_rows
from sharding.reshard import fetch, send

if TYPE_CHECKING:
  from sampler.sampler import Sampler

WIDTH_STEP = 16  # contexts are left-padded to WIDTH_STEP * 2^k tokens (a prefill program each)


@functools.lru_cache(maxsize=32)
def _programs(sampler: Sampler, ring: int):
  """The jitted pieces for `sampler` with slots of `ring` tokens, built once (a `Requests` is
  made per batch of conversations)."""
  cfg = sampler.cfg
  jit = inflight.jitter(sampler.mesh, sampler.rules)
  return (inflight.caster(sampler.graphdef),
          jit(inflight.empty_slots, cfg=cfg, slots=sampler.inflight_slots, p=ring, ring=ring),
          jit(admit_rows, (1,), cfg=cfg, ring=ring), jit(inflight.decode, (1,), cfg=cfg))


@dataclasses.dataclass(frozen=True)
class Request:
  tag: Any  # the caller's name for it
  ids: tuple[int, ...]  # the context
  budget: int  # most new tokens
  key: np.ndarray  # uint32 key data
  row: int  # its uniforms: fold_in(key, row)


class Requests:
  """`sampler.inflight_slots` slots serving requests (`submit`); `poll` returns the finished
  ones, `advance` admits the waiting ones into free slots and decodes one segment."""

  def __init__(self, sampler: Sampler, params, *, context_width: int):
    cfg, slots = sampler.cfg, sampler.inflight_slots
    self._buckets = inflight.refill_buckets(sampler.mesh, sampler.rules, slots)
    self.cfg, self.ring = cfg, context_width + cfg.max_new_tokens - 1
    self._widths = tuple(WIDTH_STEP << k for k in range(self.ring.bit_length())
                         if WIDTH_STEP << k < self.ring) + (self.ring,)
    cast, empty, self._admit, self._decode = _programs(sampler, self.ring)
    self._model = cast(params)
    self.state = empty(self._model)
    self.g, self._segment = send(np.int32(0)), send(np.int32(CHECK_EVERY))
    self._pending: collections.deque[Request] = collections.deque()
    self._serving: list[Request | None] = [None] * slots
    self._done_R = np.ones(slots, bool)

  def submit(self, request: Request) -> None:
    if len(request.ids) > self.ring or len(request.ids) + request.budget > self.ring + 1:
      raise ValueError(f"a context of {len(request.ids)} tokens and {request.budget} new ones "
                       f"do not fit a slot of {self.ring + 1}")
    self._pending.append(request)

  @property
  def busy(self) -> bool:
    return bool(self._pending) or any(r is not None for r in self._serving)

  def poll(self) -> list[tuple[Any, list[int], list[float]]]:
    """The requests that finished since the last look: (tag, token ids, their log-probs)."""
    self._done_R = fetch(self.state.done_R)
    finished = [s for s, r in enumerate(self._serving) if r is not None and self._done_R[s]]
    if not finished:
      return []
    tokens, mask, logp = fetch((self.state.tokens_RN, self.state.mask_RN, self.state.logprobs_RN))
    out = []
    for s in finished:
      out.append((self._serving[s].tag, tokens[s][mask[s]].tolist(), logp[s][mask[s]].tolist()))
      self._serving[s] = None
    return out

  def advance(self) -> None:
    """Admits waiting requests into the free slots (one prefill call), then decodes one
    segment of up to CHECK_EVERY steps."""
    free = [s for s, r in enumerate(self._serving) if r is None]
    take = [self._pending.popleft() for _ in range(min(len(free), len(self._pending)))]
    if take:
      self._start(take, free[:len(take)])
    if any(r is not None for r in self._serving):
      self.state, self.g = self._decode(self._model, self.state, self.g, self._segment)

  def _start(self, take: list[Request], slots: list[int]) -> None:
    k = bucket(len(take), self._buckets)
    width = bucket(max(len(r.ids) for r in take), self._widths)
    tokens_KP = np.full((k, width), self.cfg.pad_id, np.int32)
    valid_KP = np.zeros((k, width), bool)
    budget_K, index_K = np.ones(k, np.int32), np.zeros(k, np.int32)
    keys_K2 = np.zeros((k, 2), np.uint32)
    for j, r in enumerate(take):
      tokens_KP[j, width - len(r.ids):], valid_KP[j, width - len(r.ids):] = r.ids, True
      budget_K[j], index_K[j], keys_K2[j] = r.budget, r.row, r.key
    valid_KP[len(take):, -1] = True  # bucket padding rows: one token, so attention is defined
    src_R = np.full(len(self._serving), -1, np.int32)
    src_R[slots] = np.arange(len(take))
    self.state = self._admit(self._model, self.state, self.g,
                             *send((tokens_KP, valid_KP, np.zeros(k, np.int32), budget_K,
                                    keys_K2, index_K, src_R)))
    for s, r in zip(slots, take):
      self._serving[s] = r
