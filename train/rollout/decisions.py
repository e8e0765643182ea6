"""Choices made once for a group of processes that run one worker on one mesh (a generator on
several processes, train/rollout/remote.py): the group's first process makes each choice that
timing decides (which weights a batch or segment decodes with, when a batch opens) and posts it
in the coordination service's key-value store; the others take them in order."""
from __future__ import annotations

from sharding import crossing
from train.rollout.worker import GroupClosed


class Decisions:
  """A worker's `decide` where several processes run it on one mesh: the group's first process
  posts its choices in order (`__call__` returns its own), the others take them. Closing is the
  first process's choice too: it stops its worker, then posts how many choices it made; the
  others run on to that count (through the same device programs) and stop there."""

  def __init__(self, name: str, leader: bool, *, made=crossing.Mailbox, poll_s: float = 0.5):
    """`made(name)`: the mailbox kind (a test's in-memory one)."""
    self.leader, self.count, self.limit, self._poll_s = leader, 0, None, poll_s
    self._choices, self._closed = made(f"{name}/decide"), made(f"{name}/closed")

  def __call__(self, key: str, version: int) -> int:
    n = self.count
    if self.leader:
      self._choices.post(n, {"key": key, "version": version})
    else:
      while True:
        if self.limit is not None and n >= self.limit:
          raise GroupClosed(f"the group's first process closed before choice {n} ({key})")
        try:
          choice = self._choices.take(n, poll_s=self._poll_s, timeout_s=self._poll_s)
          break
        except TimeoutError:
          continue
      assert choice["key"] == key, (choice, key)  # the same choices, in the same order
      version = choice["version"]
    self.count = n + 1
    return version

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
