"""User code in worker processes the run can kill: a user's reward function runs in a pool of
spawned processes (pebble), each limited in memory (`memory_gb`: its address space, and every
process it starts with it, together: a cgroup per worker, or where none can be made no child
processes at all, isolation/process_limits.py), in the CPU seconds of one call and in the size of a
file it writes, with its stdout and stderr discarded. A call over
its time limit has its worker killed and replaced, whether or not the code ever yields the GIL
(a regex backtracking in C, `while True: pass`). What crosses the process boundary is plain
data: the function's "module:attribute" name, lists of strings and field values, the returned
rewards.

A thread could not do this: Python cannot stop a thread, and an abandoned one holding the GIL
stalls the run. A process costs a round trip per call (benchmarks/user_code.py measures it).
"""
from __future__ import annotations

import concurrent.futures
import importlib
import multiprocessing
import os
import resource
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import pebble

from isolation.process_limits import ProcessLimit, forbid_children, process_limit

_LOADED: dict[str, Callable] = {}  # per worker: the functions it has imported


def load_callable(spec: str, what: str, form: str, error: type[Exception]) -> Callable[..., Any]:
  """The callable `spec` names as "module:attribute"; anything wrong is an `error` whose one
  line names `what` and `spec`."""
  module_name, sep, attr = spec.partition(":")
  if not sep or not module_name or not attr:
    raise error(f"{what} {spec!r}: expected {form!r}")
  try:
    obj = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name and module_name.startswith(e.name):
      raise error(f"{what} {spec!r}: no module named {e.name!r}") from None
    raise error(f"{what} {spec!r}: importing {module_name!r} failed "
                f"({type(e).__name__}: {e})") from None
  except Exception as e:  # the module's own code failed at import
    message = (str(e).strip().splitlines() or [""])[0]
    raise error(f"{what} {spec!r}: importing {module_name!r} failed ({type(e).__name__}"
                f"{': ' + message if message else ''})") from None
  for part in attr.split("."):
    if not hasattr(obj, part):
      raise error(f"{what} {spec!r}: {module_name!r} has no attribute {attr!r}")
    obj = getattr(obj, part)
  if not callable(obj):
    raise error(f"{what} {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
  return obj


def _lower(limit: int, value: int) -> None:
  """The soft limit `limit` set to `value` (none: 0), within the inherited hard limit."""
  _, hard = resource.getrlimit(limit)
  if value > 0:
    resource.setrlimit(limit, (value if hard == resource.RLIM_INFINITY else min(value, hard),
                               hard))


def limit_processes(processes: int) -> None:
  """At most `processes` more processes (threads count) started by this one and its children.
  The kernel counts a real uid's processes and exempts root's, so a root worker takes a real
  uid of its own (60000 + its pid mod 5000; its effective uid stays root: files read as
  before) and drops, from every set, the two capabilities that also exempt it
  (CAP_SYS_RESOURCE, CAP_SYS_ADMIN; the bounding set too, so an exec does not get them back).
  A user's worker counts with all of that user's processes, which the run's own threads grow
  meanwhile, so its limit is those plus `processes` plus 256. (Where that uid does not exist in
  the user namespace or the capabilities cannot be dropped, root's worker has no limit.)"""
  import ctypes
  if os.getuid() != 0:
    _lower(resource.RLIMIT_NPROC, _tasks_of(os.getuid()) + processes + 256)
    return
  libc = ctypes.CDLL(None, use_errno=True)
  header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()
  keep = ~((1 << 21) | (1 << 24)) & 0xFFFFFFFF  # CAP_SYS_ADMIN, CAP_SYS_RESOURCE
  try:
    os.setresuid(60000 + os.getpid() % 5000, 0, 0)
  except OSError:
    return
  for cap in (21, 24):
    libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
  if libc.capget(header, data) != 0:
    return
  for i in (0, 1, 3, 4):  # effective and permitted, both 32-bit halves
    data[i] &= keep
  if libc.capset(header, data) == 0:
    _lower(resource.RLIMIT_NPROC, _tasks_of(os.getuid()) + processes)


def _tasks_of(uid: int) -> int:
  """How many tasks (threads) run as real uid `uid` now."""
  count = 0
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
      count += int(fields["Uid"].split()[0]) == uid and int(fields["Threads"])
    except (OSError, KeyError, ValueError):
      continue
  return count


def _limited(path: list[str], memory_bytes: int, file_bytes: int, preload: Sequence[str],
             processes: int = 64, tree: ProcessLimit | None = None) -> None:
  """A worker's start: the parent's import path, its limits, its output discarded, then the
  functions it will run imported (under those limits, before any call's clock starts; a
  failure shows at the call). `tree`: its pool's group, in which the worker takes one of its
  own (its processes' memory together at most `memory_bytes`); a budget: it starts no process
  (`forbid_children`), so its one address space is all it holds (`memory_bytes` 0: no limit,
  and children allowed)."""
  sys.path[:] = path
  if tree is not None and tree.dirs:
    tree.sub(f"worker-{os.getpid()}", memory_bytes, processes + WORKER_THREADS).join()
  elif tree is not None and memory_bytes:
    forbid_children()
  _lower(resource.RLIMIT_AS, memory_bytes)
  _lower(resource.RLIMIT_FSIZE, file_bytes)
  limit_processes(processes)
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)
  os.dup2(devnull, 2)
  for spec in preload:
    try:
      _loaded(spec)
    except ValueError:
      pass


WORKER_THREADS = 64  # a worker's own threads (pebble's, a BLAS's), besides its `processes`


def pool_limit(name: str, workers: int, memory_bytes: int, processes: int, what: str,
               log: Callable[[str], None] | None = None) -> ProcessLimit:
  """The group of a pool of `workers` (each of which takes one of its own inside: `_limited`)."""
  return process_limit(name, workers * memory_bytes, workers * (processes + WORKER_THREADS),
                       what, log)


def _cpu_limit(seconds: float) -> None:
  """This call's CPU seconds, all its threads together: the soft limit set to what the worker
  used so far plus `seconds` on every core (SIGXCPU ends the worker past it)."""
  usage = resource.getrusage(resource.RUSAGE_SELF)
  _lower(resource.RLIMIT_CPU,
         int(usage.ru_utime + usage.ru_stime + seconds * (os.cpu_count() or 1)) + 1)


def _loaded(spec: str) -> Callable:
  """In a worker: the function `spec` names, imported once."""
  if spec not in _LOADED:
    _LOADED[spec] = load_callable(spec, "user function", "module:attribute", ValueError)
  return _LOADED[spec]


def _run(spec: str, cpu_s: float, args: tuple, kwargs: dict):
  """In a worker: the named function called on plain data; an array result as a numpy array."""
  me = os.getpid()
  _cpu_limit(cpu_s)
  try:
    out = _loaded(spec)(*args, **kwargs)
  finally:
    if os.getpid() != me:  # a process the user's code forked never returns into the pool
      os._exit(1)
  if hasattr(out, "__array__") and not isinstance(out, (list, tuple)):
    import numpy as np
    out = np.asarray(out)
  return out


class UserCodeTimeout(TimeoutError):
  """A call of user code that did not return in time (its worker is killed)."""


class WorkerDied(RuntimeError):
  """A worker that ended during a call (a limit's signal, the OOM killer, a crash)."""


class UserCodePool:
  """`workers` spawned processes running named user functions with `timeout_s` per call (a
  call's clock starts once its worker has imported `preload`, the functions it will run;
  `start_s` more allows for a worker's start). `memory_gb` 0: no address-space limit. `log` is
  told which limit holds for the pool's processes (isolation/process_limits.py)."""

  def __init__(self, *, workers: int, timeout_s: float, memory_gb: float = 4.0,
               file_mb: float = 64.0, preload: Sequence[str] = (), start_s: float = 60.0,
               log: Callable[[str], None] | None = None):
    self.timeout_s, self.start_s = timeout_s, start_s
    self.tree = pool_limit("user-code", workers, int(memory_gb * 2**30), 64,
                           "reward function workers", log)
    limits = (list(sys.path), int(memory_gb * 2**30), int(file_mb * 2**20), tuple(preload), 64,
              self.tree)
    self.pool = pebble.ProcessPool(max_workers=workers, initializer=_limited, initargs=limits,
                                   context=multiprocessing.get_context("spawn"))
    self.workers = workers

  def submit(self, spec: str, *args, **kwargs) -> concurrent.futures.Future:
    return self.pool.schedule(_run, args=(spec, self.timeout_s, args, kwargs),
                              timeout=self.timeout_s)

  def results(self, futures: Sequence[concurrent.futures.Future], deadline: float | None = None
              ) -> list[tuple[Any, BaseException | None]]:
    """Each future's (result, None) or (None, what went wrong: UserCodeTimeout, WorkerDied or
    the user's exception); those not done by `deadline` (time.monotonic(); default: one call
    and a worker's start from now) are cancelled, their workers killed, and reported as
    timeouts."""
    deadline = deadline or time.monotonic() + self.timeout_s + self.start_s
    out = []
    for future in futures:
      try:
        error = future.exception(timeout=max(0.0, deadline - time.monotonic()))
      except concurrent.futures.TimeoutError:  # not done by the deadline
        started = future.running()
        future.cancel()
        error = UserCodeTimeout(f"did not return within {self.timeout_s:g} s" if started else
                                "not run: its round's time ran out while it waited")
      if isinstance(error, TimeoutError) and error.args[:1] == ("Task timeout",):  # pebble's
        error = UserCodeTimeout(f"did not return within {self.timeout_s:g} s")
      elif isinstance(error, pebble.ProcessExpired):
        error = WorkerDied(f"its worker process ended ({_ended(error.exitcode)})")
      out.append((None, error) if error is not None else (future.result(), None))
    return out

  def close(self) -> None:
    self.pool.stop()
    self.pool.join(timeout=10)
    self.tree.close()


def _ended(code: int | None) -> str:
  if code is not None and code < 0:
    name = {signal.SIGXCPU: "its CPU time limit", signal.SIGKILL: "killed"}.get(-code)
    return f"signal {-code}" + (f": {name}" if name else "")
  return f"exit code {code}"


def _imported(spec: str, what: str, form: str) -> None:
  """In a worker: `spec` imported (a ValueError naming what is wrong)."""
  load_callable(spec, what, form, ValueError)


def check_importable(spec: str, what: str, form: str, error: type[Exception], *,
                     timeout_s: float, memory_gb: float, start_s: float = 60.0,
                     log: Callable[[str], None] | None = None) -> None:
  """`spec` ("module:attribute") imported in a fresh worker under a pool's limits, within
  `timeout_s` of the worker's start (`start_s` more for the start itself), so that the
  process calling this never imports it: a module that is missing, raises, hangs, allocates
  past `memory_gb` or kills its worker is an `error` whose one line names `what` and `spec`."""
  checker = UserCodePool(workers=1, timeout_s=timeout_s, memory_gb=memory_gb, start_s=start_s,
                         log=log)
  try:
    future = checker.pool.schedule(_imported, args=(spec, what, form), timeout=timeout_s)
    [(_, problem)] = checker.results([future])
  finally:
    checker.close()
  if isinstance(problem, ValueError):  # load_callable's own line
    raise error(str(problem))
  if isinstance(problem, UserCodeTimeout):
    raise error(f"{what} {spec!r}: importing it did not finish within {timeout_s:g} s "
                "(rl.user_code.timeout_s)")
  if problem is not None:
    raise error(f"{what} {spec!r}: importing it failed ({problem})")


def error_line(e: BaseException) -> str:
  """`Type: first line of the message` (the type alone when it has none)."""
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
