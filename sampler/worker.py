"""The asynchronous rollout worker: a background thread that owns generation.

It keeps a bounded queue of rollout batches, each tagged with the policy version whose weights
produced it. The trainer calls `update_weights(params, version)` after each update and `get()` for
the next batch. Staleness is bounded at both ends: the worker generates at most
`max_staleness + 1` batches per policy version, and `get()` drops any batch more than
`max_staleness` versions behind the newest weights (0 = synchronous: every consumed batch comes
from the current weights).
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax


def rollout_key(seed: int, index: int) -> jax.Array:
  """The random key of prompt batch `index`: the same whether the batch is generated in turn,
  ahead of the trainer, or again after a resume. (Two integers go to the device: allowed even
  where a test guards against host transfers.)"""
  with jax.transfer_guard_host_to_device("allow"):
    return jax.random.fold_in(jax.random.key(seed), index)


class RolloutWorkerError(RuntimeError):
  """Raised in the consumer when the worker thread failed; the cause carries its traceback."""


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
  rollout: Any
  prompts: Any
  version: int  # policy version of the weights that generated it
  index: int  # position in the prompt stream
  seconds: float  # wall time of the generate call


class RolloutWorker:

  def __init__(self, generate_fn: Callable[[Any, Any, jax.Array], Any], prompts: Iterable,
               params: Any, *, version: int = 0, max_staleness: int = 1, queue_size: int = 2,
               seed: int = 0, start_index: int = 0,
               transfer: Callable[[Any], Any] | None = None):
    """`generate_fn(params, prompts, key) -> rollout`; `prompts` yields the batches of the
    prompt stream from position `start_index` on, and batch i is generated with
    `rollout_key(seed, i)`; `transfer` moves trainer weights into the sampler's layout (e.g. a
    reshard); identity when None."""
    if max_staleness < 0 or queue_size < 1:
      raise ValueError(f"max_staleness must be >= 0 and queue_size >= 1, got {max_staleness}, "
                       f"{queue_size}")
    self._generate = generate_fn
    self._prompts = iter(prompts)
    self._transfer = transfer or (lambda p: p)
    self.max_staleness, self.queue_size = max_staleness, queue_size
    self._cond = threading.Condition()
    self._queue: collections.deque[RolloutBatch] = collections.deque()
    self._params, self._version = self._transfer(params), version
    self._produced_at_version = 0
    self._closed = self._exhausted = False
    self._error: BaseException | None = None
    self.dropped = 0  # batches discarded as too stale
    self._seed, self._start_index = seed, start_index
    self._thread = threading.Thread(target=self._run, name="rollout-worker", daemon=True)
    self._thread.start()

  @property
  def version(self) -> int:
    return self._version

  @property
  def params(self) -> Any:
    """The newest weights, in the sampler's layout."""
    with self._cond:
      return self._params

  def update_weights(self, params: Any, version: int) -> None:
    """Installs new weights; the generate call in flight (if any) finishes with the old ones."""
    params = self._transfer(params)  # outside the lock: a reshard can take a while
    with self._cond:
      if version <= self._version:
        raise ValueError(f"policy version must increase: got {version} after {self._version}")
      self._params, self._version = params, version
      self._produced_at_version = 0
      self._cond.notify_all()

  def get(self, timeout: float | None = None) -> RolloutBatch:
    """The oldest batch within the staleness bound; StopIteration when the prompts ran out."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cond:
      while True:
        if self._error is not None:
          raise RolloutWorkerError(f"rollout worker failed: {self._error!r}") from self._error
        while self._queue and self._queue[0].version < self._version - self.max_staleness:
          self._queue.popleft()
          self.dropped += 1
          self._cond.notify_all()
        if self._queue:
          batch = self._queue.popleft()
          self._cond.notify_all()
          return batch
        if self._exhausted:
          raise StopIteration
        if self._closed:
          raise RolloutWorkerError("rollout worker is closed")
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
          raise TimeoutError(f"no rollout batch within {timeout} s")
        self._cond.wait(remaining)

  def __iter__(self):
    while True:
      try:
        yield self.get()
      except StopIteration:
        return

  def _may_generate(self) -> bool:
    return (len(self._queue) < self.queue_size
            and self._produced_at_version <= self.max_staleness)

  def _run(self) -> None:
    index = self._start_index
    try:
      while True:
        with self._cond:
          while not self._closed and not self._may_generate():
            self._cond.wait()
          if self._closed:
            return
          params, version = self._params, self._version
          self._produced_at_version += 1
        try:
          prompts = next(self._prompts)
        except StopIteration:
          with self._cond:
            self._exhausted = True
            self._cond.notify_all()
          return
        t0 = time.perf_counter()
        rollout = jax.block_until_ready(self._generate(params, prompts,
                                                       rollout_key(self._seed, index)))
        batch = RolloutBatch(rollout, prompts, version, index, time.perf_counter() - t0)
        index += 1
        with self._cond:
          self._queue.append(batch)
          self._cond.notify_all()
    except BaseException as e:  # surfaced in the consumer by get()
      with self._cond:
        self._error = e
        self._cond.notify_all()

  def close(self, timeout: float = 30.0) -> None:
    """Stops the thread (after the generate call in flight, if any) and drops queued batches."""
    with self._cond:
      self._closed = True
      self._queue.clear()
      self._cond.notify_all()
    self._thread.join(timeout)
    if self._thread.is_alive():
      raise RolloutWorkerError(f"rollout worker did not stop within {timeout} s")

  def __enter__(self) -> RolloutWorker:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
