"""Low-rank adapters (LoRA, Hu et al. 2021) on a LanguageModel's projections.

A target projection W, stored [*out, *in] (transformer.py), gains `W_lora` with A [r, *in] and
B [*out, r]: y = x W^T + (alpha / r) x A^T B^T. A starts like PyTorch's and PEFT's
(uniform in +-1/sqrt(fan_in)), B at zero, so an adapted model's initial logits are the base
model's. The adapters are `nnx.LoRAParam`s (a kind of `nnx.Param`): `TRAINABLE` picks them out of
a state, the learner trains them alone (train/roles/learner.py), and every other parameter is the
frozen base, which the RL stage also scores the reference with (train/roles/cluster.py).

`merged` folds the adapters into the base (W + scale B A): the plain model's state, which the
sampler decodes with (`SamplerWeights.merge`, train/roles/sampler_weights.py) and a Hugging Face
export writes; `peft_tensors` gives
the adapters under PEFT's names for an adapter directory that `peft` loads (jaxrl/models/hf.py).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.families import HF_PROJECTIONS
from jaxrl.models.scan import LAYERS

TARGETS = tuple(HF_PROJECTIONS)
TRAINABLE = nnx.LoRAParam  # the nnx filter of the adapters' parameters
SUFFIX = "_lora"  # the adapter of projection `wq` is the module `wq_lora`


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """`rank` 0: no adapters, every parameter trains. Otherwise only the adapters train (every
  stage that trains the actor: SFT, DPO, RL), the base stays in the compute dtype (unless
  `model.frozen_float32`) and doubles as RL's reference."""
  rank: int = 0
  alpha: float = 16.0  # the update is scaled by alpha / rank
  targets: str = ",".join(TARGETS)  # comma-separated projections: wq,wk,wv,wo,w_gate,w_up,w_down
  # What the sampler gets on a push (train/roles/sampler_weights.py): merged (W + scale B A,
  # decoded as the plain model) | adapters (only they move; the base is read where it lies, or
  # copied once)
  sampler: str = "merged"

  def __post_init__(self):
    if self.rank < 0:
      raise ValueError(f"rank: expected >= 0 (0: no adapters), got {self.rank}")
    if not (math.isfinite(self.alpha) and self.alpha > 0):
      raise ValueError(f"alpha: expected a finite number > 0, got {self.alpha!r}")
    if self.sampler not in ("merged", "adapters"):
      raise ValueError(f"sampler: expected merged or adapters, got {self.sampler!r}")
    unknown = [t for t in self.target_names if t not in TARGETS]
    if unknown or not self.target_names:
      raise ValueError(f"targets: expected a comma-separated subset of {','.join(TARGETS)}, "
                       f"got {self.targets!r}")

  @property
  def target_names(self) -> tuple[str, ...]:
    return tuple(t.strip() for t in self.targets.split(",") if t.strip())

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def on(self, name: str) -> bool:
    return self.enabled and name in self.target_names


def _matmul(x_RI, w_OI):
  return jax.lax.dot_general(x_RI, w_OI.astype(x_RI.dtype), (((1,), (1,)), ((), ())))


class LoRA(nnx.Module):
  """The adapter of one projection whose weight is [*out_shape, *in_shape]."""

  def __init__(self, out_shape, out_axes, in_shape, in_axes, cfg: LoRAConfig, rngs: nnx.Rngs):
    bound = math.prod(in_shape)**-0.5
    self.a = nnx.LoRAParam(jax.random.uniform(rngs.params(), (cfg.rank, *in_shape), jnp.float32,
                                              -bound, bound), logical_axes=(None, *in_axes))
    self.b = nnx.LoRAParam(jnp.zeros((*out_shape, cfg.rank), jnp.float32),
                           logical_axes=(*out_axes, None))
    self.scale = cfg.scale

  def __call__(self, x_BTI):
    """scale * x A^T B^T, [B, T, out] (out flattened), for inputs flattened to [B, T, in]."""
    b, t, _ = x_BTI.shape
    r = self.a.shape[0]
    x_RI = x_BTI.reshape(b * t, -1)
    low_RR = _matmul(x_RI, self.a[...].reshape(r, -1))
    # The up-projection as a batched product (a batch of one): `model.layers.remat="dots"` saves
    # unbatched products for the backward, and this one is [tokens, out], as large as the
    # projection's own output, for r multiply-adds per element: recomputing it is cheaper.
    b_1OR = self.b[...].reshape(1, -1, r).astype(x_BTI.dtype)
    out_1RO = jax.lax.dot_general(low_RR[None], b_1OR, (((2,), (2,)), ((0,), (0,))))
    return (out_1RO[0] * jnp.asarray(self.scale, x_BTI.dtype)).reshape(b, t, -1)

  def delta(self) -> jax.Array:
    """scale * B A in the weight's own shape [*out, *in], float32 (a scanned decoder's stacked
    adapters: every layer's, stacked)."""
    def one(a, b):
      r = a.shape[0]
      b_OR, a_RI = b.astype(jnp.float32).reshape(-1, r), a.astype(jnp.float32).reshape(r, -1)
      return (self.scale * (b_OR @ a_RI)).reshape(*b.shape[:-1], *a.shape[1:])
    if self.a.get_metadata()["logical_axes"][0] == LAYERS:
      return jax.vmap(one)(self.a[...], self.b[...])
    return one(self.a[...], self.b[...])


def adapter(module: nnx.Module, name: str) -> LoRA | None:
  return getattr(module, name + SUFFIX, None)


def adapted(module: nnx.Module, name: str, x_BTI, out_BTO):
  """`out_BTO` (x through projection `name`) plus its adapter's term, if it has one."""
  lora = adapter(module, name)
  if lora is None:
    return out_BTO
  # The sum as a value of its own: XLA would otherwise fuse the add into its consumer (SwiGLU,
  # RoPE, the residual add) and keep both terms, not their sum, for the backward: one more
  # [tokens, out] activation per adapted projection (measured on XLA:CPU, tests/
  # test_memory_model.py).
  return jax.lax.optimization_barrier(out_BTO + lora(x_BTI).astype(out_BTO.dtype))


def split(params: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(adapters, base) of an adapted model's state."""
  return nnx.split_state(params, TRAINABLE, ...)


def merged(graphdef: nnx.GraphDef, params: nnx.State) -> nnx.State:
  """The plain model's state: every target projection W + scale B A, in W's dtype (traceable:
  the sampler's push jits it; an export runs it eagerly)."""
  model = nnx.merge(graphdef, params)
  adapters, base = split(params)
  flat = dict(nnx.to_flat_state(base))
  for path, _ in nnx.to_flat_state(adapters):
    if path[-1] != "a":
      continue
    weight = path[:-2] + (path[-2][:-len(SUFFIX)],)
    w = flat[weight]
    delta = _at(model, path[:-1]).delta()
    flat[weight] = w.replace((w[...].astype(jnp.float32) + delta).astype(w.dtype))
  return nnx.from_flat_state(list(flat.items()))


def _at(module, path):
  for key in path:
    module = module[key] if isinstance(key, int) else getattr(module, key)
  return module


def peft_tensors(graphdef: nnx.GraphDef, params: nnx.State) -> dict[str, jax.Array]:
  """The adapters under PEFT's tensor names (`base_model.model.model.layers.I.MODULE.lora_A.
  weight` [r, in], `lora_B.weight` [out, r]), float32, still on the devices."""
  model = nnx.merge(graphdef, params)
  out = {}
  for i in range(model.cfg.n_layers):
    block = model.decoder.layer(i)
    for name, module in HF_PROJECTIONS.items():
      owner = block.attn if module.startswith("self_attn") else block.mlp
      lora = adapter(owner, name)
      if lora is None:
        continue
      r, prefix = lora.a.shape[0], f"base_model.model.model.layers.{i}.{module}"
      out[f"{prefix}.lora_A.weight"] = lora.a[...].reshape(r, -1)
      out[f"{prefix}.lora_B.weight"] = lora.b[...].reshape(-1, r)
  return out


def peft_config(cfg: LoRAConfig, base_model: str = "") -> dict:
  """adapter_config.json of a PEFT LoRA adapter equal to `cfg`'s."""
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank,
          "lora_alpha": cfg.alpha, "lora_dropout": 0.0, "bias": "none",
          "target_modules": sorted(HF_PROJECTIONS[t].split(".")[-1] for t in cfg.target_names),
          "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
          "init_lora_weights": True, "modules_to_save": None,
          "base_model_name_or_path": base_model, "inference_mode": True}
