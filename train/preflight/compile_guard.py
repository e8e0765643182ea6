"""`--dry_run --target` in a child process: libtpu's compiler stops its process outright when
one of its own checks fails (a CHECK failure is an abort, not an exception: seen compiling
Qwen2.5-7B's programs for a v5p-16), which no `except` can turn into jaxrl's one-line error.
The parent passes the child's report through, keeps its log, and when the child dies of a
signal names the program being compiled and the compiler's failed check in one line (exit 2,
as for a program the compiler refuses)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading

CHILD = "JAXRL_TARGET_COMPILE_CHILD"  # set in the child: it compiles
PROGRESS = "jaxrl: dry run: compiling "


def _forward(stream, out, log, state) -> None:
  for line in stream:
    log.write(line)
    if line.startswith(PROGRESS):
      state["program"] = line[len(PROGRESS):].strip()
    if line.startswith("jaxrl:"):
      # (an error it names, or the verdict: exit 1 is "does not fit")
      state["reported"] |= line.startswith(("jaxrl: error:", "jaxrl: dry run: verdict"))
      out.write(line)
      out.flush()
    elif state["failed"] is None and (m := re.match(r"F\d{4} .*?\] (.*)", line)):
      state["failed"] = m.group(1).strip()
    elif re.match(r"\w+(\.\w+)*(Error|Exception|Exit|Interrupt)\b", line):
      state["raised"] = line.strip()  # an exception's last line (after a traceback's frames)


def run(command: list[str]) -> int:
  """Runs `command` (the same command line, which compiles in the child) with the child mark;
  its exit code, or 2 with one line when it dies of a signal."""
  env = {**os.environ, CHILD: "1"}
  child = subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
  state = {"program": None, "failed": None, "reported": False, "raised": None}
  log = tempfile.NamedTemporaryFile("w", prefix="jaxrl-target-compile-", suffix=".log",
                                    delete=False)
  with log:
    threads = [threading.Thread(target=_forward, args=(s, o, log, state), daemon=True)
               for s, o in ((child.stdout, sys.stdout), (child.stderr, sys.stderr))]
    for t in threads:
      t.start()
    code = child.wait()
    for t in threads:
      t.join()
  if code == 0 or (code > 0 and state["reported"]):
    os.unlink(log.name)
    return code
  where = f"compiling {state['program']}" if state["program"] else "before any program"
  if code > 0:  # jaxrl's own failure in the child, not reported: named, not swallowed
    raised = state["raised"] or f"an error (exit code {code})"
    print(f"jaxrl: error: --target: the compile's process raised {raised} {where} (its log "
          f"is {log.name})", file=sys.stderr, flush=True)
    return code
  name = signal.Signals(-code).name
  check = f": {state['failed']}" if state["failed"] else ""
  print(f"jaxrl: error: --target: the TPU compiler's process died ({name}) {where}{check} "
        f"(a compiler failure, not a config error: its log is {log.name})", file=sys.stderr,
        flush=True)
  return 2
