"""Continuous in-flight decoding of a stream of prompt batches, with weight swaps between decode
segments: the engine of partial rollouts (`Sampler.stream`, driven by
train/rollout/partial.py).

`sampler/inflight.py` decodes one prompt batch in R row slots (sampler/slots.py). A `Stream`
keeps its R slots busy across batches: a slot freed by a finished row takes the next row of the
stream, from the batch being admitted or from the next one the worker opens, so one batch's long
tail decodes beside the next batch's rows instead of holding the slots. Between segments
(`CHECK_EVERY` decode steps) the host may install new weights (`swap`); the rows in flight keep their KV cache (computed by
the older weights) and continue, as in PipelineRL's in-flight weight updates (AReaL recomputes
the cache instead). Each token records the version of the weights whose logits it was drawn from
and its log-prob under them (mu), so the off-policy correction sees exactly the distribution
every token came from: the first token after a swap is still drawn from logits the old weights
computed, the ones after it from the new weights' logits.

Rows: row r of batch i (group-major, `n` samples per prompt) draws its uniforms from
`fold_in(key_i, r)`, indexed by its token index, as the in-flight engine does, so a sample does
not depend on its slot or on when it ran. Up to `live` batches are open at once; batch i's rows
go to region i mod `live` of the output buffers and a batch leaves (`poll`) once all its rows are
harvested and every earlier batch has left. Slots never shrink: the state keeps one shape, which
`snapshot` / `restore` save and put back exactly (the KV cache included), so a resumed stream
continues bit for bit.

The contract: a `StreamGeometry` (slots, rows per batch, batches open at once, the slots' ring)
is what a stream's buffers are laid out for and what its `snapshot` records, so a resume can
tell whether a checkpoint's rows in flight fit the run's stream; `BatchStream` is what the
partial-rollout worker drives, implemented by `Stream` (rows) and by
train/rollout/conversations.py's `ConversationStream` (conversations).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from sampler import slots
from sampler.engine import Rollout, bucket
from sampler.slots import CHECK_EVERY, Outputs, Slots, admit_rows, numbered, unnumbered
from sampler.spec import DecodeSpec
from sharding.mesh import batch_sharding
from sharding.reshard import to_device, to_host


@dataclasses.dataclass(frozen=True)
class StreamGeometry:
  """The layout of a stream's in-flight state: `slots` slots, `rows` output rows per batch
  (prompts x samples, group-major), up to `live` batches open at once, prompts of up to
  `prompt_width` tokens and `max_new_tokens` new ones (they size the slots' `ring`).
  `conversations`: the slots serve conversations' turns (sampler/requests.py) rather than rows."""
  slots: int
  rows: int
  live: int
  prompt_width: int
  max_new_tokens: int
  conversations: bool = False

  @property
  def ring(self) -> int:
    return slots.ring_width(self.prompt_width, self.max_new_tokens)

  def meta(self) -> dict:
    """What a `snapshot` records as its `shape`: a stream of another one cannot continue it."""
    shape = {"slots": self.slots, "rows": self.rows, "live": self.live, "ring": self.ring}
    return {"kind": "conversations", **shape} if self.conversations else shape

  def check(self, spec: DecodeSpec, n: int, *, conversations: bool) -> None:
    """ValueError unless a sampler of `spec` (`n` samples per prompt) can run this geometry,
    in a stream of conversations or of rows."""
    wanted = {"slots": spec.inflight_slots, "max_new_tokens": spec.cfg.max_new_tokens,
              "conversations": conversations}
    wrong = {k: getattr(self, k) for k, v in wanted.items() if getattr(self, k) != v}
    if wrong or self.rows % n:
      raise ValueError(f"a stream geometry of {wrong or {'rows': self.rows}} does not fit a "
                       f"sampler of {wanted} and {n} samples per prompt")


def _start(model, *, cfg, count: int, p: int, ring: int, rows: int):
  state = slots.empty_slots(model, cfg=cfg, slots=count, p=p, ring=ring)
  return state, slots.empty_outputs(rows, cfg, state.routes_RTLK), jnp.int32(0)


def _harvest(state: Slots, out: Outputs) -> tuple[Slots, Outputs]:
  """Finished rows copied to their output rows, their slots then free (no row): a region
  reused by a later batch is never written by a slot that finished an earlier one."""
  out = slots.harvest(state, out)
  return state.replace(row_R=jnp.where(state.done_R, -1, state.row_R)), out


def _take(out: Outputs, start, tokens_BP, valid_BP, *, n: int, rows: int) -> Rollout:
  """The rollout of the batch whose rows start at output row `start`."""
  cut = lambda x: jax.lax.dynamic_slice_in_dim(x, start, rows)
  mask_BN = cut(out.mask_BN)
  prompt_tokens_BP, prompt_valid_BP = (jnp.repeat(x, n, axis=0) for x in (tokens_BP, valid_BP))
  return Rollout(tokens_BT=jnp.concatenate([prompt_tokens_BP, cut(out.tokens_BN)], axis=1),
                 valid_BT=jnp.concatenate([prompt_valid_BP, mask_BN], axis=1),
                 completion_mask_BN=mask_BN, logprobs_BN=cut(out.logprobs_BN),
                 lengths_B=mask_BN.sum(axis=1),
                 routes_BTLK=None if out.routes_BTLK is None else cut(out.routes_BTLK))


class StreamPrograms(NamedTuple):
  """A stream's programs: the host loop admits rows in buckets of up to the slots' count."""
  cast: Callable
  start: Callable
  admit: Callable
  harvest: Callable
  decode: Callable
  take: Callable


def stream_programs(spec: DecodeSpec, geo: StreamGeometry) -> StreamPrograms:
  """The programs of a stream of `spec` laid out as `geo`, built once (the spec's cache)."""
  def build():
    cfg, jit = spec.cfg, slots.jitter(spec.mesh, spec.rules)
    return StreamPrograms(slots.caster(spec.graphdef),
                          jit(_start, cfg=cfg, count=spec.inflight_slots, p=geo.prompt_width,
                              ring=geo.ring, rows=geo.live * geo.rows),
                          jit(admit_rows, (1,), cfg=cfg, ring=geo.ring), jit(_harvest, (0, 1)),
                          jit(slots.decode, (1,), cfg=cfg), jit(_take, n=spec.n, rows=geo.rows))
  return spec.cached(build, "stream", geo)


@dataclasses.dataclass
class Batch:
  """A batch of the stream, open (some rows admitted or pending) or done."""
  index: int
  # host prompt batch: prompt_tokens, prompt_valid (and examples; optional max_new: [B * n])
  prompts: dict
  key: np.ndarray  # uint32 key data: rollout_key(seed, index)
  region: int
  version: int  # the weights' version as its first row was admitted (its oldest tokens)
  admitted: int = 0
  finished: int = 0
  # Per row, (first token index, version) each time the row's weights changed after admission
  switches: list = dataclasses.field(default_factory=list)

  def versions_BN(self, n: int) -> np.ndarray:
    """The policy version of every token slot of the batch's rows."""
    out = np.full((len(self.switches), n), self.version, np.int32)
    for r, row in enumerate(self.switches):
      for first, version in row:
        out[r, first:] = version
    return out

  def meta(self) -> dict:
    return {"index": self.index, "region": self.region, "version": self.version,
            "admitted": self.admitted, "finished": self.finished, "switches": self.switches}


class StreamBatch(Protocol):
  """A batch as `BatchStream.poll` returns it, beside its rollout."""
  index: int
  prompts: dict  # its host prompt batch
  version: int  # the weights' version as it opened (its oldest tokens)

  def versions_BN(self, n: int) -> np.ndarray:
    """The policy version of every token slot of its rows."""


@runtime_checkable
class BatchStream(Protocol):
  """Batches decoded in in-flight slots while the weights change: what the partial-rollout
  worker (train/rollout/partial.py) drives, from one thread. Batch `next_index` opens next and
  batch `next_emit` leaves next, each `stride` after the last (one of several generators makes
  every stride-th batch); `version` is the weights' version it decodes with."""
  geometry: StreamGeometry
  version: int
  next_index: int
  next_emit: int
  stride: int

  def poll(self) -> list[tuple[StreamBatch, Any]]:
    """The look between segments: the batches now complete, in index order, with rollouts."""

  @property
  def free(self) -> int:
    """Slots free for a row (or a turn)."""

  @property
  def decoding(self) -> bool:
    """`decode` has work: rows in flight (conversations: or turns waiting)."""

  @property
  def unadmitted(self) -> int:
    """Rows (turns) of the open batches waiting for a free slot."""

  @property
  def open_batches(self) -> int:
    """At most `geometry.live`."""

  def install(self, params, version: int) -> None:
    """The weights to decode with, nothing recorded (no row is in flight)."""

  def swap(self, params, version: int) -> None:
    """New weights from the next segment on; the rows in flight record where they began."""

  def open(self, prompts: dict, key: np.ndarray) -> None:
    """Batch `next_index` joins, its rows waiting for free slots (`key`: its key data)."""

  def admit(self) -> None:
    """Starts waiting rows in the free slots."""

  def decode(self) -> None:
    """One segment of up to CHECK_EVERY decode steps."""

  def snapshot(self) -> tuple[dict, dict]:
    """(device arrays, JSON meta) of everything in flight; the meta's `shape` is
    `geometry.meta()`."""

  def restore(self, arrays: dict, meta: dict, prompts, keys) -> None:
    """Puts back a `snapshot`; `prompts(i)` and `keys(i)` give batch i's prompts and keys."""


class Stream:
  """Row slots decoding a stream of batches of `geometry.rows` rows (`spec.n` samples per
  prompt), up to `geometry.live` open at once: a `BatchStream`. Not thread safe: one thread
  drives it (`poll`, `swap`, `open`, `admit`, `decode`)."""

  def __init__(self, spec: DecodeSpec, params, geometry: StreamGeometry):
    """`params` (the sampler's layout) give the state's shapes; `install` or `swap` sets the
    weights to decode with."""
    geometry.check(spec, spec.n, conversations=False)
    count = spec.inflight_slots
    self._buckets = slots.refill_buckets(spec.mesh, spec.rules, count)
    self.cfg, self.n, self.mesh, self.geometry = spec.cfg, spec.n, spec.mesh, geometry
    self.rows = geometry.rows  # output rows per batch
    (self._cast, self._start, self._admit, self._harvest, self._decode,
     self._take) = stream_programs(spec, geometry)
    self._grid = None if spec.mesh is None else batch_sharding(spec.mesh, spec.rules)
    self._segment = to_device(np.int32(CHECK_EVERY))
    self.install(params, 0)
    self.state, self.out, self.g = self._start(self.model)
    self.batches: dict[int, Batch] = {}  # open, by index
    self.next_index = self.next_emit = 0  # the next batch to open / to leave
    self.stride = 1  # (`BatchStream`)
    self._done_R = np.ones(count, bool)  # the host's copy of the slots' flags (poll, admit)
    self._row_R = np.full(count, -1, np.int32)
    self._step_R = np.zeros(count, np.int32)

  # -- the host's look between segments -----------------------------------------------------
  def poll(self) -> list[tuple[Batch, Rollout]]:
    """Reads the slots' flags, harvests the rows that finished and returns the batches that
    are now complete, in index order (each with its rollout on the devices)."""
    done_R, row_R, self._step_R = to_host((self.state.done_R, self.state.row_R, self.state.step_R))
    self._row_R = np.where(done_R, -1, row_R)  # after the harvest below
    finished = done_R & (row_R >= 0)
    if finished.any():
      self.state, self.out = self._harvest(self.state, self.out)
      for row in row_R[finished]:
        self._region_batch(row // self.rows).finished += 1
    self._done_R = done_R
    out = []
    while (b := self.batches.get(self.next_emit)) is not None and b.finished == self.rows:
      tokens, valid = (b.prompts[k] for k in ("prompt_tokens", "prompt_valid"))
      grid = None if self._grid is None else (self._grid, self._grid)
      rollout = self._take(self.out, to_device(np.int32(b.region * self.rows)),
                           *to_device((tokens, valid), grid))
      out.append((self.batches.pop(self.next_emit), rollout))
      self.next_emit += self.stride
    return out

  def _region_batch(self, region: int) -> Batch:
    return next(b for b in self.batches.values() if b.region == region)

  @property
  def free(self) -> int:
    return int(self._done_R.sum())

  @property
  def decoding(self) -> bool:
    return not self._done_R.all()

  @property
  def unadmitted(self) -> int:
    return sum(self.rows - b.admitted for b in self.batches.values())

  @property
  def open_batches(self) -> int:
    return len(self.batches)

  # -- weights, batches, rows -----------------------------------------------------------------
  def install(self, params, version: int) -> None:
    """The weights to decode with, nothing recorded (no row is in flight)."""
    self.model, self.version = self._cast(params), version

  def swap(self, params, version: int) -> None:
    """New weights from the next segment on; every row in flight records where they began."""
    for slot in np.flatnonzero(~self._done_R):
      row = self._row_R[slot]
      self._region_batch(row // self.rows).switches[row % self.rows].append(
          (int(self._step_R[slot]) + 1, version))
    self.install(params, version)

  def open(self, prompts: dict, key: np.ndarray) -> None:
    """Batch `next_index` joins the stream (its rows wait for free slots)."""
    live = self.geometry.live
    if len(self.batches) >= live:
      raise RuntimeError(f"at most {live} batches are open at once")
    i = self.next_index  # (its region: consecutive ones apart, whatever the stride)
    self.batches[i] = Batch(i, prompts, np.asarray(key, np.uint32), i // self.stride % live,
                            self.version, switches=[[] for _ in range(self.rows)])
    self.next_index += self.stride

  def admit(self) -> None:
    """Fills the free slots with the pending rows, oldest batch first (one prefill call)."""
    free = np.flatnonzero(self._done_R)
    rows = []  # (batch, row in batch)
    for b in sorted(self.batches.values(), key=lambda b: b.index):
      take = min(self.rows - b.admitted, len(free) - len(rows))
      rows += [(b, b.admitted + r) for r in range(take)]
      b.admitted += take
    for b, r in rows:  # a row starting after a swap decodes with newer weights than its batch's
      if self.version != b.version:
        b.switches[r].append((0, self.version))
    if not rows:
      return
    k = bucket(len(rows), self._buckets)
    width = max(b.prompts["prompt_tokens"].shape[1] for b, _ in rows)
    tokens_KP = np.full((k, width), self.cfg.pad_id, np.int32)
    valid_KP = np.zeros((k, width), bool)
    rows_K, index_K = np.zeros(k, np.int32), np.zeros(k, np.int32)
    budget_K = np.full(k, self.cfg.max_new_tokens, np.int32)
    keys_K2 = np.zeros((k, 2), np.uint32)
    for j, (b, r) in enumerate(rows + [rows[-1]] * (k - len(rows))):  # bucket padding: a copy
      t, v = b.prompts["prompt_tokens"][r // self.n], b.prompts["prompt_valid"][r // self.n]
      tokens_KP[j, width - len(t):], valid_KP[j, width - len(v):] = t, v
      rows_K[j], index_K[j], keys_K2[j] = b.region * self.rows + r, r, b.key
      if "max_new" in b.prompts:  # a batch may cap each output row's length
        budget_K[j] = min(b.prompts["max_new"][r], budget_K[j])
    src_R = np.full(self._done_R.shape, -1, np.int32)
    src_R[free[:len(rows)]] = np.arange(len(rows))
    self.state = self._admit(self.model, self.state, self.g,
                             *to_device((tokens_KP, valid_KP, rows_K, budget_K, keys_K2, index_K,
                                    src_R)))
    taken = free[:len(rows)]
    self._done_R, self._row_R, self._step_R = (x.copy() for x in (self._done_R, self._row_R,
                                                                  self._step_R))
    self._done_R[taken], self._row_R[taken], self._step_R[taken] = False, rows_K[:len(rows)], 0

  def decode(self) -> None:
    """One segment of up to CHECK_EVERY decode steps."""
    self.state, self.g = self._decode(self.model, self.state, self.g, self._segment)

  # -- run state ------------------------------------------------------------------------------
  def snapshot(self) -> tuple[dict, dict]:
    """(device arrays, JSON meta) of everything in flight: the slot state with its KV cache,
    the output buffers, the open batches' progress and versions."""
    arrays = {"slots": numbered(self.state), "out": numbered(self.out), "g": self.g}
    meta = {"version": self.version, "next_index": self.next_index,
            "next_emit": self.next_emit, "batches": [b.meta() for b in self.batches.values()],
            "shape": self.geometry.meta()}
    return arrays, meta

  def restore(self, arrays: dict, meta: dict, prompts, keys) -> None:
    """Puts back a `snapshot`; `prompts(i)` and `keys(i)` give batch i's prompts and key data."""
    self.state = unnumbered(self.state, arrays["slots"])
    self.out = unnumbered(self.out, arrays["out"])
    self.g, self.version = arrays["g"], meta["version"]
    self.next_index, self.next_emit = meta["next_index"], meta["next_emit"]
    self.batches = {}
    for m in meta["batches"]:
      self.batches[m["index"]] = Batch(
          m["index"], prompts(m["index"]), np.asarray(keys(m["index"]), np.uint32), m["region"],
          m["version"], m["admitted"], m["finished"],
          [[tuple(s) for s in row] for row in m["switches"]])
    # The host's copies of the slot flags are read by the next `poll`, which comes first.
