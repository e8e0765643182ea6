"""Host set-up that must run before JAX creates its CPU backend (so no jax import here)."""
from __future__ import annotations

import os


def force_cpu_devices(n: int) -> None:
  """Fake `n` host devices for a CPU mesh, unless XLA_FLAGS already sets a count."""
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if n > 1 and "xla_force_host_platform_device_count" not in xla_flags:
    os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={n}".strip()
