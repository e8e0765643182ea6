"""`DecodeSpec`: what an engine decodes with, frozen. As gemma's sampler hands its engines a
frozen description rather than itself, a `Sampler` (sampler.py) hands the stream and the
requests (stream.py, requests.py) and the lowerings (lowering.py) its spec: the model's graph,
the sampling settings, samples per prompt, the mesh and its layout, the in-flight slots. None of
them knows the `Sampler`, so nothing below the one entrance imports it.

An engine made per batch of conversations must not trace its programs again: they are built once
per spec (`cached`), in `programs`, the cache its Sampler and the Sampler's variants share and
own, so it lives as long as they do and keeps nothing else alive.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from flax import nnx
from jax.sharding import Mesh

from jaxrl.partitioning import Rules
from sampler.methods import SamplingConfig
from sharding.rules import SAMPLER_RULES

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
  """`n` samples per prompt under `cfg` on `mesh` (None: one device) in the layout `rules`;
  `inflight_slots` row slots (0: the static engine), `forced`: able to replay. Equal specs
  decode alike (`programs` is not compared)."""
  graphdef: nnx.GraphDef
  cfg: SamplingConfig
  n: int = 1
  mesh: Mesh | None = None
  rules: Rules = SAMPLER_RULES
  inflight_slots: int = 0
  forced: bool = False  # programs that also replay drawn rows (their tokens forced)
  programs: dict[Any, Any] = dataclasses.field(default_factory=dict, compare=False,
                                               repr=False)

  def cached(self, build: Callable[[], T], *key) -> T:
    """`build()` once per (this spec, `key`), kept in `programs`."""
    at = (self, *key)
    if at not in self.programs:
      self.programs[at] = build()
    return self.programs[at]
