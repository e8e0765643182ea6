"""`UserProcesses`: a run's processes beside its models: the worker pool of its reward function,
the host processes of its environment (`rl.verifier`, `rl.environment.name` as
"package.module:name") and its code sandbox (the python tool's), each started for its run and
stopped by `close`. Two runs in one process never share one."""
from __future__ import annotations

import logging
import threading
import weakref

from isolation.sandbox import CodeSandbox
from isolation.workers import UserCodePool
from jaxrl.config_rl import UserCodeConfig
from jaxrl.data.tokenizer import Tokenizer
from jaxrl.envs.hosted import EnvHosts

log = logging.getLogger("jaxrl")


class UserProcesses:
  """What a run started in processes of its own, stopped by `close` (or, failing that, when
  this object is collected or the process exits). Which limit holds for each kind of process
  tree (isolation/process_limits.py) is logged once per run."""

  def __init__(self):
    self._lock = threading.Lock()
    self._started: list = []  # what `close` stops (each has its own close())
    # (what the processes are told to log holds no reference back to this object, so that it
    # can still be collected, and its finalizer stop them)
    self.say = _Once().say
    self._sandbox: CodeSandbox | None = None
    self._sandbox_lock = threading.Lock()
    self._closer = weakref.finalize(self, _close_all, self._started, self._lock)

  def pool(self, limits: UserCodeConfig, spec: str) -> UserCodePool:
    """Worker processes running the function `spec` under `limits` (`rl.user_code`)."""
    return self._own(UserCodePool(workers=limits.workers, timeout_s=limits.timeout_s,
                                  memory_gb=limits.memory_gb, preload=(spec,), log=self.say))

  def hosts(self, limits: UserCodeConfig, spec: str, tok: Tokenizer, verifier: str,
            options: dict | None = None) -> EnvHosts:
    """Host processes of the environment class `spec` under `limits`, for tokenizer `tok` (and
    the run's `verifier` and what the class declares of `options`, `rl.environment`'s fields,
    which it is constructed with)."""
    return self._own(EnvHosts(spec, tok, verifier, options, workers=limits.workers,
                              timeout_s=limits.timeout_s, memory_gb=limits.memory_gb,
                              log=self.say))

  def sandbox(self) -> CodeSandbox:
    """The run's code sandbox (2 servers), started at the first call; its conversations share
    it."""
    with self._sandbox_lock:
      if self.closed:
        raise RuntimeError("the run's user-code processes are closed")
      if self._sandbox is None:
        self._sandbox = self._own(CodeSandbox(workers=2, log=self.say))
      return self._sandbox

  def _own(self, started):
    with self._lock:
      if self._closer.alive:
        self._started.append(started)
        return started
    started.close()
    raise RuntimeError("the run's user-code processes are closed")

  @property
  def closed(self) -> bool:
    return not self._closer.alive

  def close(self) -> None:
    """Stops every process started here (once; later calls do nothing)."""
    self._closer()

  def __enter__(self) -> UserProcesses:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class _Once:
  """Logs each line the first time it is told it (which limit holds, once per kind of tree)."""

  def __init__(self):
    self._said: set[str] = set()
    self._lock = threading.Lock()

  def say(self, line: str) -> None:
    with self._lock:
      if line in self._said:
        return
      self._said.add(line)
    log.info("%s", line)


def _close_all(started: list, lock: threading.Lock) -> None:
  with lock:
    stopping = list(started)
    started.clear()
  for each in stopping:
    each.close()
