"""Busy intervals of the executors, written as a Chrome / Perfetto trace (`trace.json`).

Open the file in ui.perfetto.dev or chrome://tracing: one row per executor, one slice per call.
`summary()` gives each executor's busy fraction of the wall time and the bubble: the mean idle
fraction over the executors that own devices (1 - sum(busy) / (n * wall)).
"""
from __future__ import annotations

import contextlib
import json
import threading
import time


class Timeline:

  def __init__(self):
    self._lock = threading.Lock()
    self._events: list[tuple[str, str, float, float, dict]] = []
    self._executors: list[str] = []
    self.t0 = time.perf_counter()

  def register(self, executor: str) -> None:
    with self._lock:
      if executor not in self._executors:
        self._executors.append(executor)

  @contextlib.contextmanager
  def span(self, executor: str, label: str, **args):
    self.register(executor)
    start = time.perf_counter()
    try:
      yield
    finally:
      with self._lock:
        self._events.append((executor, label, start, time.perf_counter(), args))

  def busy_seconds(self, since: float | None = None) -> dict[str, float]:
    since = self.t0 if since is None else since
    with self._lock:
      out = dict.fromkeys(self._executors, 0.0)
      for executor, _, start, end, _ in self._events:
        out[executor] += max(0.0, end - max(start, since))
    return out

  def summary(self, since: float | None = None) -> dict:
    """{"wall_s", "busy": {executor: fraction}, "bubble"} over [since, now]."""
    since = self.t0 if since is None else since
    wall = max(time.perf_counter() - since, 1e-9)
    busy = {k: min(v / wall, 1.0) for k, v in self.busy_seconds(since).items()}
    bubble = 1.0 - sum(busy.values()) / len(busy) if busy else 0.0
    return {"wall_s": wall, "busy": busy, "bubble": bubble}

  def write_chrome_trace(self, path: str) -> None:
    with self._lock:
      tids = {name: i for i, name in enumerate(self._executors)}
      events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
                for name, tid in tids.items()]
      events += [{"name": label, "cat": executor, "ph": "X", "pid": 0, "tid": tids[executor],
                  "ts": (start - self.t0) * 1e6, "dur": (end - start) * 1e6, "args": args}
                 for executor, label, start, end, args in self._events]
    with open(path, "w", encoding="utf-8") as f:
      json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
