"""Python programs a model writes, run in a sandbox: the code tool's engine.

A sandbox server (this file run by `sys.executable -I`, one per worker) starts once: it enters
a new network namespace (no interface is up: no address is reachable, the host's localhost
included), a new mount namespace with a `disk_mb` tmpfs as its scratch space, and a new PID
namespace, whose first process (its "init") imports the allowed modules and tells the client
it is ready. Then, per program, the init forks it (a warm interpreter: milliseconds a program,
not the ~50 ms of a fresh python):

- the program's root is an empty directory of the scratch tmpfs (chroot), removed after the
  run; it runs as uid/gid `nobody`, so it cannot leave that root, and the kernel's process-count
  limit (`processes`) binds (a fork bomb fails at it);
- the program and every process it starts share one memory limit (`memory_mb`, no swap) and
  one process count (`processes`, threads count): a cgroup per server (process_limits.py),
  where the kernel kills inside the group past it; where no cgroup hierarchy is writable, a
  budget: at most `BUDGET_PROCESSES` processes of `memory_mb` / that address space each;
- rlimits: CPU seconds (`cpu_s`: SIGXCPU, then SIGKILL a second later), address space
  (`memory_mb` per process), file size (`file_mb`), open files; the whole scratch space is
  `disk_mb`;
- stdout and stderr go to a pipe the init reads up to `output_bytes` and then closes (a
  program printing a gigabyte stops at its next write); the program is killed at `timeout_s`
  of wall-clock time;
- after each program the init kills every other process in the namespace (`kill(-1)` from PID
  1), so nothing the program started outlives it;
- `import` finds only the modules the server imported (`modules`); that list is a convenience
  for the model, not the boundary: the boundary is the kernel's (namespaces, uid, rlimits).

It needs root or unprivileged user namespaces (Linux); where the kernel refuses them, the
server says so and `CodeSandbox` raises `SandboxUnavailable` with the kernel's reason: nothing
runs unisolated.
"""
from __future__ import annotations

import ctypes
import functools
import json
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

if __name__ != "__main__":  # (the server runs this file alone: the standard library only)
  from isolation.process_limits import BUDGET_PROCESSES, process_limit

MODULES = ("math", "cmath", "fractions", "decimal", "statistics", "itertools", "functools",
           "collections", "heapq", "bisect", "re", "string", "random", "datetime", "json",
           "operator", "typing", "dataclasses", "copy", "textwrap", "array", "numbers")
_NEWNS, _NEWNET, _NEWPID, _NEWUSER, _NEWIPC = (0x20000, 0x40000000, 0x20000000, 0x10000000,
                                               0x08000000)
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
_NOBODY = 65534


class SandboxUnavailable(RuntimeError):
  """The kernel refuses the sandbox's namespaces (one line: its reason)."""


@functools.cache
def _libc():
  return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
  if rc != 0:
    raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def _enter_namespaces(scratch: str, disk_mb: int) -> None:
  """The server's isolation, once: no network, a private mount table, the scratch tmpfs."""
  libc, uid, gid = _libc(), os.getuid(), os.getgid()
  if uid != 0:  # unprivileged: a user namespace where this user is root
    _check(libc.unshare(_NEWUSER), "unshare(user namespace)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                       ("gid_map", f"0 {gid} 1")):
      with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
  _check(libc.unshare(_NEWNS | _NEWNET), "unshare(mount and network namespaces)")
  _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
  _check(libc.mount(b"tmpfs", scratch.encode(), b"tmpfs", 0,
                    f"size={disk_mb}m,mode=755".encode()), "mount tmpfs")


def _restricted_import(allowed: frozenset[str]):
  """`__import__` for the program: the modules in `allowed` the server imported, nothing else."""
  original = __import__

  def imported(name, globals=None, locals=None, fromlist=(), level=0):
    if level or name.partition(".")[0] not in allowed or name not in sys.modules:
      raise ImportError(f"module {name!r} is not available here (allowed: "
                        f"{', '.join(sorted(allowed))})")
    return original(name, globals, locals, fromlist, level)
  return imported


def _program(code: str, root: str, limits: dict, allowed: frozenset[str], out_fd: int) -> None:
  """The program's process: confined, limited, run; never returns."""
  import builtins
  import resource
  import traceback
  try:
    _libc().prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with the namespace's init
    for path in limits["cgroup_procs"]:  # its tree's memory and process count (a cgroup)
      with open(path, "w") as f:
        f.write("0")
    null = os.open(os.devnull, os.O_RDONLY)
    # In a user namespace (Linux 5.14 on) the kernel counts the namespace's tasks: the
    # server's and its init's besides the program's
    tasks = 2 if limits["user_namespace"] else 0
    _check(_libc().unshare(_NEWIPC), "unshare(IPC namespace)")  # its shared memory dies with it
    os.chroot(root)
    os.chdir("/")
    if limits["user_namespace"]:  # root of its own namespace only: every capability dropped
      _drop_capabilities()
    else:
      os.setgroups([])
      os.setgid(_NOBODY)
      os.setuid(_NOBODY)
    processes, memory_mb = limits["processes"], limits["memory_mb"]
    if not limits["cgroup_procs"]:  # the budget: processes x address space <= memory_mb
      processes = min(processes, limits["budget_processes"])
      memory_mb //= processes
    processes += tasks
    for limit, soft, hard in ((resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1),
                              (resource.RLIMIT_AS, memory_mb << 20, None),
                              (resource.RLIMIT_FSIZE, limits["file_mb"] << 20, None),
                              (resource.RLIMIT_NPROC, processes, None),
                              (resource.RLIMIT_NOFILE, 64, None), (resource.RLIMIT_CORE, 0, None)):
      resource.setrlimit(limit, (soft, soft if hard is None else hard))  # SIGXCPU at the soft
    signal.signal(signal.SIGXCPU, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file limit fails
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    builtins.__import__ = _restricted_import(allowed)
  except BaseException as e:  # noqa: BLE001 - the confinement failed: run nothing
    os.write(out_fd, f"sandbox setup failed: {e}".encode())
    os._exit(125)
  code_rc = 0
  try:
    exec(compile(code, "<program>", "exec"), {"__name__": "__main__"})  # noqa: S102
  except SystemExit as e:
    code_rc = e.code if isinstance(e.code, int) else 1
  except BaseException as e:  # noqa: BLE001 - the program's own error, shown to the model
    traceback.print_exception(type(e), e, e.__traceback__.tb_next, limit=-4)
    code_rc = 1
  try:
    sys.stdout.flush()
    sys.stderr.flush()
  finally:
    os._exit(code_rc)


def _drop_capabilities() -> None:
  """capset(2) with empty sets, and no new privileges through exec."""
  libc = _libc()
  header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
  data = (ctypes.c_uint32 * 6)()
  _check(libc.capset(header, data), "capset")
  _check(libc.prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def _collect(pid: int, out_r: int, output_bytes: int, timeout_s: float) -> dict:
  """The program's output (up to `output_bytes`, then the pipe is closed) and how it ended
  (killed at `timeout_s`): waits on the pipe and on the program's pidfd, no polling. When the
  program ends, whatever it started is killed (PID 1's `kill(-1)`), so the drain ends."""
  deadline, chunks, size, status, cpu_s = time.monotonic() + timeout_s, [], 0, "timeout", 0.0
  pidfd, reading = os.pidfd_open(pid), True
  try:
    while (left := deadline - time.monotonic()) > 0:
      ready = select.select([pidfd] + [out_r] * reading, [], [], left)[0]
      if pidfd in ready:
        _, wait_status, usage = os.wait4(pid, 0)
        status, cpu_s = os.waitstatus_to_exitcode(wait_status), usage.ru_utime + usage.ru_stime
        status = 128 - status if status < 0 else status  # a signal, as a shell reports it
        _kill_all()
      while reading and (out_r in ready or pidfd in ready):  # (after the exit: what is left)
        chunk = os.read(out_r, 65536)
        chunks.append(chunk)
        size += len(chunk)
        reading = bool(chunk) and size <= output_bytes
        if not reading:  # past the limit: the program's next write fails (EPIPE)
          os.close(out_r)
        if pidfd not in ready:
          break
      if pidfd in ready:
        break
    else:
      _kill_all()
  finally:
    os.close(pidfd)
    if reading:
      os.close(out_r)
  return {"output": b"".join(chunks)[:output_bytes].decode("utf-8", "replace"),
          "output_bytes": size, "status": status, "cpu_s": cpu_s}


def _kill_all() -> None:
  """Every other process of the namespace killed (from its PID 1)."""
  try:
    os.kill(-1, signal.SIGKILL)
  except ProcessLookupError:  # none left
    pass


def _serve(config: dict) -> None:
  """The server: namespaces entered, then its child, the first process of a new PID namespace,
  imports the modules and runs one program per request line."""
  try:
    _enter_namespaces(config["scratch"], config["disk_mb"])
    _check(_libc().unshare(_NEWPID), "unshare(PID namespace)")
    os.close(os.pidfd_open(os.getpid()))  # (Linux 5.3 on)
  except (OSError, AttributeError) as e:
    print(json.dumps({"ready": False, "reason": str(e)}), flush=True)
    return
  pid = os.fork()
  if pid == 0:
    _libc().prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: it dies with the server
    _init(config)
    os._exit(0)
  _, status = os.waitpid(pid, 0)
  sys.exit(os.waitstatus_to_exitcode(status))


def _init(config: dict) -> None:
  """PID 1 of the namespace: forks each program (PID 2 on: a signal acts on it as usual), and
  after it kills whatever else runs in the namespace (`kill(-1)` from PID 1) and reaps it."""
  import importlib
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # a program of the same uid may signal PID 1
  for name in config["modules"]:
    importlib.import_module(name)
  limits = {**config["limits"], "user_namespace": config["launched_uid"] != 0}
  allowed = frozenset(config["modules"])
  channel = sys.stdout
  sys.stdout = sys.stderr  # nothing else writes to the channel
  print(json.dumps({"ready": True}), file=channel, flush=True)
  for n, line in enumerate(sys.stdin):
    root = os.path.join(config["scratch"], str(n))
    os.mkdir(root)
    if not limits["user_namespace"]:
      os.chown(root, _NOBODY, _NOBODY)
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:
      os.close(out_r)
      _program(json.loads(line), root, limits, allowed, out_w)
    os.close(out_w)
    result = _collect(pid, out_r, config["output_bytes"], config["timeout_s"])
    _clear()
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result), file=channel, flush=True)


def _clear() -> None:
  """Every other process of the namespace killed and reaped (PID 1 only)."""
  _kill_all()
  while True:
    try:
      os.waitpid(-1, 0)
    except ChildProcessError:
      return


class CodeSandbox:
  """`workers` sandbox servers (module docstring); `run(code)` takes a free one (threads may
  call it at once) and returns {"output": str, "output_bytes": int, "status": exit code or
  "timeout", "cpu_s": CPU seconds used}; a server that does not answer within `timeout_s` +
  10 s is killed and replaced. `log` is told which limit holds for the programs' process trees
  (process_limits.py)."""

  def __init__(self, *, workers: int = 2, timeout_s: float = 2.0, cpu_s: int = 1,
               memory_mb: int = 512, file_mb: int = 4, disk_mb: int = 16, processes: int = 32,
               output_bytes: int = 8192, modules: tuple[str, ...] = MODULES,
               log: Callable[[str], None] | None = None):
    self.timeout_s, self.log = timeout_s, log
    self.config = {"disk_mb": disk_mb, "modules": list(modules), "timeout_s": timeout_s,
                   "output_bytes": output_bytes, "launched_uid": os.getuid(),
                   "limits": {"cpu_s": cpu_s, "memory_mb": memory_mb, "file_mb": file_mb,
                              "processes": processes}}
    self.free: queue.Queue = queue.Queue()
    self.servers = []
    for _ in range(workers):
      self.free.put(self._start())

  def _start(self) -> subprocess.Popen:
    scratch = tempfile.mkdtemp(prefix="jaxrl-code-")
    limits = self.config["limits"]
    tree = process_limit("code", limits["memory_mb"] << 20, limits["processes"],
                         "code tool programs", self.log)
    config = {**self.config, "scratch": scratch,
              "limits": {**limits, "cgroup_procs": tree.procs,
                         "budget_processes": BUDGET_PROCESSES}}
    try:
      server = subprocess.Popen(
          [sys.executable, "-I", os.path.abspath(__file__), json.dumps(config)],
          # (stdlib only: no package import)
          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
          env={"PATH": os.defpath, "LANG": "C.UTF-8"})  # none of the run's variables (secrets)
    except BaseException:
      tree.close()
      shutil.rmtree(scratch, ignore_errors=True)
      raise
    server.scratch, server.tree = scratch, tree
    self.servers.append(server)
    ready = select.select([server.stdout], [], [], 60)[0]
    hello = json.loads((server.stdout.readline() if ready else "") or
                       '{"ready": false, "reason": "it did not start"}')
    if not hello["ready"]:
      self._stop(server)
      raise SandboxUnavailable(f"the code sandbox needs Linux namespaces (root or "
                               f"unprivileged user namespaces): {hello['reason']}")
    return server

  def run(self, code: str) -> dict:
    server = self.free.get()  # None: a slot whose server must be started
    try:
      server = server or self._start()
      server.stdin.write(json.dumps(code) + "\n")
      ready = select.select([server.stdout], [], [], self.timeout_s + 10)[0]
      line, failure = server.stdout.readline() if ready else "", "no answer"
    except Exception as e:  # noqa: BLE001 - a server that died or would not start
      line, failure = "", (str(e).splitlines() or [type(e).__name__])[0]
    except BaseException:  # an interrupt: the server's state is unknown
      if server:
        self._stop(server)
      self.free.put(None)
      raise
    if line:
      self.free.put(server)
      return json.loads(line)
    if server:
      self._stop(server)
    self.free.put(None)
    return {"output": "", "output_bytes": 0, "cpu_s": 0.0,
            "status": f"sandbox server failed: {failure}"}

  def _stop(self, server: subprocess.Popen) -> None:
    server.kill()  # (its init dies with it: PR_SET_PDEATHSIG; the namespace with its init)
    server.wait()
    server.tree.close()
    shutil.rmtree(server.scratch, ignore_errors=True)
    if server in self.servers:
      self.servers.remove(server)

  def close(self) -> None:
    for server in list(self.servers):
      self._stop(server)


if __name__ == "__main__":
  _serve(json.loads(sys.argv[1]))
