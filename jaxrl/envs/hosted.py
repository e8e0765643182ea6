"""A user's environments in host processes the run can kill.

`EnvHosts` spawns `workers` host processes, each limited as a reward worker is
(jaxrl/user_code.py: memory of its whole process tree, address space, file size, process
count, output discarded) and given the
run's tokenizer and the name of its verifier (rebuilt inside: built-in by name, a user's
function imported there). An environment lives in one host, chosen in turn, and is named by a
number; its `reset` and `step` are messages of plain data (token ids, the dataset row, a
`Step`). A call that does not answer within `timeout_s` (the first on a new host also gets
`start_s` for the host's start) has its host killed, with its whole process group, and
replaced: that call is a `UserCodeTimeout`, and the other conversations held there end at their
next call with `HostRestarted`. A host that died is a `WorkerDied`. No Python thread is ever
left running user code: a step that holds the GIL (a regex backtracking in C) stalls only its
host.
"""
from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from jaxrl.envs.base import Step
from jaxrl.user_code import UserCodeTimeout, WorkerDied, _limited, load_callable, pool_limit


class HostRestarted(RuntimeError):
  """The host process that held an environment was replaced (another call on it hung)."""


class EnvCallError(RuntimeError):
  """What an environment's own code raised, as one line."""


def host_verifier(spec: str) -> Callable[[str, str], float]:
  """In a host: the run's verifier by name, or the user's reward function `spec` called on one
  completion (its `answer` field the reference)."""
  if ":" not in spec:
    from jaxrl.rewards.verifier import VERIFIERS
    return VERIFIERS[spec]
  fn = load_callable(spec, "reward function", "module:function", ValueError)
  import numpy as np
  return lambda text, answer: float(np.asarray(fn([""], [text], answer=[answer]),
                                               np.float64).reshape(-1)[0])


def _host(conn, parent: int, spec: str, tok, verifier_spec: str, limits: tuple) -> None:
  """A host's loop: ("new" | "reset" | "step", key, argument) in, ("ok" | "error", value) out;
  ("drop", keys) forgets environments without a reply. It dies with the run's process."""
  import ctypes
  ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  if os.getppid() != parent:  # the run ended before that took hold
    return
  os.setsid()  # its process group: what the client kills
  host = os.getpid()
  _limited(*limits)
  from jaxrl.rewards.user import error_line
  envs, factory, verifier = {}, None, None
  while True:
    try:
      op, key, arg = conn.recv()
    except (EOFError, OSError):
      return
    if op == "drop":
      for k in arg:
        envs.pop(k, None)
      continue
    try:
      if op == "new":
        if factory is None:
          factory = load_callable(spec, "environment", "package.module:Class", ValueError)
          verifier = host_verifier(verifier_spec)
        envs[key] = factory(tok, verifier)
        out = tuple(envs[key].stop_strings)
      else:
        out = getattr(envs[key], op)(arg)
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


class EnvHosts:
  """Host processes of the environment class `spec` (module docstring)."""

  def __init__(self, spec: str, tok, verifier_spec: str, *, workers: int, timeout_s: float,
               memory_gb: float = 4.0, file_mb: float = 64.0, processes: int = 64,
               start_s: float = 60.0):
    self.spec, self.timeout_s, self.start_s = spec, timeout_s, start_s
    self.tree = pool_limit("env-hosts", workers, int(memory_gb * 2**30), processes,
                           "environment hosts")
    self.args = (spec, tok, verifier_spec,
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
    """The host's answer to (op, key, arg); raises EnvCallError, UserCodeTimeout, WorkerDied or
    HostRestarted."""
    host = self.hosts[index]
    with host.lock:
      if self.hosts[index] is not host or host.generation != generation:
        raise HostRestarted("its host process was replaced after another conversation there "
                            "hung or died")
      timeout = self.timeout_s + (0 if host.started else self.start_s)
      try:
        dropped = []
        while host.dropped:  # (pop: an environment collected meanwhile waits for the next)
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
        raise EnvCallError(out)
      code = host.process.exitcode
      self._replace(index)
      if status == "timeout":
        raise UserCodeTimeout(f"{op} did not return within {self.timeout_s:g} s (its host "
                              "process was killed)")
      raise WorkerDied(f"its host process ended during {op} (exit code {code})")

  def new(self) -> HostedEnvironment:
    key = next(self.keys)
    index = key % len(self.hosts)
    generation = self.hosts[index].generation
    stop_strings = self.call(index, generation, "new", key)
    return HostedEnvironment(self, index, generation, key, stop_strings)

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


class HostedEnvironment:
  """A handle on one environment in a host: the Environment protocol over messages."""

  def __init__(self, hosts: EnvHosts, index: int, generation: int, key: int,
               stop_strings: Sequence[str]):
    self.hosts, self.index, self.generation, self.key = hosts, index, generation, key
    self.stop_strings = tuple(stop_strings)

  def reset(self, example) -> list[int]:
    return self.hosts.call(self.index, self.generation, "reset", self.key, example)

  def step(self, turn_ids: list[int]) -> Step:
    return self.hosts.call(self.index, self.generation, "step", self.key, list(turn_ids))

  def __del__(self):
    host = self.hosts.hosts[self.index]
    if host.generation == self.generation:
      host.dropped.append(self.key)  # sent with the host's next call
