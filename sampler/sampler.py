"""The one entrance to decoding: `Sampler`, a frozen description of how to decode. Everything
that decodes goes through one, by the shape of what it decodes:

  generate   a batch of prompts, left-padded on the mesh (the RL's batches): the static engine
             (sampler/engine.py), or in-flight batching (sampler/inflight.py) with
             `inflight_slots`; a `Rollout` on the devices
  complete   a list of prompts as token ids, left-padded here into a (batch, length) bucket so
             that batches of similar size reuse one compiled program; host arrays
  stream     a stream of prompt batches in in-flight slots, new weights swapped in between
             decode segments (sampler/stream.py: partial rollouts)
  requests   contexts served one by one in in-flight slots, each result back to the host as it
             ends (sampler/requests.py: multi-turn turns)

A sampler with other settings is `variant(...)`: each set of settings is built (and compiled)
once, in one cache that every variant of a sampler shares. With a mesh, decode runs under the
sampling rules (tensor parallel over heads / mlp, data parallel over the batch).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.partitioning import Rules
from sampler.engine import Rollout, bucket, generate
from sampler.inflight import jit_inflight
from sampler.methods import SamplingConfig
from sampler.requests import Requests
from sampler.spec import DecodeSpec
from sampler.stream import Stream, StreamGeometry
from sharding.mesh import batch_sharding
from sharding.rules import SAMPLER_RULES, data_axes, jit_per_shard

LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
BATCH_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024)


def _jit_static(graphdef: nnx.GraphDef, cfg: SamplingConfig, *, n: int, mesh: Mesh | None,
                rules: Rules, param_shardings, on_trace: Callable[[], None]):
  """`generate` jitted for a mesh: `fn(params, tokens_BP, valid_BP, key, max_new_B)`.

  Data parallelism is manual (`jit_per_shard`): every data shard runs its own decode loop on its
  rows with its own random stream (the key folded with the shard index). Without other mesh axes
  a shard stops when its own rows are done, with no per-token collective; with tensor
  parallelism inside the shards, whose collectives span every device of the program, all shards
  stop together (one all-reduce of the done flags per step). Inside a shard the remaining axes
  stay automatic, following `rules`.
  """
  axes = data_axes(mesh, rules)
  lockstep = bool(axes) and any(size > 1 for name, size in mesh.shape.items() if name not in axes)

  def all_done(done_B):
    local = jnp.all(done_B).astype(jnp.int32)
    return (jax.lax.pmin(local, axes) if lockstep else local) > 0

  def run(params, tokens_BP, valid_BP, key, max_new_B):
    on_trace()
    if axes:
      key = jax.random.fold_in(key, jax.lax.axis_index(axes))
    return generate(graphdef, params, tokens_BP, valid_BP, key, max_new_B, cfg=cfg, n=n,
                    all_done=all_done if axes else jnp.all)

  shardings = {}
  if mesh is not None:
    rows, grid = batch_sharding(mesh, rules, 1), batch_sharding(mesh, rules, 2)
    shardings = dict(in_shardings=(param_shardings, grid, grid, None, rows))
  return jit_per_shard(mesh, rules, run, (False, True, True, False, True), **shardings)


@dataclasses.dataclass(frozen=True, eq=False)
class Sampler:
  """`n` samples per prompt (rows group-major) under `cfg`, on `mesh` (None: one device) in the
  layout `rules` (the weights arrive in `param_shardings`). `inflight_slots` = 0: the static
  engine, each batch decoding until its longest row ends; > 0: in-flight batching in that many
  row slots, refilled as rows finish (one process only). Either returns the same `Rollout`.
  Frozen, because it is compiled for its settings: other settings are another sampler
  (`variant`)."""
  graphdef: nnx.GraphDef
  cfg: SamplingConfig
  n: int = 1
  mesh: Mesh | None = None
  rules: Rules = SAMPLER_RULES
  param_shardings: Any = None
  inflight_slots: int = 0
  forced: bool = False  # in-flight programs that also replay drawn rows (sampler/inflight.py)
  length_buckets: Sequence[int] = LENGTH_BUCKETS
  batch_buckets: Sequence[int] = BATCH_BUCKETS
  _traced: list = dataclasses.field(default_factory=list, init=False, repr=False)
  _decode: Callable = dataclasses.field(init=False, repr=False)  # built by __post_init__
  _variants: dict = dataclasses.field(default_factory=dict, init=False, repr=False)
  # The engines' programs, shared by the variants (sampler/spec.py): they live as long as these
  _programs: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

  def __post_init__(self):
    """Builds the decode program; a ValueError names what cannot run (the caller knows which
    setting of its own to blame)."""
    if not self.inflight_slots:
      fn = _jit_static(self.graphdef, self.cfg, n=self.n, mesh=self.mesh, rules=self.rules,
                       param_shardings=self.param_shardings,
                       on_trace=lambda: self._traced.append(None))
    else:
      fn = jit_inflight(self.graphdef, self.cfg, slots=self.inflight_slots, n=self.n,
                        mesh=self.mesh, rules=self.rules, forced=self.forced)
    object.__setattr__(self, "_decode", fn)

  def lower(self, params, tokens_BP, valid_BP, key, max_new_B=None):
    """The static engine's program lowered for these arguments (arrays or ShapeDtypeStructs
    carrying shardings): `.compile()` builds it without running it (a target compile)."""
    if self.inflight_slots:
      raise ValueError("in-flight batching runs a host loop of several programs")
    return self._decode.lower(params, tokens_BP, valid_BP, key, max_new_B)

  def lower_complete(self, params, rows: int, width: int):
    """The program `complete` runs for `rows` prompts of up to `width` tokens (their budgets
    given), lowered from abstract arguments (`params` may be ShapeDtypeStructs)."""
    b, p = bucket(rows, self.batch_buckets), bucket(width, self.length_buckets)
    key = jax.eval_shape(lambda: jax.random.key(0))
    return self.lower(params, jax.ShapeDtypeStruct((b, p), jnp.int32),
                      jax.ShapeDtypeStruct((b, p), bool), key,
                      jax.ShapeDtypeStruct((b * self.n,), jnp.int32))

  @property
  def traces(self) -> int:
    """How many times the static engine was traced (a retrace means a new bucket)."""
    return len(self._traced)

  def generate(self, params, tokens_BP: jax.Array, valid_BP: jax.Array, key: jax.Array,
               max_new_B: jax.Array | None = None) -> Rollout:
    """`n` samples per prompt of a left-padded batch (on the mesh, split over its data axes);
    `max_new_B` (per output row) caps each row's length. The rollout stays on the devices."""
    return self._decode(params, tokens_BP, valid_BP, key, max_new_B)

  def variant(self, *, n: int | None = None, inflight_slots: int | None = None,
              **sampling) -> Sampler:
    """This sampler with other settings (`n`, `inflight_slots`, any `SamplingConfig` field),
    built once per settings in the cache its variants share."""
    cfg = dataclasses.replace(self.cfg, **sampling) if sampling else self.cfg
    key = (cfg, self.n if n is None else n,
           self.inflight_slots if inflight_slots is None else inflight_slots)
    self._variants.setdefault((self.cfg, self.n, self.inflight_slots), self)
    if key not in self._variants:
      made = dataclasses.replace(self, cfg=key[0], n=key[1], inflight_slots=key[2])
      object.__setattr__(made, "_variants", self._variants)
      object.__setattr__(made, "_programs", self._programs)
      self._variants[key] = made
    return self._variants[key]

  @property
  def spec(self) -> DecodeSpec:
    """What its engines decode with (sampler/spec.py), with the programs' cache it owns."""
    return DecodeSpec(self.graphdef, self.cfg, self.n, self.mesh, self.rules,
                      self.inflight_slots, self.forced, self._programs)

  def stream(self, params, geometry: StreamGeometry) -> Stream:
    """A stream of prompt batches in this sampler's in-flight slots, laid out as `geometry`
    says (sampler/stream.py)."""
    return Stream(self.spec, params, geometry)

  def requests(self, params, *, context_width: int, keep: bool = True) -> Requests:
    """This sampler's in-flight slots serving requests of contexts up to `context_width`
    tokens, one sample each (sampler/requests.py); `keep`: a finished request's slot keeps its
    cache for the next request of its tag."""
    return Requests(self.spec, params, context_width=context_width, keep=keep)

  def complete(self, params, prompts: Sequence[Sequence[int]], key: jax.Array,
               max_new_tokens: Sequence[int] | None = None) -> Rollout:
    """`n` samples per prompt of a list of token ids, bucketed, as host numpy arrays."""
    b = bucket(len(prompts), self.batch_buckets)
    p = bucket(max(map(len, prompts)), self.length_buckets)
    tokens_BP = np.full((b, p), self.cfg.pad_id, np.int32)
    valid_BP = np.zeros((b, p), bool)
    for row, ids in enumerate(prompts):
      tokens_BP[row, p - len(ids):] = ids
      valid_BP[row, p - len(ids):] = True
    valid_BP[len(prompts):, -1] = True  # padding rows: one dummy token, so attention is defined
    budget = np.full((b,), self.cfg.max_new_tokens, np.int32)
    budget[len(prompts):] = 1  # padding rows: one token, so they never hold the batch up
    if max_new_tokens is not None:
      budget[:len(prompts)] = np.minimum(np.asarray(max_new_tokens, np.int32),
                                         self.cfg.max_new_tokens)
    budget_B = np.repeat(budget, self.n)
    out = jax.device_get(self.generate(params, tokens_BP, valid_BP, key, budget_B))
    keep = len(prompts) * self.n
    return jax.tree.map(lambda x: x[:keep], out)
