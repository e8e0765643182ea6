"""Measurements of this machine the cost model is calibrated with: the matmul peak, memory and
device-to-device bandwidth, each timed now in this process."""
from __future__ import annotations

import time

import numpy as np


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


def memory_bytes_per_s(nbytes: int | None = None, repeats: int = 5) -> float:
  """Read bandwidth of the default device as a decode step sees it: a float32 matrix of
  `nbytes` (128 MiB on a CPU, 1 GiB on an accelerator) times 8 vectors, which streams the
  matrix from memory once; bytes of the matrix per second. (An elementwise copy is the wrong
  probe on a CPU: XLA runs it on one thread, at a quarter of this.)"""
  import jax
  import jax.numpy as jnp
  nbytes = nbytes or (1 << 27 if jax.default_backend() == "cpu" else 1 << 30)
  w = jnp.ones((nbytes // 4 // 4096, 4096), jnp.float32)
  v = jnp.ones((4096, 8), jnp.float32)
  f = jax.jit(lambda a, b: a @ b)
  return nbytes / best_seconds(lambda: f(w, v).block_until_ready(), repeats=repeats, warmup=2)


def transfer_bytes_per_s(nbytes: int = 1 << 26, repeats: int = 5) -> float:
  """Bytes per second from device 0 to device 1 (`jax.device_put`); the memory copy rate where
  there is one device."""
  import jax
  devices = jax.devices()
  if len(devices) < 2:
    return memory_bytes_per_s(nbytes, repeats)
  x = jax.device_put(np.ones((nbytes // 4,), np.float32), devices[0])
  move = lambda: jax.device_put(x, devices[1]).block_until_ready()
  return nbytes / best_seconds(move, repeats=repeats, warmup=1)
