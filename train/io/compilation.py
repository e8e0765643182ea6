"""Compile seconds per labelled program, and JAX's persistent compilation cache.

`enable_cache(setting)` points JAX's persistent compilation cache at a directory, so a second
start of the same run loads its programs instead of compiling them again. Where (first that
is set): JAX_COMPILATION_CACHE_DIR (JAX's own), the config's `compilation_cache_dir`, the
environment's JAXRL_COMPILATION_CACHE, else $XDG_CACHE_HOME/jaxrl/xla (~/.cache/jaxrl/xla);
"off" disables it. The first directory set in a process stays (JAX opens its cache once).

A run's `CompileRecord` (its Experiment's, closed with it) adds the seconds JAX spends tracing,
lowering and compiling (or loading from the cache) each program to the label of the timeline
span running on that thread (train/io/timeline.py: "generate", "update", ...); work outside a
span (initialisation, the held-out evaluation) counts as "other". A labelled call that compiled
something logs one line. JAX's monitoring listeners are the process's: a record listens from
its start to its `close`, so it holds what compiled meanwhile, nothing of runs before it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time

import jax
from jax import monitoring

log = logging.getLogger("jaxrl")
OTHER = "other"
# Tracing, lowering to MLIR, and XLA's compile (or the load on a cache hit). A jit traced
# inside another one's trace (or an eager op run there) is timed inside it: counted once.
_SECONDS_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_PROGRAM_EVENT = "/jax/core/compile/backend_compile_duration"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
# JAX caches only programs that took 1 s to compile by default; on a CPU most take 0.05-10 s,
# and even the smallest load from the cache in a tenth of their compile time.
_MIN_COMPILE_S = 0.0


@dataclasses.dataclass
class Compiles:
  seconds: float = 0.0
  programs: int = 0  # XLA compiles, cache hits included
  cache_hits: int = 0

  def plus(self, other: Compiles) -> Compiles:
    return Compiles(self.seconds + other.seconds, self.programs + other.programs,
                    self.cache_hits + other.cache_hits)


class _Open:
  """One thread's compiles in one span: counts, and the recent intervals that later, enclosing
  ones replace."""

  def __init__(self):
    self.counts, self.intervals = Compiles(), []

  def add(self, seconds: float) -> None:
    end = time.perf_counter()  # JAX reports a duration right as it ends
    start = end - seconds
    while self.intervals and self.intervals[-1][0] >= start:
      inner_start, inner_end = self.intervals.pop()
      self.counts.seconds -= inner_end - inner_start
    self.intervals.append((start, end))
    del self.intervals[:-_KEEP_INTERVALS]  # an enclosing event holds far fewer than this
    self.counts.seconds += seconds


_KEEP_INTERVALS = 1000


def cache_dir(setting: str = "") -> str | None:
  """The directory a `compilation_cache_dir` setting names (None: off), JAXRL_COMPILATION_CACHE
  and then the user cache directory standing in for an empty one."""
  setting = setting or os.environ.get("JAXRL_COMPILATION_CACHE", "")
  if setting == "off":
    return None
  if setting:
    return os.path.abspath(os.path.expanduser(setting))
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jaxrl", "xla")


def enable_cache(setting: str = "") -> str | None:
  """Turns on the persistent compilation cache (idempotent); the directory in use, or None."""
  try:
    current = jax.config.jax_compilation_cache_dir
  except AttributeError:  # a JAX without this option: run without the cache
    log.warning("this JAX has no jax_compilation_cache_dir: no persistent compilation cache")
    return None
  if current:  # JAX_COMPILATION_CACHE_DIR, or an earlier call: JAX has opened that one
    return current
  path = cache_dir(setting)
  if path is None:
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    with contextlib.suppress(AttributeError):  # a JAX without it keeps its own threshold
      jax.config.update("jax_persistent_cache_min_compile_time_secs", _MIN_COMPILE_S)
  return path


class CompileRecord:
  """One run's compile seconds per label (module docstring); `close` stops listening."""

  def __init__(self):
    self._lock = threading.Lock()
    self._totals: dict[str, Compiles] = {}  # label -> compiles of the finished spans
    self._unlabelled: list[_Open] = []  # each thread's compiles outside spans, as OTHER
    self._local = threading.local()  # .span: this thread's open span; .outside: outside spans
    self._listening = (self._on_duration, self._on_event)
    monitoring.register_event_duration_secs_listener(self._listening[0])
    monitoring.register_event_listener(self._listening[1])

  def close(self) -> None:
    """Stops listening (once; later calls do nothing)."""
    with self._lock:
      listening, self._listening = self._listening, None
    if listening is not None:
      monitoring.unregister_event_duration_listener(listening[0])
      monitoring.unregister_event_listener(listening[1])

  def _open(self) -> _Open:
    span = getattr(self._local, "span", None)
    if span is None:
      span = getattr(self._local, "outside", None)
      if span is None:
        span = self._local.outside = _Open()
        with self._lock:
          self._unlabelled.append(span)
    return span

  def _on_duration(self, event: str, seconds: float, **_) -> None:
    if event in _SECONDS_EVENTS:
      span = self._open()  # only this thread writes it
      span.add(seconds)
      span.counts.programs += event == _PROGRAM_EVENT

  def _on_event(self, event: str, **_) -> None:
    if event == _HIT_EVENT:
      self._open().counts.cache_hits += 1

  @contextlib.contextmanager
  def labelled(self, label: str):
    """Counts the compiles this thread does inside the block as `label`'s."""
    outer, self._local.span = getattr(self._local, "span", None), _Open()
    try:
      yield
    finally:
      counts, self._local.span = self._local.span.counts, outer
      if counts.programs or counts.seconds:
        with self._lock:
          self._totals[label] = self._totals.get(label, Compiles()).plus(counts)
      if counts.programs:
        hits = f", {counts.cache_hits} from the cache" if counts.cache_hits else ""
        plural = "s" if counts.programs != 1 else ""
        log.info("compiled %s in %.2f s (%d program%s%s)", label, counts.seconds,
                 counts.programs, plural, hits)

  def totals(self) -> dict[str, Compiles]:
    """label -> compiles so far: of the finished spans, and OTHER's."""
    with self._lock:
      out = dict(self._totals)
      for outside in self._unlabelled:  # read while their threads may add: a snapshot
        out[OTHER] = out.get(OTHER, Compiles()).plus(outside.counts)
    return out

  def summary(self) -> dict:
    """The compiles as summary.json entries: `compile_s`, `compile_cache_hits` and per label
    {"s", "programs", "cache_hits"} under `compile`."""
    by_label = {label: c for label, c in sorted(self.totals().items())
                if c.programs or c.seconds}
    return {"compile_s": round(sum(c.seconds for c in by_label.values()), 3),
            "compile_cache_hits": sum(c.cache_hits for c in by_label.values()),
            "compile": {label: {"s": round(c.seconds, 3), "programs": c.programs,
                                "cache_hits": c.cache_hits} for label, c in by_label.items()}}
