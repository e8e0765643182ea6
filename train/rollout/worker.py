"""The asynchronous rollout workers: a background thread that owns generation.

`RolloutWorker` generates whole prompt batches, one generate call each, with the weights it
installed as the batch started. `train.rollout.partial.PartialRolloutWorker` decodes a continuous
stream of rows in in-flight slots (`Sampler.stream`) and installs new weights between decode
segments: the rows in flight continue with them (partial rollouts), every token recording its
policy version and log-prob. Both tag each finished batch with its prompt index and the version
of its oldest tokens; the trainer pushes weights with `update_weights(params, version)` and takes
batches, in index order, with `get()`. When a batch may start and which weights it starts with
is the schedule's (jaxrl/schedules.py: free or fixed, the staleness bound).

Run state (`paused()` yields a `WorkerState`; `state=` puts one back): the finished batches not
yet taken, the in-flight decode state (partial rollouts), the version the worker decodes with
and, where it is older than the newest push, its weights. Keys need no saving: batch i draws
from `rollout_key(seed, i)`.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from sampler.engine import Rollout
from sharding.reshard import fetch
from train.rollout.generator import rollout_key
from jaxrl.schedules import SCHEDULES


class RolloutWorkerError(RuntimeError):
  """Raised in the consumer when the worker thread failed; the cause carries its traceback."""


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
  rollout: Any
  prompts: Any
  version: int  # policy version of its oldest tokens (whole batches: of all of them)
  index: int  # position in the prompt stream
  seconds: float  # wall time from its start to its end
  versions_BN: np.ndarray | None = None  # partial rollouts: each token's policy version

  def token_versions(self, n: int) -> np.ndarray:
    """[B, n] policy versions of the completion slots."""
    if self.versions_BN is not None:
      return self.versions_BN[:, :n]
    return np.full((self.rollout.completion_mask_BN.shape[0], n), self.version, np.int32)


@dataclasses.dataclass
class WorkerState:
  """A worker's run state: device arrays (an orbax item: nested dicts) and JSON meta."""
  arrays: dict
  meta: dict


class Worker:
  """The schedule, the weights hand-over, the queue and the thread; subclasses generate."""

  def __init__(self, prompts: Sequence, params: Any, *, version: int, max_staleness: int,
               seed: int, start_index: int, schedule: str, transfer: Callable | None,
               state: WorkerState | None):
    if schedule not in SCHEDULES:
      raise ValueError(f"schedule: expected one of {list(SCHEDULES)}, got {schedule!r}")
    self._prompts, self._seed = prompts, seed
    self.schedule = SCHEDULES[schedule](max_staleness)
    self._transfer = transfer or (lambda p: p)
    self._cond = threading.Condition()
    self._pending = (self._transfer(params), version)  # the newest weights pushed
    self._installed = self._pending  # the weights the worker decodes with
    self._queue: collections.deque[RolloutBatch] = collections.deque()
    self._taken = start_index  # = the index of the next batch the trainer takes
    self._push_due = self._waiting = False
    self._changes = 0  # bumped by every event the worker may be waiting for
    self._closed = self._exhausted = False
    self._pause: dict | None = None  # {"state": WorkerState | None} while a pause is asked
    self._error: BaseException | None = None
    if state is not None:
      self._queue.extend(_restore_queue(state, prompts))
      if "params" in state.arrays:  # fixed schedule: older weights than the newest push
        self._installed = (state.arrays["params"], state.meta["installed"])
    self._thread = threading.Thread(target=self._main, name="rollout-worker", daemon=True)

  @property
  def version(self) -> int:
    """The newest pushed policy version."""
    return self._pending[1]

  @property
  def installed_version(self) -> int:
    """The version the worker decodes with."""
    return self._installed[1]

  @property
  def exhausted(self) -> bool:
    return self._exhausted

  def ahead(self, index: int) -> int:
    """How many policy updates can come before the trainer takes batch `index`: the batches
    before it not yet taken, plus one when the trainer has taken a batch since its last push
    and is not waiting for another (its push comes first)."""
    return index - self._taken + (self._push_due and not self._waiting)

  # -- the trainer's side ---------------------------------------------------------------------
  def update_weights(self, params: Any, version: int) -> None:
    """Pushes new weights (the worker takes them when its schedule says; a fixed schedule first
    waits until the worker has installed version - 1)."""
    params = self._transfer(params)  # outside the lock: a reshard can take a while
    with self._cond:
      if version <= self._pending[1]:
        raise ValueError(f"policy version must increase: got {version} after {self._pending[1]}")
      self._wait(lambda: self.schedule.push_ready(self, version))
      self._pending, self._push_due = (params, version), False
      self._changed()

  def get(self, timeout: float | None = None) -> RolloutBatch:
    """The next batch in index order; StopIteration when the prompts ran out."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cond:
      self._waiting = True
      self._changed()
      try:
        while not self._queue:
          self._raise_if_failed()
          if self._exhausted:
            raise StopIteration
          remaining = None if deadline is None else deadline - time.monotonic()
          if remaining is not None and remaining <= 0:
            raise TimeoutError(f"no rollout batch within {timeout} s")
          self._cond.wait(remaining)
        batch = self._queue.popleft()
        self._taken, self._push_due = batch.index + 1, True
        return batch
      finally:
        self._waiting = False
        self._changed()

  def __iter__(self):
    while True:
      try:
        yield self.get()
      except StopIteration:
        return

  @contextlib.contextmanager
  def paused(self):
    """The worker's run state, taken at a point it can continue from; the worker stays there
    until the block ends (its device arrays must not change while they are being saved)."""
    with self._cond:  # (a failed worker's state is saved too: its error reaches `get`)
      if self._thread.is_alive() and self._needs_pause():
        self._pause = {"state": None}
        self._changed()
        self._wait(lambda: self._pause["state"] is not None or not self._thread.is_alive())
        state = self._pause["state"] or self._state()  # (the thread may have ended meanwhile)
      else:
        state = self._state()
    try:
      yield state
    finally:
      with self._cond:
        self._pause = None
        self._changed()

  def close(self, timeout: float = 30.0) -> None:
    """Stops the thread (after the device call in flight, if any) and drops queued batches."""
    with self._cond:
      self._closed = True
      self._queue.clear()
      self._changed()
    self._thread.join(timeout)
    if self._thread.is_alive():
      raise RolloutWorkerError(f"rollout worker did not stop within {timeout} s")

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- the worker's side ----------------------------------------------------------------------
  def _changed(self) -> None:
    self._changes += 1
    self._cond.notify_all()

  def _raise_if_failed(self) -> None:
    if self._error is not None:
      raise RolloutWorkerError(f"rollout worker failed: {self._error!r}") from self._error
    if self._closed:
      raise RolloutWorkerError("rollout worker is closed")

  def _wait(self, ready: Callable[[], bool]) -> bool:
    """Waits (holding the lock) until `ready()`; False when the worker was closed. On the
    worker's thread a pause asked meanwhile is served here."""
    while not ready():
      if self._closed or self._error is not None:
        return False
      self._serve_pause()
      if ready():
        break
      self._cond.wait()
    return not self._closed

  def _serve_pause(self) -> None:
    if threading.current_thread() is not self._thread or self._pause is None:
      return
    self._pause["state"] = self._state()
    self._changed()
    while self._pause is not None and not self._closed:
      self._cond.wait()

  def _start(self, index: int) -> bool:
    """Waits (holding the lock) until the schedule lets batch `index` start, and installs the
    weights it starts with; False when the worker was closed."""
    if not self._wait(lambda: self.schedule.ready(self, index)):
      return False
    if self.schedule.takes_pending(self, index):
      self._installed = self._pending
    return True

  def _keys(self, index: int) -> np.ndarray:
    return fetch(jax.random.key_data(rollout_key(self._seed, index)))

  def _main(self) -> None:
    try:
      self._run()
    except BaseException as e:  # surfaced in the consumer by get()
      with self._cond:
        self._error = e
        self._changed()

  def _finish(self) -> None:
    with self._cond:
      self._exhausted = True
      self._changed()

  def _put(self, batch: RolloutBatch) -> None:
    with self._cond:
      self._queue.append(batch)
      self._changed()

  def _state(self) -> WorkerState:
    """The run state now (holding the lock)."""
    arrays, meta = {}, {"installed": self._installed[1], "queue": []}
    if self._queue:
      arrays["queue"] = {}
    for batch in self._queue:
      arrays["queue"][str(batch.index)] = {k: v for k, v in vars(batch.rollout).items()
                                           if v is not None}
      meta["queue"].append({"index": batch.index, "version": batch.version,
                            "seconds": batch.seconds,
                            "versions": None if batch.versions_BN is None
                            else batch.versions_BN.tolist()})
    meta["installed_params"] = self._installed[1] != self._pending[1]
    if meta["installed_params"]:
      arrays["params"] = self._installed[0]
    return WorkerState(arrays, meta)

  def _needs_pause(self) -> bool:
    return False

  def _run(self) -> None:
    raise NotImplementedError


def _restore_queue(state: WorkerState, prompts: Sequence) -> list[RolloutBatch]:
  out = []
  for m in state.meta["queue"]:
    rollout = Rollout(**state.arrays["queue"][str(m["index"])])
    versions = None if m["versions"] is None else np.asarray(m["versions"], np.int32)
    out.append(RolloutBatch(rollout, prompts[m["index"]], m["version"], m["index"],
                            m["seconds"], versions))
  return out


class RolloutWorker(Worker):
  """Whole batches: `generate_fn(params, prompts, key) -> rollout` per prompt batch, batch i
  with `rollout_key(seed, i)`; `prompts[i]` is batch i (IndexError: the stream ended);
  `transfer` moves trainer weights into the sampler's layout (identity when None)."""

  def __init__(self, generate_fn: Callable[[Any, Any, jax.Array], Any], prompts: Sequence,
               params: Any, *, version: int = 0, max_staleness: int = 1, seed: int = 0,
               start_index: int = 0, schedule: str = "free", transfer: Callable | None = None,
               state: WorkerState | None = None):
    super().__init__(prompts, params, version=version, max_staleness=max_staleness, seed=seed,
                     start_index=start_index, schedule=schedule, transfer=transfer, state=state)
    self._generate = generate_fn
    self._thread.start()

  def _weights_for(self, index: int):
    """Waits until batch `index` may start; the weights to generate it with (None: closed)."""
    with self._cond:
      return self._installed if self._start(index) else None

  def _run(self) -> None:
    index = self._taken + len(self._queue)
    while True:
      try:
        prompts = self._prompts[index]
      except IndexError:
        return self._finish()
      if (weights := self._weights_for(index)) is None:
        return
      t0 = time.perf_counter()
      rollout = jax.block_until_ready(self._generate(weights[0], prompts,
                                                     rollout_key(self._seed, index)))
      self._put(RolloutBatch(rollout, prompts, weights[1], index, time.perf_counter() - t0))
      index += 1
