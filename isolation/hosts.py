"""Objects that live in host processes the run can kill, called by message.

`ObjectHosts` spawns `workers` host processes, each limited as a pool's worker is (workers.py:
memory of its whole process tree, address space, file size, process count, output discarded).
In a host, `setup(*args)` (a module-level function, run there once, before the host's first
object: a user's class is imported there and nowhere else) returns a maker; `new()` makes an
object with it in one host, chosen in turn, and returns a `Hosted` handle whose `attributes`
are the values the object has under `attribute_names`. `Hosted.call(op, arg)` runs the object's
method `op` on `arg` there: what crosses is plain data (picklable), both ways.

A call that does not answer within `timeout_s` (the first on a new host also gets `start_s` for
the host's start) has its host killed, with its whole process group, and replaced: that call is
a `UserCodeTimeout`, and the other objects held there fail at their next call with
`HostRestarted`. A host that died is a `WorkerDied`; what the object's own code raised is an
`ObjectCallError` of one line. No Python thread is ever left running user code: a call that
holds the GIL (a regex backtracking in C) stalls only its host.
"""
from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable

from isolation.workers import UserCodeTimeout, WorkerDied, _limited, error_line, pool_limit


class HostRestarted(RuntimeError):
  """The host process that held an object was replaced (another call on it hung)."""


class ObjectCallError(RuntimeError):
  """What a hosted object's own code raised, as one line."""


def _host(conn, parent: int, setup: Callable, args: tuple, names: tuple[str, ...],
          limits: tuple) -> None:
  """A host's loop: ("new" | a method's name, key, argument) in, ("ok" | "error", value) out;
  ("drop", None, keys) forgets objects without a reply. It dies with the run's process."""
  import ctypes
  ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  if os.getppid() != parent:  # the run ended before that took hold
    return
  os.setsid()  # its process group: what the client kills
  host = os.getpid()
  _limited(*limits)
  objects, maker = {}, None
  while True:
    try:
      op, key, arg = conn.recv()
    except (EOFError, OSError):
      return
    if op == "drop":
      for k in arg:
        objects.pop(k, None)
      continue
    try:
      if op == "new":
        maker = maker or setup(*args)
        objects[key] = maker()
        out = tuple(getattr(objects[key], name) for name in names)
      else:
        out = getattr(objects[key], op)(arg)
      reply = ("ok", out)
    except Exception as e:  # noqa: BLE001 - user code: named in one line
      reply = ("error", error_line(e))
    if os.getpid() != host:  # a process the user's code forked never answers
      os._exit(1)
    try:
      conn.send(reply)
    except Exception as e:  # noqa: BLE001 - a return that cannot be pickled
      conn.send(("error", f"returned what cannot cross processes ({error_line(e)})"))


@dataclasses.dataclass
class _Host:
  process: multiprocessing.process.BaseProcess
  conn: object
  generation: int
  started: bool = False
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
  dropped: list = dataclasses.field(default_factory=list)


class ObjectHosts:
  """Host processes of the objects `setup(*args)`'s maker makes (module docstring). `what`
  names them in the line `log` is told (which limit holds for their process trees)."""

  def __init__(self, setup: Callable, args: tuple, *, attribute_names: tuple[str, ...] = (),
               workers: int, timeout_s: float, memory_gb: float = 4.0, file_mb: float = 64.0,
               processes: int = 64, start_s: float = 60.0, what: str = "hosted objects",
               log: Callable[[str], None] | None = None):
    self.timeout_s, self.start_s = timeout_s, start_s
    self.tree = pool_limit("hosts", workers, int(memory_gb * 2**30), processes, what, log)
    self.args = (setup, args, tuple(attribute_names),
                 (list(sys.path), int(memory_gb * 2**30), int(file_mb * 2**20), (), processes,
                  self.tree))
    self.ctx = multiprocessing.get_context("spawn")
    self.generations = itertools.count()
    self.keys = itertools.count()
    self.hosts = [self._start() for _ in range(workers)]

  def _start(self) -> _Host:
    mine, theirs = self.ctx.Pipe()
    process = self.ctx.Process(target=_host, args=(theirs, os.getpid(), *self.args),
                               daemon=True)
    process.start()
    theirs.close()
    return _Host(process, mine, next(self.generations))

  def _replace(self, index: int) -> None:
    _stop(self.hosts[index])
    self.hosts[index] = self._start()

  def call(self, index: int, generation: int, op: str, key: int, arg=None):
    """The host's answer to (op, key, arg); raises ObjectCallError, UserCodeTimeout, WorkerDied
    or HostRestarted."""
    host = self.hosts[index]
    with host.lock:
      if self.hosts[index] is not host or host.generation != generation:
        raise HostRestarted("its host process was replaced after another call there hung or "
                            "died")
      timeout = self.timeout_s + (0 if host.started else self.start_s)
      try:
        dropped = []
        while host.dropped:  # (pop: an object collected meanwhile waits for the next)
          dropped.append(host.dropped.pop())
        if dropped:
          host.conn.send(("drop", None, dropped))
        host.conn.send((op, key, arg))
        status, out = host.conn.recv() if host.conn.poll(timeout) else ("timeout", None)
      except (EOFError, OSError):
        status, out = "died", None
      except BaseException:  # an interrupt: its reply would answer the next call
        self._replace(index)
        raise
      host.started = True
      if status == "ok":
        return out
      if status == "error":
        raise ObjectCallError(out)
      code = host.process.exitcode
      self._replace(index)
      if status == "timeout":
        raise UserCodeTimeout(f"{op} did not return within {self.timeout_s:g} s (its host "
                              "process was killed)")
      raise WorkerDied(f"its host process ended during {op} (exit code {code})")

  def new(self) -> Hosted:
    """A new object, made in the next host in turn."""
    key = next(self.keys)
    index = key % len(self.hosts)
    generation = self.hosts[index].generation
    attributes = self.call(index, generation, "new", key)
    return Hosted(self, index, generation, key, attributes)

  def close(self) -> None:
    for host in self.hosts:
      _stop(host)
    self.tree.close()


def _stop(host: _Host) -> None:
  """The host and every process it started (its process group) killed."""
  try:
    os.killpg(host.process.pid, signal.SIGKILL)
  except OSError:  # already gone, or not yet its group's leader
    host.process.kill()
  host.process.join(5)
  host.conn.close()


class Hosted:
  """A handle on one object in a host; collected, it is dropped there at the host's next call."""

  def __init__(self, hosts: ObjectHosts, index: int, generation: int, key: int,
               attributes: tuple):
    self.hosts, self.index, self.generation, self.key = hosts, index, generation, key
    self.attributes = attributes

  def call(self, op: str, arg=None):
    return self.hosts.call(self.index, self.generation, op, self.key, arg)

  def __del__(self):
    host = self.hosts.hosts[self.index]
    if host.generation == self.generation:
      host.dropped.append(self.key)  # sent with the host's next call
