"""Shared benchmark plumbing: timing, the matmul peak, the JSON last line."""
from __future__ import annotations

import json
import time


def best_seconds(fn, *, repeats: int, warmup: int = 1) -> float:
  """Best wall time of `fn()` (which must block until done) over `repeats` runs."""
  for _ in range(warmup):
    fn()
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t0)
  return best


def matmul_flops_per_s(n: int | None = None, repeats: int = 20, dtype: str = "float32") -> float:
  """Peak matmul rate of the default device in `dtype`, measured now (n x n @ n x n, jitted; n
  is 1024 on a CPU, 8192 on an accelerator, where a smaller product cannot fill the chip)."""
  import jax
  import jax.numpy as jnp
  n = n or (1024 if jax.default_backend() == "cpu" else 8192)
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
  f = jax.jit(lambda x: x @ x)
  seconds = best_seconds(lambda: f(a).block_until_ready(), repeats=repeats, warmup=2)
  return 2 * n**3 / seconds


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
