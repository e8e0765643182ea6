"""The platform a program is built for: JAX's default backend, or, while `building_for` is
active, the target of an ahead-of-time compile (cli/target_compile.py compiles a run's programs
for a TPU topology on a CPU host). Code that chooses between forms of a program by platform (the
CPU's matrix-product layouts, cuDNN or Pallas attention, XLA:CPU's pass options) asks here, not
`jax.default_backend()`, so a target compile builds what the target would run."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

_TARGET: list[str] = []


def backend() -> str:
  """"cpu" | "gpu" | "tpu": the platform of the programs being built."""
  return _TARGET[-1] if _TARGET else jax.default_backend()


@contextlib.contextmanager
def building_for(platform: str) -> Iterator[None]:
  """Programs traced inside are built for `platform`."""
  _TARGET.append(platform)
  try:
    yield
  finally:
    _TARGET.pop()
