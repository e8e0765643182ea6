"""Partial rollouts: `PartialRolloutWorker` drives a `BatchStream` (sampler/stream.py's protocol:
`Sampler.stream`'s rows or train/rollout/conversations.py's conversations) on the worker's
thread with the schedule of jaxrl/schedules.py (staleness bound, free or fixed) and the run
state of train/rollout/worker.py, whose shared state it reaches only through `Worker`'s methods
for subclasses. Each look between decode segments harvests the finished rows (a batch leaves
once all its rows are done, in index order, with every token's policy version), swaps in newer
weights (free schedule; fixed: only as a batch opens), opens the batches the schedule allows
while free slots outnumber the rows waiting (at most the geometry's `live`), fills the free
slots and decodes the next segment.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from sampler.stream import BatchStream
from train.rollout.batches import RolloutBatch, WorkerState
from train.rollout.conversations import NotReplayable
from train.rollout.worker import Worker

log = logging.getLogger("jaxrl")


class PartialRolloutWorker(Worker):
  """A `BatchStream` driven on the worker's thread: batches open as the schedule allows and
  slots free up, new weights are swapped in between decode segments (free schedule) or as a
  batch opens (fixed), and each batch leaves with its rows' token versions. `prompts[i]` is
  batch i (host arrays; IndexError: the stream ended)."""

  def __init__(self, stream: BatchStream, prompts: Sequence, params: Any, *,
               span: Callable | None = None, **worker):
    """`span()`: a context manager around each look and segment (a timeline's busy time);
    `worker`: the Worker's settings, its `decide` here also whether each batch opens, and (free
    schedule) which weights each segment decodes with, so that a group of processes runs the
    same segments; with a `stride` (one of several generators) the stream opens every
    stride-th batch."""
    super().__init__(prompts, params, **worker)
    self.stream, self._ended = stream, False
    self._span = span or contextlib.nullcontext
    self._opened: dict[int, float] = {}  # batch index -> when it opened
    self._next: tuple[int, Any] | None = None  # the next batch's prompts, read once
    stream.install(*self.installed)
    stream.stride = self.stride
    state = worker.get("state")
    if not (state is not None and "stream" in state.arrays and self._restore(state)):
      stream.next_index = stream.next_emit = self.next_to_generate
    self.launch()

  def _restore(self, state: WorkerState) -> bool:
    """Puts back the stream's rows in flight; False where an environment did not replay (then
    their batches are generated again)."""
    try:
      # The version its rows decoded with: a newer push is swapped in (and recorded) first.
      self.stream.restore(state.arrays["stream"], state.meta["stream"], self.prompt_batch,
                          self.batch_key_data)
    except NotReplayable as e:
      log.warning("the conversations in flight are generated again: %s", e)
      return False
    return True

  def _needs_pause(self) -> bool:
    return True  # the stream's arrays change with every device call

  def _state(self) -> WorkerState:
    state = super()._state()
    if self.failed:  # a device call failed half-way: the queue alone is sound
      return state
    arrays, meta = self.stream.snapshot()
    state.arrays["stream"], state.meta["stream"] = arrays, meta
    return state

  def _open(self) -> bool:
    """Opens the batches the schedule allows while free slots outnumber the pending rows;
    False when the worker was closed."""
    s = self.stream
    while not self._ended and s.free > s.unadmitted and s.open_batches < s.geometry.live:
      index = s.next_index
      if self._next is None or self._next[0] != index:
        try:
          self._next = (index, self.prompt_batch(index))
        except IndexError:
          self._ended = True
          return True
      with self.locked():
        blocked = self.schedule.blocked(self.view(), index, s.next_emit)
        if self.agreed(f"open {index}", int(blocked)):
          return True
        if not self.schedule.swaps_between_segments:  # its weights change as a batch opens
          installed = self.installed.version
          if (weights := self.start_batch(index)) is None:
            return False
          if weights.version != installed:
            s.swap(*weights)
      s.open(self._next[1], self.batch_key_data(index))
    return True

  def _step(self) -> bool:
    """One look between segments and the segment after it; False to stop."""
    s = self.stream
    t = time.perf_counter()
    with self._span():
      done = s.poll()
    for batch, rollout in done:
      self.put(RolloutBatch(rollout, batch.prompts, batch.version, batch.index,
                            t - self._opened.pop(batch.index, t),
                            batch.versions_BN(s.geometry.max_new_tokens)))
    with self.locked():
      if not self.pause_point():
        return False
      if self.schedule.swaps_between_segments and (
          weights := self.install_newest(s.version)) is not None:
        s.swap(*weights)
      changes = self.changes
    opened = s.next_index
    if not self._open():
      return False
    self._opened.update({i: t for i in range(opened, s.next_index, self.stride)})
    if s.decoding or (s.unadmitted and s.free):
      with self._span():
        if s.unadmitted and s.free:
          s.admit()
        s.decode()
    elif self._ended and not s.open_batches:
      self.finish()
      return False
    else:  # nothing to decode until the trainer moves
      with self.locked():
        self.wait_for_change(changes)
    return True

  def _run(self) -> None:
    while self._step():
      pass
