"""The Python tool's sandbox (isolation/sandbox.py) contains what a model's program does:
each program here answers within about the time limit with a bounded reply naming what stopped
it, and the next program runs as usual. The sandbox lets these programs import `os` and
`socket` (and `time`): the import list is a convenience, the kernel's namespaces, uid and rlimits are the
boundary, and these tests check that boundary."""
import logging
import os
import time

import pytest

from jaxrl.data.tokenizer import ByteTokenizer
from jaxrl.envs import PythonTool
from isolation.sandbox import MODULES, CodeSandbox
from jaxrl.rewards.math import math_equal

FORK_BOMB = """import os
while True:
  try:
    os.fork()
  except OSError as e:
    print('fork:', e.strerror)
    break
"""
WRITES_GIGABYTES = """with open('big', 'wb') as f:
  for _ in range(4096):
    f.write(b'x' * 2**20)"""
MANY_FILES = """for i in range(4096):
  with open(f'f{i}', 'wb') as f:
    f.write(b'x' * (3 * 2**20))"""

CPU_OR_WALL = ("[killed: the CPU time limit, 1 s]", "[killed: the time limit]")  # (on a busy
# machine the program may not get its CPU second within the wall-clock limit)
HOLDS_THE_PIPE = """import os
if os.fork() == 0:
  r, w = os.pipe()
  os.read(r, 1)  # (it holds the output pipe, and would wait forever)
print('the parent is done')
"""
# Three children, each holding 300 MB for a second, 900 MB in all against the program's 512 MB:
# a cgroup kills inside the group past 512 MB, a budget gives each process 128 MB
FORKED_MEMORY = """import os, time
children = []
for _ in range(3):
  pid = os.fork()
  if pid == 0:
    try:
      held = bytearray(300 * 2**20)
      for i in range(0, len(held), 4096):
        held[i] = 1
    except MemoryError:
      os._exit(1)
    time.sleep(1)
    os._exit(0)
  children.append(pid)
ends = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
print('held at once:', ends.count(0) * 300, 'MB')
"""
# the program's own confinement: uid nobody when the run is root's, else root of a user
# namespace of its own (every capability dropped)
UID = 65534 if os.getuid() == 0 else 0

CASES = [  # program, what its reply contains (or one of those)
    ("import re\nprint(re.match(r'(\\d+)+$', '1' * 40 + 'x'))", CPU_OR_WALL),
    ("while True:\n  pass", CPU_OR_WALL),
    ("import ctypes", "module 'ctypes' is not available here"),
    ("x = bytearray(40 * 2**30)", "MemoryError"),
    (FORK_BOMB, "fork: Resource temporarily unavailable"),
    ("while True:\n  print('x' * 1000)", "bytes of output or more; cut]"),
    ("import socket\nsocket.socket().connect(('1.1.1.1', 443))", "Network is unreachable"),
    ("import socket\nsocket.socket().connect(('127.0.0.1', 22))", "Network is unreachable"),
    ("print(open('/etc/passwd').read())", "No such file or directory: '/etc/passwd'"),
    ("import os\nprint(os.listdir('/'), os.getuid())", f"[] {UID}"),
    (WRITES_GIGABYTES, "OSError: [Errno 27] File too large"),
    (MANY_FILES, "OSError: [Errno 28] No space left on device"),
    ("import subprocess", "module 'subprocess' is not available here"),
    ("import os\nprint(sorted(os.environ))", "['LANG', 'PATH']"),  # none of the run's secrets
    (HOLDS_THE_PIPE, "the parent is done"),
]


@pytest.fixture(scope="module")
def tool():
  sandbox = CodeSandbox(workers=1, timeout_s=3.0, cpu_s=1,
                        modules=MODULES + ("os", "socket", "time"))
  yield PythonTool(ByteTokenizer(), math_equal, sandbox=sandbox)
  sandbox.close()


def _within_the_limit(tool, t0: float) -> bool:
  """The program ended by its wall-clock limit at the latest (the sandbox's `timeout_s`, and
  the client's own wait past it for a server's answer, which a loaded machine may need)."""
  return time.monotonic() - t0 < tool.sandbox.timeout_s + 10


@pytest.mark.parametrize("program,reply", CASES, ids=[str(i) for i in range(len(CASES))])
def test_a_program_is_contained(tool, program, reply):
  t0 = time.monotonic()
  out = tool.run(program)
  assert any(r in out for r in ((reply,) if isinstance(reply, str) else reply)), out[-500:]
  assert len(out) < 9000 and _within_the_limit(tool, t0)
  assert tool.run("print(6 * 7)") == "42\n"  # and the next program runs as usual


def test_a_wall_clock_hang_is_killed(tool):
  t0 = time.monotonic()
  assert tool.run("import os\nr, w = os.pipe()\nos.read(r, 1)") == "[killed: the time limit]"
  assert time.monotonic() - t0 >= tool.sandbox.timeout_s and _within_the_limit(tool, t0)


def test_forked_children_share_the_programs_memory():
  """Three children of 300 MB against 512 MB: at most one holds its 300 MB at a time (a cgroup
  kills inside the group; a budget gives each process 128 MB). Its own sandbox, with time to
  spare: what it asserts is memory, and touching 900 MB on a loaded machine takes seconds."""
  sandbox = CodeSandbox(workers=1, timeout_s=30.0, cpu_s=20, modules=MODULES + ("os", "time"))
  try:
    out = sandbox.run(FORKED_MEMORY)["output"]
  finally:
    sandbox.close()
  assert "held at once: 0 MB" in out or "held at once: 300 MB" in out, out[-500:]


def test_a_programs_children_share_its_memory_limit_under_the_budget_too(monkeypatch, caplog):
  """Where no cgroup hierarchy is writable (here: none at the path looked at), the budget
  holds: the forked children's memory together stays under the program's limit; the log says
  which holds."""
  from isolation import process_limits
  monkeypatch.setattr(process_limits, "CGROUP", "/nonexistent")
  with caplog.at_level(logging.INFO, logger="jaxrl"):
    sandbox = CodeSandbox(workers=1, timeout_s=30.0, cpu_s=20, modules=MODULES + ("os", "time"))
  try:
    assert [s.tree.kind for s in sandbox.servers] == ["budget"]
    assert "code tool programs: memory and processes limited by no writable cgroup" in caplog.text
    assert "held at once: 0 MB" in sandbox.run(FORKED_MEMORY)["output"]
    assert sandbox.run("print(6 * 7)")["output"] == "42\n"
  finally:
    sandbox.close()


def test_groups_a_killed_run_left_are_removed(tmp_path):
  """`jaxrl-PID-...` groups of a process that is gone are removed beside a new one (a run
  killed before it closed its trees); a live process's stay."""
  from isolation.process_limits import _remove_stale
  gone, live = tmp_path / "jaxrl-999999999-0-code", tmp_path / f"jaxrl-{os.getpid()}-0-code"
  gone.mkdir()
  live.mkdir()
  _remove_stale((str(tmp_path / "jaxrl-1-1-new"),))
  assert not gone.exists() and live.exists()
