"""Limits that hold for a whole process tree: the memory and the process count of everything a
sandboxed program, a reward worker or an environment host starts, together.

Per-process rlimits do not add up: a program under a 512 MB address-space limit that forks 31
children holds 32 x 512 MB. A control group does add up, as container runtimes and sandboxes
(nsjail, bubblewrap under systemd) use it: the kernel charges every process of the group, and
past `memory` it reclaims and then kills inside the group, never outside it.

`process_limit` makes one under the calling process's own group (so any limit above still
applies), in the first hierarchy that lets it:

- cgroup v2 (`memory.max`, `memory.swap.max` 0, `pids.max`), where the unified hierarchy has
  the memory and pids controllers delegated to this process's group;
- cgroup v1 (`memory.limit_in_bytes`, `memory.memsw.limit_in_bytes` where swap is accounted,
  `pids.max`), where those hierarchies are mounted and writable (root, most containers);
- otherwise a budget, which the caller enforces by construction with rlimits: at most
  `BUDGET_PROCESSES` processes, each limited to memory / BUDGET_PROCESSES (the sandbox), or no
  child processes at all (`forbid_children`: a worker keeps its whole limit).

`ProcessLimit.kind` says which is in force, and the `log` its maker is given says it (a run's
`UserProcesses` says each kind once).
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable

CGROUP = "/sys/fs/cgroup"
BUDGET_PROCESSES = 4


@dataclasses.dataclass(frozen=True)
class ProcessLimit:
  """A group's directories (one for v2; the memory and pids ones for v1), or none: a budget."""
  kind: str  # "cgroup v2" | "cgroup v1" | "budget"
  dirs: tuple[str, ...] = ()

  @property
  def procs(self) -> list[str]:
    """The files a process writes "0" to, to enter the group (stdlib callers: the sandbox)."""
    return [os.path.join(d, "cgroup.procs") for d in self.dirs]

  def join(self) -> None:
    """The calling process enters the group (its children after this are in it too)."""
    for path in self.procs:
      with open(path, "w") as f:
        f.write("0")

  def sub(self, name: str, memory_bytes: int, processes: int) -> ProcessLimit:
    """A group of its own inside this one (a pool's worker), with its own limits."""
    if not self.dirs:
      return self
    if self.kind == "cgroup v2":  # (this group then holds groups, never a process)
      _write(self.dirs[0], "cgroup.subtree_control", "+memory +pids")
    dirs = tuple(os.path.join(d, name) for d in self.dirs)
    _create(self.kind, dirs, memory_bytes, processes)
    return ProcessLimit(self.kind, dirs)

  def close(self) -> None:
    """Whatever still runs in the group (and its subgroups) killed, the groups removed."""
    for d in self.dirs:
      _remove(d)


def _own(controller: str) -> str | None:
  """This process's group in `controller`'s hierarchy ("" for v2's unified one)."""
  with open("/proc/self/cgroup") as f:
    for line in f:
      _, names, path = line.rstrip("\n").split(":", 2)
      if names.split(",") == [controller] or (controller == "" and names == ""):
        return path
  return None


def _write(directory: str, name: str, value) -> None:
  with open(os.path.join(directory, name), "w") as f:
    f.write(str(value))


def _create(kind: str, dirs: tuple[str, ...], memory_bytes: int, processes: int) -> None:
  """The groups `dirs` made with their limits (`memory_bytes` 0: none); removed on a failure."""
  try:
    for d in dirs:
      os.makedirs(d, exist_ok=True)
    for d in dirs:  # (the kernel makes a group's files: a plain directory is none)
      if not os.path.exists(os.path.join(d, "cgroup.procs")):
        raise OSError(f"{d} is not a cgroup")
    if kind == "cgroup v2":
      _write(dirs[0], "memory.max", memory_bytes or "max")
      if os.path.exists(os.path.join(dirs[0], "memory.swap.max")):  # (swap accounted)
        _write(dirs[0], "memory.swap.max", 0)
      _write(dirs[0], "pids.max", processes)
      return
    memory, pids = dirs
    _write(memory, "memory.limit_in_bytes", memory_bytes or -1)
    if os.path.exists(os.path.join(memory, "memory.memsw.limit_in_bytes")):
      _write(memory, "memory.memsw.limit_in_bytes", memory_bytes or -1)  # no swap past it
    _write(pids, "pids.max", processes)
  except OSError:
    for d in dirs:
      _remove(d)
    raise


def _v2_dirs(name: str) -> tuple[str, ...]:
  own = _own("")
  parent = os.path.join(CGROUP, (own or "").lstrip("/"))
  with open(os.path.join(parent, "cgroup.subtree_control")) as f:
    if not {"memory", "pids"} <= set(f.read().split()):
      raise OSError("memory and pids are not delegated to this process's cgroup")
  return (os.path.join(parent, name),)


def _v1_dirs(name: str) -> tuple[str, ...]:
  dirs = []
  for controller in ("memory", "pids"):
    own = _own(controller)
    if own is None:
      raise OSError(f"no cgroup v1 {controller} hierarchy")
    dirs.append(os.path.join(CGROUP, controller, own.lstrip("/"), name))
  return tuple(dirs)


def process_limit(name: str, memory_bytes: int, processes: int, what: str,
                  log: Callable[[str], None] | None = None) -> ProcessLimit:
  """A group `name` limited to `memory_bytes` and `processes` tasks (threads count), or the
  budget where no cgroup hierarchy lets this process make one. `log` (default: the jaxrl
  logger's info) is told which holds, as a line naming `what`, the tree it limits."""
  name = f"jaxrl-{os.getpid()}-{secrets.token_hex(4)}-{name}"  # unique: two groups never share
  for kind, dirs_of in (("cgroup v2", _v2_dirs), ("cgroup v1", _v1_dirs)):
    try:
      dirs = dirs_of(name)
      _remove_stale(dirs)
      _create(kind, dirs, memory_bytes, processes)
    except (OSError, ValueError):
      continue
    (log or logging.getLogger("jaxrl").info)(holds(kind, what))
    return ProcessLimit(kind, dirs)
  (log or logging.getLogger("jaxrl").info)(holds("budget", what))
  return ProcessLimit("budget")


def holds(kind: str, what: str) -> str:
  """The log line that says which limit holds for `what`."""
  how = {"cgroup v2": "a cgroup v2 (memory.max, memory.swap.max, pids.max) per tree",
         "cgroup v1": "a cgroup v1 (memory.limit_in_bytes, pids.max) per tree",
         "budget": "no writable cgroup hierarchy: a budget of rlimits that holds by "
                   "construction (processes x memory at most the limit)"}[kind]
  return f"{what}: memory and processes limited by {how}"


def _remove_stale(dirs: tuple[str, ...]) -> None:
  """The groups a killed run left beside `dirs` (`jaxrl-PID-...` of a process that is gone)."""
  for parent in {os.path.dirname(d) for d in dirs}:
    for entry in os.listdir(parent):
      pid = entry.split("-")[1] if entry.startswith("jaxrl-") else ""
      if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
        _remove(os.path.join(parent, entry))


def _remove(directory: str) -> None:
  """Kills the group's processes, depth first, and removes its directories (a killed process
  leaves its group when the kernel has reaped it: a few tries)."""
  if not os.path.isdir(directory):
    return
  for entry in os.scandir(directory):
    if entry.is_dir(follow_symlinks=False):
      _remove(entry.path)
  for attempt in range(50):
    try:
      with open(os.path.join(directory, "cgroup.procs")) as f:
        pids = [int(p) for p in f.read().split()]
    except OSError:
      pids = []
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    try:
      os.rmdir(directory)
      return
    except OSError:
      time.sleep(0.02 * (attempt + 1))


def forbid_children() -> None:
  """The calling process and its threads may start no process (fork, vfork, clone without
  CLONE_THREAD, clone3: EAGAIN / ENOSYS), by a seccomp filter, which holds for good (no new
  privileges, inherited by threads): a worker's budget, when no cgroup holds its tree. Threads
  still start (glibc's pthread_create: clone with CLONE_THREAD)."""
  # x86-64 and aarch64 system call numbers
  machine = os.uname().machine
  nr = {"x86_64": {"clone": 56, "fork": 57, "vfork": 58, "clone3": 435},
        "aarch64": {"clone": 220, "clone3": 435}}.get(machine)
  if nr is None:
    raise OSError(f"forbid_children: no system call table for {machine}")
  arch = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[machine]
  errno_eagain, errno_enosys, allow = 0x00050000 | 11, 0x00050000 | 38, 0x7FFF0000
  ld_w_abs, jeq_k, jset_k, ret_k = 0x20, 0x15, 0x45, 0x06
  code = [(ld_w_abs, 0, 0, 4), (jeq_k, 1, 0, arch), (ret_k, 0, 0, allow),  # another ABI: allow
          (ld_w_abs, 0, 0, 0)]  # the system call's number
  if machine == "x86_64":  # the x32 ABI's numbers (bit 30): none allowed
    code += [(0x35, 0, 1, 0x40000000), (ret_k, 0, 0, errno_enosys)]
  rules = [(nr["clone3"], errno_enosys)]  # glibc falls back to clone
  rules += [(nr[n], errno_eagain) for n in ("fork", "vfork") if n in nr]
  for number, action in rules:
    code += [(jeq_k, 0, 1, number), (ret_k, 0, 0, action)]
  code += [(jeq_k, 0, 3, nr["clone"]), (ld_w_abs, 0, 0, 16),  # clone's flags (low word)
           (jset_k, 1, 0, 0x00010000), (ret_k, 0, 0, errno_eagain),  # CLONE_THREAD unset
           (ret_k, 0, 0, allow)]

  class Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]

  class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

  filters = (Filter * len(code))(*[Filter(*c) for c in code])
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
  program = Program(len(code), filters)
  # seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC): every thread of the process
  if libc.syscall({"x86_64": 317, "aarch64": 277}[machine], 1, 1, ctypes.byref(program)) != 0:
    raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_SET_MODE_FILTER)")
