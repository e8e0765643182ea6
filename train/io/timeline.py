"""Busy intervals of the executors, written as a Chrome / Perfetto trace (`trace.json`).

Open the file in ui.perfetto.dev or chrome://tracing: one row per executor, one slice per call.
`summary()` gives each executor's busy fraction of the wall time and the bubble: the fraction of
device-time left idle, where a device is busy while any executor placed on it runs a call
(1 - sum over devices of busy time / (n_devices * wall)). Executors without devices (a host-side
verifier) count for busy % but not for the bubble.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time

from train.io.compilation import CompileRecord


class Timeline:

  def __init__(self, compiles: CompileRecord | None = None):
    """`compiles`: the run's record of compile seconds, which each span labels (none: not
    counted)."""
    self.compiles = compiles
    self._lock = threading.Lock()
    self._events: list[tuple[str, str, float, float, dict]] = []
    self._executors: dict[str, tuple[int, ...]] = {}  # executor -> device ids it runs on
    self.t0 = time.perf_counter()

  def register(self, executor: str, devices=()) -> None:
    with self._lock:
      if executor not in self._executors or devices:
        self._executors[executor] = tuple(devices)

  def add(self, executor: str, label: str, start: float, end: float, **args) -> None:
    with self._lock:
      self._executors.setdefault(executor, ())
      self._events.append((executor, label, start, end, args))

  def since(self, count: int, executor: str) -> tuple[list[tuple[str, float, float]], int]:
    """`executor`'s (label, start, end) among the events after the first `count`, and how many
    events there are now (the next call's `count`)."""
    with self._lock:
      new = [(label, start, end) for ex, label, start, end, _ in self._events[count:]
             if ex == executor]
      return new, len(self._events)

  @contextlib.contextmanager
  def span(self, executor: str, label: str, **args):
    """A busy interval; what compiles in it on this thread counts as `label`'s compiles."""
    start = time.perf_counter()
    try:
      with (self.compiles.labelled(label) if self.compiles else contextlib.nullcontext()):
        yield
    finally:
      self.add(executor, label, start, time.perf_counter(), **args)

  def busy_seconds(self, since: float | None = None,
                   until: float = float("inf")) -> dict[str, float]:
    since = self.t0 if since is None else since
    with self._lock:
      out = dict.fromkeys(self._executors, 0.0)
      for executor, _, start, end, _ in self._events:
        out[executor] += max(0.0, min(end, until) - max(start, since))
    return out

  def durations(self, since: float | None = None) -> dict[str, list[float]]:
    """Seconds of each call that started at or after `since`, by label."""
    since = self.t0 if since is None else since
    out: dict[str, list[float]] = {}
    with self._lock:
      for _, label, start, end, _ in self._events:
        if start >= since:
          out.setdefault(label, []).append(end - start)
    return out

  def _device_busy_seconds(self, since: float, until: float) -> dict[int, float]:
    """Per device, the length of the union of the busy intervals of the executors on it."""
    with self._lock:
      intervals: dict[int, list[tuple[float, float]]] = {}
      for executor, _, start, end, _ in self._events:
        start, end = max(start, since), min(end, until)
        for d in self._executors.get(executor, ()):
          if end > start:
            intervals.setdefault(d, []).append((start, end))
      devices = {d for ds in self._executors.values() for d in ds}
    out = dict.fromkeys(devices, 0.0)
    for d, spans in intervals.items():
      reach = since
      for start, end in sorted(spans):
        out[d] += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return out

  def summary(self, since: float | None = None, until: float | None = None) -> dict:
    """{"wall_s", "busy": {executor: fraction}, "bubble"} over [since, until or now]."""
    since = self.t0 if since is None else since
    until = time.perf_counter() if until is None else until
    wall = max(until - since, 1e-9)
    busy = {k: min(v / wall, 1.0) for k, v in self.busy_seconds(since, until).items()}
    per_device = self._device_busy_seconds(since, until)
    bubble = 1.0 - sum(per_device.values()) / (len(per_device) * wall) if per_device else 0.0
    return {"wall_s": wall, "busy": busy, "bubble": bubble}

  def write_chrome_trace(self, path: str) -> None:
    with self._lock:
      tids = {name: i for i, name in enumerate(self._executors)}
      events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
                 "args": {"name": f"{name} (devices {list(self._executors[name])})"
                          if self._executors[name] else name}}
                for name, tid in tids.items()]
      events += [{"name": label, "cat": executor, "ph": "X", "pid": 0, "tid": tids[executor],
                  "ts": (start - self.t0) * 1e6, "dur": (end - start) * 1e6, "args": args}
                 for executor, label, start, end, args in self._events]
    with open(path, "w", encoding="utf-8") as f:
      json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def read_trace(path: str) -> dict[str, list[tuple[str, float, float]]]:
  """A written trace's spans: {executor: [(label, start_s, end_s)]} in time order."""
  with open(path, encoding="utf-8") as f:
    events = json.load(f)["traceEvents"]
  spans: dict[str, list[tuple[str, float, float]]] = {}
  for e in sorted((e for e in events if e["ph"] == "X"), key=lambda e: e["ts"]):
    spans.setdefault(e["cat"], []).append((e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
  return spans


def seconds_within(spans: list[tuple[str, float, float]], since: float = 0.0,
                   until: float = float("inf")) -> float:
  """Seconds of `spans` (one executor's: disjoint) between `since` and `until`."""
  return sum(max(0.0, min(end, until) - max(start, since)) for _, start, end in spans)


def overlap_seconds(a: list[tuple[str, float, float]], b: list[tuple[str, float, float]],
                    since: float = 0.0) -> float:
  """Seconds after `since` in which a span of `a` and one of `b` both run (each list's spans
  disjoint, as one executor's are)."""
  return sum(max(0.0, min(ea, eb) - max(sa, sb, since))
             for _, sa, ea in a for _, sb, eb in b)
