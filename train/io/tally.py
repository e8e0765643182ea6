"""`Tally`: counts by name that any thread adds to (the executors', an environment's steps), kept
under a lock; the run's host transfers, its multi-turn decoding and its user code's errors each
own one."""
from __future__ import annotations

import collections
import threading
from collections.abc import Mapping


class Tally:

  def __init__(self):
    self._lock = threading.Lock()
    self._counts: collections.Counter = collections.Counter()

  def add(self, counts: Mapping[str, int]) -> None:
    with self._lock:
      self._counts.update(counts)

  def snapshot(self) -> dict[str, int]:
    """The counts so far (a copy)."""
    with self._lock:
      return dict(self._counts)

  def total(self) -> int:
    with self._lock:
      return self._counts.total()

  def clear(self) -> None:
    with self._lock:
      self._counts.clear()
