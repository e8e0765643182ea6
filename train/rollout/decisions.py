"""Choices made once for a group of processes that run one worker on one mesh (a generator on
several processes, train/rollout/remote.py): the group's first process makes each choice that
timing decides (which weights a batch or segment decodes with, when a batch opens, where it
serves a pause the trainer asked for) and posts it in the coordination service's key-value
store; the others take them in order."""
from __future__ import annotations

from sharding import crossing
from train.rollout.worker import GroupClosed

PAUSE = "pause"  # the key of a pause the first process served, among its choices


class Decisions:
  """A worker's `decide` where several processes run it on one mesh: the group's first process
  posts its choices in order (`__call__` returns its own), the others take them. Closing is the
  first process's choice too: it stops its worker, then posts how many choices it made; the
  others run on to that count (through the same device programs) and stop there."""

  def __init__(self, name: str, leader: bool, *, made=crossing.Mailbox, poll_s: float = 0.5):
    """`made(name)`: the mailbox kind (a test's in-memory one)."""
    self.leader, self.count, self.limit, self._poll_s = leader, 0, None, poll_s
    self._choices, self._closed = made(f"{name}/decide"), made(f"{name}/closed")
    self.serve_pause = None  # the worker's: serves a pause where the first process did

  def __call__(self, key: str, version: int) -> int:
    if self.leader:
      self._choices.post(self.count, {"key": key, "version": version})
    else:  # (a pause the first process served before this choice: served here first)
      while (choice := self._take(key))["key"] == PAUSE:
        self.count += 1
        self.serve_pause()
      assert choice["key"] == key, (choice, key)  # the same choices, in the same order
      version = choice["version"]
    self.count += 1
    return version

  def paused(self) -> None:
    """(The first process) it serves a pause here: the others serve it at this choice."""
    self._choices.post(self.count, {"key": PAUSE, "version": 0})
    self.count += 1

  def _take(self, key: str) -> dict:
    n = self.count
    while True:
      if self.limit is not None and n >= self.limit:
        raise GroupClosed(f"the group's first process closed before choice {n} ({key})")
      try:
        return self._choices.take(n, poll_s=self._poll_s, timeout_s=self._poll_s)
      except TimeoutError:
        continue

  def told(self) -> bool:
    """The first process has made this process's next choice."""
    return self.leader or self._choices.has(self.count)

  def caught_up(self) -> bool:
    """This process has taken every choice the first one made (after `close`)."""
    return self.leader or (self.limit is not None and self.count >= self.limit)

  def close(self, worker) -> None:
    """Closes `worker` where the first process's closed."""
    if self.leader:
      try:
        worker.close()
      finally:
        self._closed.post(0, {"count": self.count})
    else:
      self.limit = self._closed.take(0)["count"]
      worker.close()
