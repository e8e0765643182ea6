"""The in-flight engines' programs lowered from abstract arguments (ShapeDtypeStructs carrying
shardings), without running them: what a target compile (train/preflight/target_compile.py) compiles for a
slice that is not here.

The host loops of sampler/inflight.py (a batch's rows), sampler/stream.py (partial rollouts) and
sampler/requests.py (the turns of conversations) call a few programs each, at a few sizes; each
is lowered here at its largest (every slot prefilled at once, the widest prompt or context), the
size that holds the most. The smaller refills and tails are the same code over fewer rows. An
argument that an earlier program makes (the model in the compute dtype, the slot state) takes
that program's outputs as its compiler laid them out (`Chain`): the run passes them on as they
come.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from sampler import inflight
from sampler.requests import request_programs
from sampler.slots import ring_width
from sampler.spec import DecodeSpec
from sampler.stream import StreamGeometry, stream_programs

S = jax.ShapeDtypeStruct
Lowerings = list[tuple[str, Callable[[], jax.stages.Lowered]]]


def _i32(*shape: int) -> S:
  return S(shape, jnp.int32)


def _like(info, sharding) -> S:
  """An output as an argument: on one device (a program that reads none of its arguments, such
  as the slots' start) it is left where the next program wants it, as the run's would be."""
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return S(info.shape, info.dtype)
  return S(info.shape, info.dtype, sharding=sharding)


class Chain:
  """Outputs of lowered programs, each compiled once, as the arguments of later ones."""

  def __init__(self):
    self._outputs = {}

  def out(self, name: str, lower: Callable[[], jax.stages.Lowered]):
    if name not in self._outputs:
      lowered = lower()
      compiled = lowered.compile()
      self._outputs[name] = jax.tree.map(_like, lowered.out_info, compiled.output_shardings)
    return self._outputs[name]


def _prefill_args(k: int, width: int, slots: int) -> tuple:
  """A prefill of `k` rows of `width` tokens into `slots` slots: (tokens, valid, rows or slots,
  budgets, key data, indices, each slot's source)."""
  return (_i32(k, width), S((k, width), bool), _i32(k), _i32(k), S((k, 2), jnp.uint32), _i32(k),
          _i32(slots))


def rows(spec: DecodeSpec, params, tokens_BP: S) -> Lowerings:
  """In-flight batching of one batch of prompts `tokens_BP` (`Sampler.generate` with
  `inflight_slots`)."""
  k, chain = spec.inflight_slots, Chain()
  p = inflight.row_programs(spec.graphdef, spec.cfg, slots=k, n=spec.n, mesh=spec.mesh,
                            rules=spec.rules)
  valid_BP, key = S(tokens_BP.shape, bool, sharding=tokens_BP.sharding), jax.eval_shape(
      lambda: jax.random.key(0))
  cast = lambda: p.cast.lower(params)
  model = lambda: chain.out("cast", cast)
  start = lambda: p.start.lower(model(), tokens_BP)
  state = lambda: chain.out("start", start)
  return [("slots: cast weights", cast), ("slots: start", start),
          ("slots: refill (every slot)", lambda: p.refill.lower(
              model(), *state(), tokens_BP, valid_BP, key, None, _i32(k), _i32(k))),
          ("slots: decode segment", lambda: p.decode.lower(model(), state()[0], state()[2],
                                                           _i32())),
          ("slots: finish", lambda: p.finish.lower(*state()[:2], tokens_BP, valid_BP))]


def stream(spec: DecodeSpec, params, geometry: StreamGeometry, grid) -> Lowerings:
  """Partial rollouts' stream (`Sampler.stream`); `grid`: the sharding its prompt batches come
  in."""
  k, chain = spec.inflight_slots, Chain()
  p = stream_programs(spec, geometry)
  cast = lambda: p.cast.lower(params)
  model = lambda: chain.out("cast", cast)
  start = lambda: p.start.lower(model())
  state = lambda: chain.out("start", start)  # (slots, outputs, global step)
  prompts = S((geometry.rows // spec.n, geometry.prompt_width), jnp.int32, sharding=grid)
  return [("stream: cast weights", cast), ("stream: start", start),
          ("stream: admit (every slot)", lambda: p.admit.lower(
              model(), state()[0], state()[2], *_prefill_args(k, geometry.prompt_width, k))),
          ("stream: harvest", lambda: p.harvest.lower(*state()[:2])),
          ("stream: decode segment", lambda: p.decode.lower(model(), state()[0], state()[2],
                                                            _i32())),
          ("stream: take a batch", lambda: p.take.lower(
              state()[1], _i32(), prompts, S(prompts.shape, bool, sharding=grid)))]


def requests(spec: DecodeSpec, params, context_width: int) -> Lowerings:
  """Turns of conversations in slots that keep their caches (`Sampler.requests`), contexts of
  up to `context_width` tokens; a prefill and a kept turn's extension as wide as the ring."""
  k, chain = spec.inflight_slots, Chain()
  ring = ring_width(context_width, spec.cfg.max_new_tokens)
  p = request_programs(spec, ring)
  cast = lambda: p.cast.lower(params)
  model = lambda: chain.out("cast", cast)
  empty = lambda: p.empty.lower(model())
  state = lambda: chain.out("empty", empty)
  return [("turns: cast weights", cast), ("turns: empty slots", empty),
          ("turns: admit (every slot)", lambda: p.admit.lower(
              model(), state(), _i32(), *_prefill_args(k, ring, k))),
          ("turns: extend kept caches", lambda: p.extend.lower(
              model(), state(), _i32(), *_prefill_args(k, ring, k))),
          ("turns: decode segment", lambda: p.decode.lower(model(), state(), _i32(), _i32()))]
