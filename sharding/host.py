"""Host set-up that must run before JAX creates its CPU backend (so no jax import here)."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def force_cpu_devices(n: int) -> None:
  """Fake `n` host devices for a CPU mesh, unless XLA_FLAGS already sets a count."""
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if n > 1 and "xla_force_host_platform_device_count" not in xla_flags:
    os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={n}".strip()


def retain_freed_memory(threshold_bytes: int = 1 << 30) -> bool:
  """Keeps freed host memory in the process for reuse instead of unmapping it (glibc only).

  By default glibc serves every allocation above 32 MB with a fresh mmap and unmaps it on free,
  so each new weight buffer of a CPU device (a reshard, a KV cache) page-faults its memory in
  again. Raising the mmap and trim thresholds to `threshold_bytes` lets those buffers reuse
  freed pages: `benchmarks.reshard` goes from ~0.3 to ~0.8-1.0 of memcpy. Resident memory then
  stays at its peak, as it does with tcmalloc (which TPU VMs preload). Opt out with
  JAXRL_RETAIN_FREED_MEMORY=0. Returns whether the setting was applied.
  """
  if os.environ.get("JAXRL_RETAIN_FREED_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
  except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
    return False
  value = ctypes.c_int(min(threshold_bytes, 2**31 - 1))
  return bool(mallopt(_M_MMAP_THRESHOLD, value)) and bool(mallopt(_M_TRIM_THRESHOLD, value))
