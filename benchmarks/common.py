"""Shared benchmark plumbing: timing and the matmul peak (planner/measure.py), the JSON
last line."""
from __future__ import annotations

import json

from planner.measure import best_seconds, matmul_flops_per_s  # noqa: F401 (re-exported)


def add_host_flags(parser) -> None:
  parser.add_argument("--no-retain-freed-memory", dest="retain", action="store_false",
                      help="keep glibc's default of unmapping large freed buffers")


def setup_host(args) -> bool:
  """Applies sharding.host.retain_freed_memory unless --no-retain-freed-memory; returns it."""
  from sharding.host import retain_freed_memory
  return retain_freed_memory() if args.retain else False


def emit(result: dict, as_json: bool) -> None:
  if not as_json:
    for k, v in result.items():
      print(f"{k:>24}: {v}")
  print(json.dumps(result))
