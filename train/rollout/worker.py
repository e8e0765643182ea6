"""The asynchronous rollout workers: a background thread that owns generation.

`train.rollout.whole.RolloutWorker` generates whole prompt batches, one generate call each, with
the weights it installed as the batch started. `train.rollout.partial.PartialRolloutWorker`
decodes a continuous stream of rows in in-flight slots (`Sampler.stream`) and installs new
weights between decode segments: the rows in flight continue with them (partial rollouts), every
token recording its policy version and log-prob. Both tag each finished batch with its prompt
index and the version of its oldest tokens; the trainer pushes weights with
`update_weights(params, version)` and takes batches, in index order, with `get()`. When a batch
may start and which weights it starts with is the schedule's (jaxrl/schedules.py), which reads a
`WorkerView` taken under the lock. A subclass reaches the queue, the weights and the lock through
`Worker`'s methods (`start_batch`, `install_newest`, `put`, `finish`, `pause_point`, ...).

Run state (`paused()` yields a `WorkerState`; `state=` puts one back): the batches not yet taken,
the in-flight decode state, the installed version and, where older than the newest push, its
weights. Keys need no saving: batch i draws from `rollout_key(seed, i)`.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxrl.schedules import SCHEDULES, WorkerView
from sharding.reshard import to_host
from train.rollout.batches import RolloutBatch, WorkerState, queue_state, restored_queue
from train.rollout.generator import rollout_key


class RolloutWorkerError(RuntimeError):
  """Raised in the consumer when the worker thread failed; the cause carries its traceback."""


class GroupClosed(Exception):
  """Raised by `decide` on a process whose group's first process closed before deciding: the
  worker's thread ends there, as the first process's did."""


class Weights(NamedTuple):
  """Weights a worker holds, with their policy version."""
  params: Any  # in the sampler's layout
  version: int


class Worker:
  """The schedule, the weights hand-over, the queue and the thread; subclasses generate.

  A subclass implements `_run` (the thread's loop, started by `launch()`) and may extend
  `_state` and `_needs_pause`; it reaches the shared state only through the methods of "the
  worker's thread" below, holding `locked()` where they say so. The schedule reads the worker
  through `view()`."""

  def __init__(self, prompts: Sequence, params: Any, *, version: int = 0,
               max_staleness: int = 1, seed: int = 0, start_index: int = 0,
               schedule: str = "free", transfer: Callable | None = None,
               state: WorkerState | None = None, decide: Callable[[str, int], int] | None = None,
               stride: int = 1, trainer_at: int | None = None):
    """`decide(key, version)`: the group's first process's choice where several processes run
    this worker on one mesh (train/rollout/decisions.py), whatever each process's
    timing (`decide.leader`: this is the first process; `decide.told()`: the first process has
    made the next choice; `decide.caught_up()`: this process has taken every choice the first
    one made before it closed: closing, too, is the first process's choice, and the others run
    on to the same point, through the same device programs). `stride`: this worker generates
    every stride-th batch from `start_index` (one of several generators,
    train/rollout/replicas.py `Generators`); `trainer_at`: the batch the trainer takes next,
    whichever generator's (default `start_index`; each push says it anew)."""
    if schedule not in SCHEDULES:
      raise ValueError(f"schedule: expected one of {list(SCHEDULES)}, got {schedule!r}")
    self._prompts, self._seed, self.stride = prompts, seed, stride
    self.schedule = SCHEDULES[schedule](max_staleness)
    self._transfer = transfer or (lambda p: p)
    self._cond = threading.Condition()
    self._pending = Weights(self._transfer(params), version)  # the newest weights pushed
    self._installed = self._pending  # the weights the worker decodes with
    self._decide = decide
    self._queue: collections.deque[RolloutBatch] = collections.deque()
    self._taken = start_index  # = the index of the next of this worker's batches taken
    # The index of the next batch the trainer takes (with several generators, as of the last
    # batch it took here or its last push: a staleness bound on it holds for the true one)
    self._trainer_at = start_index if trainer_at is None else trainer_at
    self._push_due = self._waiting = False
    self._changes = 0  # bumped by every event the worker may be waiting for
    self._closed = self._exhausted = False
    self._pause: dict | None = None  # {"state": WorkerState | None} while a pause is asked
    self._done = False  # the thread's loop returned
    self._error: BaseException | None = None
    if state is not None:
      self._queue.extend(restored_queue(state, prompts))
      if "params" in state.arrays:  # fixed schedule: older weights than the newest push
        self._installed = Weights(state.arrays["params"], state.meta["installed"])
    self._kept = {w.version: w for w in (self._installed, self._pending)}  # (`decide`'s)
    if decide is not None:
      decide.serve_pause = self._serve_told_pause
    self._thread = threading.Thread(target=self._main, name="rollout-worker", daemon=True)

  @property
  def version(self) -> int:
    """The newest pushed policy version."""
    return self._pending.version

  def view(self) -> WorkerView:
    """What the schedule reads (holding the lock)."""
    return WorkerView(taken=self._trainer_at, push_coming=self._push_due and not self._waiting,
                      installed=self._installed.version, newest=self._pending.version,
                      exhausted=self._exhausted, next_own=self.next_to_generate,
                      stride=self.stride)

  # -- the trainer's side ---------------------------------------------------------------------
  def update_weights(self, params: Any, version: int, taken: int | None = None) -> None:
    """Pushes new weights (the worker takes them when its schedule says; a fixed schedule first
    waits until the worker has installed version - 1); `taken`: the batch the trainer takes
    next, where it takes others' too (several generators)."""
    params = self._transfer(params)  # outside the lock: a reshard can take a while
    with self._cond:
      if version <= self._pending.version:
        raise ValueError(f"policy version must increase: got {version} after {self.version}")
      self._wait(lambda: self.schedule.push_ready(self.view(), version))
      self._pending, self._push_due = Weights(params, version), False
      self._trainer_at = max(self._trainer_at, taken or 0)
      if self._decide is not None:
        self._kept[version] = self._pending
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
        self._taken, self._push_due = batch.index + self.stride, True
        self._trainer_at = batch.index + 1
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
        self._wait(lambda: self._pause["state"] is not None or self._done)
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

  # -- the worker's thread (for subclasses) ---------------------------------------------------
  def launch(self) -> None:
    """Starts the thread (the end of a subclass's __init__)."""
    self._thread.start()

  def locked(self) -> threading.Condition:
    """The worker's lock, as a context manager."""
    return self._cond

  @property
  def installed(self) -> Weights:
    """The weights the worker decodes with."""
    return self._installed

  @property
  def next_to_generate(self) -> int:
    """The first of this worker's batches neither taken by the trainer nor queued."""
    return self._taken + self.stride * len(self._queue)

  @property
  def failed(self) -> bool:
    """The thread failed (its error reaches `get`)."""
    return self._error is not None

  @property
  def changes(self) -> int:
    """The count of events so far (holding the lock): pushes, takes, pauses, closes, ..."""
    return self._changes

  def prompt_batch(self, index: int):
    """Prompt batch `index` (host arrays; IndexError: the stream ended)."""
    return self._prompts[index]

  def batch_key(self, index: int) -> jax.Array:
    """Batch `index`'s random key: `rollout_key(seed, index)`."""
    return rollout_key(self._seed, index)

  def batch_key_data(self, index: int) -> np.ndarray:
    """Batch `index`'s random key as host key data."""
    return to_host(jax.random.key_data(self.batch_key(index)))

  def start_batch(self, index: int) -> Weights | None:
    """Waits (holding the lock) until the schedule lets batch `index` start, and installs the
    weights it starts with; them (None: the worker was closed)."""
    if self._follows:  # (it serves pauses meanwhile)
      ready = self._decide.told  # the first process's choice for this batch, whatever the view
    else:
      ready = lambda: self.schedule.ready(self.view(), index)  # noqa: E731
    self._serve_pause()  # (a group's pause point, as every batch starts)
    if not self._wait(ready, pause_here=True):
      return None
    chosen = self._pending if self.schedule.takes_pending(self.view(), index) else self._installed
    if self._decide is not None and (chosen := self._agreed(f"batch {index}", chosen)) is None:
      return None
    self._installed = chosen
    return self._installed

  def agreed(self, key: str, value: int) -> int:
    """(Holding the lock) `value`, or with `decide` the group's first process's for `key`."""
    if self._decide is None:
      return value
    self._cond.release()  # the group's first process may be waiting on this one's pushes
    try:
      return self._decide(key, value)  # (GroupClosed: the first process stopped before it)
    finally:
      self._cond.acquire()

  def _agreed(self, key: str, weights: Weights) -> Weights | None:
    """(Holding the lock) the agreed version's weights once here (None: closed before they
    came). A choice made is run whether or not the worker was closed meanwhile: the group's
    other processes run the device programs it leads to, which wait for this one's."""
    version = self.agreed(key, weights.version)
    self._wait(lambda: version in self._kept)  # (the first process's are here: no wait)
    if version not in self._kept:
      return None
    self._kept = {v: w for v, w in self._kept.items() if v >= version}
    return self._kept[version]

  def install_newest(self, than: int) -> Weights | None:
    """(Holding the lock) installs the newest pushed weights (with `decide`: the agreed ones)
    where newer than version `than`; them (None: none are newer)."""
    newest = self._pending if self._pending.version > than else self._installed
    if self._decide is not None:
      newest = self._agreed("segment", newest)
    if newest is None or newest.version <= than:
      return None
    self._installed = newest
    return self._installed

  def pause_point(self) -> bool:
    """(Holding the lock) serves a pause asked for meanwhile; False when the worker was closed.
    In a group of processes whether to go on is the first process's choice: the device
    programs that follow (a decode segment) may make none, and a process that ran one after
    the first had stopped would wait in its collectives for ever."""
    self._serve_pause()
    if self._decide is None:
      return not self._closed
    return bool(self.agreed("go on", int(not self._closed)))

  def wait_for_change(self, seen: int) -> bool:
    """Waits (holding the lock), serving pauses, until `changes` has moved past `seen`; False
    when the worker was closed."""
    return self._wait(lambda: self._changes != seen)

  def put(self, batch: RolloutBatch) -> None:
    """A finished batch, for the trainer."""
    with self._cond:
      self._queue.append(batch)
      self._changed()

  def finish(self) -> None:
    """The prompts ran out: `get` stops once the queue is empty."""
    with self._cond:
      self._exhausted = True
      self._changed()

  # -- the worker's side ----------------------------------------------------------------------
  def _changed(self) -> None:
    self._changes += 1
    self._cond.notify_all()

  @property
  def _follows(self) -> bool:
    """One of a group's processes, not its first: it takes the first one's choices."""
    return self._decide is not None and not self._decide.leader

  def _closing(self) -> bool:
    """Closed, and (a group of processes) at the point where the first process stopped."""
    return self._closed and (self._decide is None or self._decide.caught_up())

  def _raise_if_failed(self) -> None:
    if self._error is not None:
      raise RolloutWorkerError(f"rollout worker failed: {self._error!r}") from self._error
    if self._closed:
      raise RolloutWorkerError("rollout worker is closed")

  def _wait(self, ready: Callable[[], bool], *, pause_here: bool = False) -> bool:
    """Waits (holding the lock) until `ready()`; False when the worker was closed. On the
    worker's thread a pause asked meanwhile is served here (in a group of processes only where
    `pause_here`: a point every process of the group reaches after the same choices)."""
    serves = pause_here or self._decide is None
    while not ready():
      if self._closing() or self._error is not None:
        return False
      if serves:
        self._serve_pause()
      if ready():
        break
      self._cond.wait(0.2 if self._follows else None)  # (a follower polls `told`)
    return not self._closing()

  def _serve_pause(self, told: bool = False) -> None:
    """(Holding the lock, on the worker's thread) the state for a pause asked, and the wait
    until it ends. In a group of processes the first process serves it where it is, and tells
    the others among its choices (`decide.paused()`); they serve it there (`told`), and nowhere
    else: every process's state is then taken after the same device programs."""
    if threading.current_thread() is not self._thread or (self._follows and not told):
      return
    while told and self._pause is None and not self._closed:  # (its trainer's request comes)
      self._cond.wait()
    while (pause := self._pause) is not None and pause["state"] is None:
      if self._decide is not None and self._decide.leader:
        self._decide.paused()
      pause["state"] = self._state()
      self._changed()
      # Until this pause ends: the trainer may ask the next one before this thread wakes (then
      # it is served here too, but a follower's comes with the first process's next marker).
      while self._pause is pause and not self._closing():
        self._cond.wait()
      if told:
        return

  def _serve_told_pause(self) -> None:
    """`decide`'s where the group's first process served a pause (a follower's choice)."""
    with self._cond:
      self._serve_pause(told=True)

  def _main(self) -> None:
    try:
      self._run()
    except GroupClosed:
      pass
    except BaseException as e:  # surfaced in the consumer by get()
      with self._cond:
        self._error = e
    finally:
      with self._cond:
        self._done = True
        self._changed()

  def _state(self) -> WorkerState:
    """The run state now (holding the lock)."""
    state = queue_state(self._queue, self._installed.version)
    state.meta["installed_params"] = self._installed.version != self._pending.version
    if state.meta["installed_params"]:
      state.arrays["params"] = self._installed.params
    return state

  def _needs_pause(self) -> bool:
    """Whether a pause waits for the thread (a group's processes: to pause at one point)."""
    return self._decide is not None

  def _run(self) -> None:
    raise NotImplementedError

