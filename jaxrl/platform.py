"""The platform a program is built for: JAX's default backend, or, while `building_for` is
active, the target of an ahead-of-time compile (train/preflight/target_compile.py compiles a run's
programs for a TPU topology on a CPU host). Code that chooses between forms of a program by platform (the
CPU's matrix-product layouts, cuDNN or Pallas attention, XLA:CPU's pass options) asks here, not
`jax.default_backend()`, so a target compile builds what the target would run.

The target is the process's, as JAX's backend is, and the models ask for it deep inside their
code, so it is not passed down: `TARGET`, a `BuildTarget`, holds it, and only its scoped setter
changes it. Programs traced on any thread during a scope (an executor's, a compile's) are built
for its platform, so the value is not thread-local; instead, a scope on another thread waits for
the one in progress to end (a nested scope on the same thread does not), and each scope restores
the platform it found.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax


class BuildTarget:
  """The platform programs are built for: `platform` inside a `building_for(platform)` scope,
  else JAX's default backend."""

  def __init__(self):
    self._scope = threading.RLock()  # held through a scope: one thread's scopes at a time
    self._platform: str | None = None

  def backend(self) -> str:
    """"cpu" | "gpu" | "tpu". (Not under the lock: a thread that traces for the target while a
    scope is open must not wait for the scope to end.)"""
    platform = self._platform
    return platform if platform is not None else jax.default_backend()

  @contextlib.contextmanager
  def building_for(self, platform: str) -> Iterator[None]:
    """Programs traced inside (on any thread) are built for `platform`; the platform before
    it comes back after."""
    with self._scope:
      before, self._platform = self._platform, platform
      try:
        yield
      finally:
        self._platform = before


TARGET = BuildTarget()


def backend() -> str:
  """"cpu" | "gpu" | "tpu": the platform of the programs being built (`TARGET`'s)."""
  return TARGET.backend()


def building_for(platform: str) -> contextlib.AbstractContextManager[None]:
  """Programs traced inside are built for `platform` (`TARGET`'s scope)."""
  return TARGET.building_for(platform)
