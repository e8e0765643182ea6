"""The live peak of a compiled program from XLA's own dump: the most bytes its temporaries hold
at one moment of its schedule, which `memory_analysis().temp_size_in_bytes` exceeds by the
compiler's packing of them into one preallocated buffer (and what else it reserves).

  XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text --xla_dump_hlo_module_re=NAME" ...
  live_peak(DIR, NAME) -> (peak bytes, preallocated temp bytes)

Reads the after-optimizations buffer assignment (each value's offset and size in the
preallocated temp allocation) and live ranges (each value's first and last instruction)."""
from __future__ import annotations

import glob
import os
import re

_ALLOCATION = re.compile(r"allocation (\d+): size (\d+), (.*)")
_VALUE = re.compile(r" value: <\d+ (\S+) @\S+> \(size=(\d+),offset=(\d+)\)")
_RANGE = re.compile(r"\s+(\S+):(\d+)-(\d+)$")


def _temp_values(path: str) -> tuple[dict[str, tuple[int, int]], int]:
  """{value name: (offset, size)} in the default memory's preallocated temp allocation, and the
  allocation's size."""
  values, current, size = {}, False, 0
  with open(path) as f:
    for line in f:
      if m := _ALLOCATION.match(line):
        kind = m.group(3)
        current = "preallocated-temp" in kind and "color" not in kind
        size = int(m.group(2)) if current else size
      elif current and (m := _VALUE.match(line)):
        values[m.group(1)] = (int(m.group(3)), int(m.group(2)))
  return values, size


def _live_ranges(path: str) -> dict[str, tuple[int, int]]:
  ranges, started = {}, False
  with open(path) as f:
    for line in f:
      if line.strip() == "BufferLiveRange:":
        started = True
      elif started:
        if not (m := _RANGE.match(line)):
          break
        ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
  return ranges


def _covered(intervals: list[tuple[int, int]]) -> int:
  """Bytes under the union of [offset, offset + size) intervals (aliases share bytes)."""
  total, reach = 0, -1
  for lo, hi in sorted(intervals):
    if hi > reach:
      total += hi - max(lo, reach)
      reach = hi
  return total


def _dump(directory: str, module: str) -> tuple[str, list[tuple], int]:
  """(the dump's file prefix, [(value name, first, last instruction, offset, size)] of the
  preallocated temporaries, that allocation's size) of the dumped module `module` (its last
  one)."""
  prefix = sorted(glob.glob(os.path.join(directory, f"*{module}*after_optimizations-buffer-"
                                                    "assignment.txt")))[-1]
  prefix = prefix[:-len("buffer-assignment.txt")]
  values, allocated = _temp_values(prefix + "buffer-assignment.txt")
  ranges = _live_ranges(prefix + "live-range.txt")
  spans = [(name, *ranges[key], offset, size) for name, (offset, size) in values.items()
           if (key := name if name.endswith("}") else name + "{}") in ranges]
  return prefix, spans, allocated


def _peak_moment(spans: list[tuple]) -> tuple[int, int]:
  """(the instruction at which the most bytes are live, those bytes)."""
  events = sorted({s for _, s, *_ in spans} | {e for _, _, e, *_ in spans})
  live = lambda t: _covered([(o, o + z) for _, s, e, o, z in spans if s <= t <= e])
  return max(((t, live(t)) for t in events), key=lambda x: x[1], default=(0, 0))


def live_peak(directory: str, module: str) -> tuple[int, int]:
  """(live peak bytes, preallocated temp bytes) of the dumped module `module` (its last one)."""
  _, spans, allocated = _dump(directory, module)
  return _peak_moment(spans)[1], allocated


def at_peak(directory: str, module: str, top: int = 12) -> list[tuple[str, int, str]]:
  """The `top` largest temporaries live at the live peak: (value name, bytes, its instruction's
  shape and op, from the after-optimizations HLO)."""
  prefix, spans, _ = _dump(directory, module)
  t, _ = _peak_moment(spans)
  hlo_path = prefix[:-1] + ".txt"
  hlo = open(hlo_path).read() if os.path.exists(hlo_path) else ""
  out = []
  live = sorted((sp for sp in spans if sp[1] <= t <= sp[2]), key=lambda sp: -sp[4])
  for name, _, _, _, size in live[:top]:
    m = re.search(rf"\n\s*(?:ROOT )?%?{re.escape(name.split('{')[0])} = ([^\n]{{0,160}})", hlo)
    out.append((name, size, m.group(1) if m else ""))
  return out
