"""Host set-up that must run before JAX creates its CPU backend (so no jax import here)."""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
# Installed by `pip install -e ".[cuda]"` / `".[tpu]"` (or a ROCm build): JAX then picks them.
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                        "jax_rocm7_plugin", "libtpu")


def tpu_chips_here() -> bool:
  """Whether this host has TPU chips (their device files; Google's PCI vendor id)."""
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return True
  for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      with open(path) as f:
        if f.read().strip() == "0x1ae0":
          return True
    except OSError:
      pass
  return False


def cpu_backend() -> bool:
  """Whether JAX will run on the CPU: JAX_PLATFORMS names only "cpu", or, unset, no GPU / TPU
  plugin is installed (JAX prefers one when it is). libtpu without TPU chips (the test extras
  install it for compiling TPU programs on the CPU: `--dry_run --target`) counts as none."""
  platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
  if platforms:
    return all(p == "cpu" for p in platforms)
  plugins = [name for name in _ACCELERATOR_PLUGINS if importlib.util.find_spec(name)]
  if plugins == ["libtpu"] and not tpu_chips_here():
    return True
  return not plugins


def cpu_only_here() -> None:
  """With libtpu installed but no TPU chip (and JAX_PLATFORMS unset), JAX runs on the CPU
  without first trying, and loudly failing, to start a TPU runtime."""
  if "JAX_PLATFORMS" not in os.environ and cpu_backend():
    if importlib.util.find_spec("libtpu"):
      os.environ["JAX_PLATFORMS"] = "cpu"
      if "jax" in sys.modules:  # imported already: its config read the variable then
        sys.modules["jax"].config.update("jax_platforms", "cpu")


def force_cpu_devices(n: int) -> None:
  """Fake `n` host devices for a CPU mesh, unless XLA_FLAGS already sets a count or JAX will
  run on an accelerator (where the flag would only add idle host devices). First
  `cpu_only_here`."""
  cpu_only_here()
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if n > 1 and "xla_force_host_platform_device_count" not in xla_flags and cpu_backend():
    os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={n}".strip()


NO_EXCESS_PRECISION = "--xla_allow_excess_precision=false"


def round_as_written() -> None:
  """XLA rounds every bfloat16 intermediate where the program says (no float32 kept where
  nothing forces the rounding, which programs of other shapes do at other places): what
  `rl.rollout.exact="replay"` needs in bfloat16 (docs/benchmarks.md). Read as JAX starts its
  backend."""
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if "xla_allow_excess_precision" not in xla_flags:
    os.environ["XLA_FLAGS"] = f"{xla_flags} {NO_EXCESS_PRECISION}".strip()


def rounds_as_written() -> bool:
  """Whether this process's XLA_FLAGS turn excess precision off (`round_as_written`)."""
  return NO_EXCESS_PRECISION in os.environ.get("XLA_FLAGS", "")


def pin_to_cores() -> tuple[int, ...] | None:
  """JAXRL_CPU_CORES (e.g. "1" or "0,1"): this process's threads run on these cores from now on
  (Linux); None where unset. Call it once JAX's CPU backend has started: the backend sizes its
  thread pool by the cores the process may use as it starts, and a process started on one core
  (`taskset`) gets one thread, on which a crossing out of its devices waits for the program they
  run (a generator's batch for the whole of the next generation, measured in
  docs/benchmarks.md)."""
  cores = os.environ.get("JAXRL_CPU_CORES", "").strip()
  if not cores:
    return None
  try:
    picked = tuple(sorted({int(c) for c in cores.split(",")}))
    for thread in os.listdir("/proc/self/task"):  # (each thread has its own; new ones inherit)
      os.sched_setaffinity(int(thread), picked)
  except (ValueError, OSError) as e:
    raise ValueError(f"JAXRL_CPU_CORES: expected cores of this machine such as 0 or 0,1 "
                     f"(it has {os.cpu_count()}), got {cores!r} ({e})") from None
  return picked


def reserve_device_memory(fraction: float) -> None:
  """The share of each accelerator's memory JAX may use (placement.device_memory_fraction),
  taken at start; 0: allocated on demand, up to all of it. Variables the user set win."""
  fraction_vars = {"XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"}
  if fraction <= 0:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    fraction = 1.0  # without preallocation JAX still caps its pool at the fraction (0.75)
  # The old name, which every jaxlib we support reads; newer ones also read the new name and
  # refuse both at once (the GPU backend then fails to start).
  if not fraction_vars & set(os.environ):
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:g}"


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
