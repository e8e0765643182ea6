"""`ModelConfig`: one decoder, by concern. Its own fields are the model's shape and numerics and
where its weights come from; its sections hold the rest: `rope` (rotary positions), `attention`
(the implementation, sliding windows, the queries' scale, the scores' soft cap), `moe` (a
mixture of experts) and `layers` (scanned or unrolled, what the backward recomputes). Its
`family` (jaxrl/models/families.py) fixes what a block computes and how Hugging Face checkpoints
name it. A field's dotted name (`rope.theta`, `moe.experts`) is its name in the config
(`model.rope.theta`) and in `fields` / `from_fields`, the flat view the Hugging Face reader and
the checks use."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl import platform
from jaxrl.config_checks import at_least_zero, choice
from jaxrl.models.families import ACTIVATIONS, FAMILIES, BlockOptions
from jaxrl.models.moe import MOE_IMPLS

MOE_FAMILIES = sorted(name for name, f in FAMILIES.items() if f.block.moe)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ROPE_SCALINGS = ("none", "linear", "llama3")
ATTENTIONS = ("auto", "einsum", "xla", "cudnn", "splash")
# What a decoder block saves for the backward under `model.layers.remat` (the rest is
# recomputed): "dots" keeps the projections' and MLP's matrix products (`dense` multiplies flat
# 2-D rows, no batch dimension) and recomputes attention's batched [T, S] products, norms and
# activations; "full" keeps only each block's input.
REMAT_POLICIES = {"dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  "full": jax.checkpoint_policies.nothing_saveable}
REMATS = ("none", *REMAT_POLICIES)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Rotary positions: the base (`theta`), its scaling (none | linear | llama3, Llama 3.1+, with
  the factors and the context it was trained on) and the sliding-window layers' own base."""
  theta: float = 10_000.0
  scaling: str = "none"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_positions: int = 8192
  local_theta: float = 10_000.0  # the local (sliding-window) layers' base (Gemma 3)

  def __post_init__(self):
    choice(self, "scaling", ROPE_SCALINGS)
    if not self.theta > 0:
      raise ValueError(f"theta: expected > 0, got {self.theta!r}")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Attention. `impl`, of training, scoring and prefill attention (decode steps always use the
  einsum form over the cache): auto | einsum (explicit products, float32 softmax) | xla | cudnn,
  the last two through `jax.nn.dot_product_attention` (cudnn: fused flash attention, GPU,
  bf16/fp16 only) | splash (JAX's Pallas splash kernel: TPU; elsewhere interpreted, for
  tests); auto: jaxrl/models/attention.attention_impl. `sliding_window`: the local layers'
  window in tokens (0: every layer attends to all earlier tokens), every `global_every`-th
  layer (1-based) a global one (0: none is). The queries' scale is query_scale**-0.5 (Gemma's
  query_pre_attn_scalar; 0: head_dim). `softcap` > 0: every score -> softcap * tanh(score /
  softcap) before the softmax (Gemma 2's attn_logit_softcapping), in the einsum form only."""
  impl: str = "auto"
  sliding_window: int = 0
  global_every: int = 0
  query_scale: float = 0.0
  softcap: float = 0.0

  def __post_init__(self):
    choice(self, "impl", ATTENTIONS)
    at_least_zero(self, "sliding_window", "global_every", "query_scale", "softcap")
    if self.softcap and self.impl not in ("auto", "einsum"):
      raise ValueError(f"impl: {self.impl!r} does not soft-cap the scores (softcap="
                       f"{self.softcap}); expected 'auto' or 'einsum'")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """A mixture of experts (Qwen3-MoE; jaxrl/models/moe.py): `experts` > 0 replaces every
  block's MLP by a router over that many SwiGLU experts of width `d_ff`, `per_token` of them per
  token (top-k of the router's softmax, renormalised over the k if `norm_topk`). `impl`: auto |
  ragged (sorted assignments, `ragged_dot` grouped products) | blocked (the same in blocks of
  rows, batched: faster on CPU and H200) | dense (every expert on every token); auto: dense for
  a decode-sized batch, else blocked (moe.experts_impl). The update adds `aux_loss` x the
  load-balancing loss and `z_loss` x the router z-loss. `routing_replay`: off | rollout: the
  trainer's passes route each token to the experts the sampler used for it (recorded at
  rollout; verl's and NeMo-RL's R3), instead of its own top k; either way the update reports
  the share of tokens whose choices differ."""
  experts: int = 0
  per_token: int = 0
  d_ff: int = 0
  norm_topk: bool = False
  impl: str = "auto"
  aux_loss: float = 0.0
  z_loss: float = 0.0
  routing_replay: str = "off"

  def __post_init__(self):
    choice(self, "impl", MOE_IMPLS)
    choice(self, "routing_replay", ("off", "rollout"))
    at_least_zero(self, "experts", "aux_loss", "z_loss")
    if self.routing_replay != "off" and not self.experts:
      raise ValueError(f"routing_replay: {self.routing_replay!r} replays a mixture of experts' "
                       "routing; this model has no experts (experts=0), expected 'off'")
    if self.experts and not 0 < self.per_token <= self.experts:
      raise ValueError(f"per_token: expected 1 to experts={self.experts}, got {self.per_token}")
    if self.experts and self.d_ff <= 0:
      raise ValueError(f"d_ff: expected > 0 with experts={self.experts}, got {self.d_ff}")


@dataclasses.dataclass(frozen=True)
class LayersConfig:
  """How the decoder's layers run. `scan`: auto | true | false: the blocks stacked along a
  `layers` axis and every pass (training, scoring, prefill, decode, its KV cache stacked too)
  one scan over them, traced and compiled once whatever the depth (jaxrl/models/scan.py;
  checkpoints and Hugging Face files stay per layer); auto (`ModelConfig.scanned`): scanned on
  GPUs and TPUs and in TPU target compiles, unrolled on the CPU (where the scanned RL step
  measured 1.25x slower). `remat`: none | dots | full: what a block's backward recomputes
  instead of keeping (REMAT_POLICIES; jaxrl/models/remat.py); training passes only (a shared
  prefix's cached ones too): the sampler's never remat."""
  scan: str = "auto"
  remat: str = "none"

  def __post_init__(self):
    object.__setattr__(self, "scan", str(self.scan).lower())  # (True from Python or a flag)
    choice(self, "scan", ("auto", "true", "false"))
    choice(self, "remat", REMATS)


SECTIONS = {"rope": RopeConfig, "attention": AttentionConfig, "moe": MoEConfig,
            "layers": LayersConfig}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  # A `FAMILIES` name (jaxrl/models/families.py): the block options its entry names (Qwen2's
  # q/k/v biases, Qwen3's q/k norms, Gemma's offset and sandwich norms, GeGLU and embedding
  # scale) and the checkpoints' architecture and tensor names
  family: str = "llama"
  vocab_size: int = 264
  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 32
  d_ff: int = 512
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  # jaxrl's own init draws N(0, 1) embeddings and reads the tied LM head as embed / sqrt(d_model);
  # Hugging Face models (Llama 3.2, Qwen2.5) use the embedding itself: False.
  scale_tied_head: bool = True
  dtype: str = "float32"  # compute dtype; trained parameters are always stored in float32
  # The frozen reference (and, always, the sampler's copy) holds its matrices in the compute
  # dtype, which scores exactly as float32 weights would (models/dtypes.py); True keeps float32.
  frozen_float32: bool = False
  # Soft-capped logits (Gemma 2's final_logit_softcapping): logits -> cap * tanh(logits / cap),
  # applied by the LM head (jaxrl/models/lm_head.py) for the sampler and the trainer alike; 0:
  # none.
  logit_softcap: float = 0.0
  # A local Hugging Face model directory to start from (config.json, *.safetensors, tokenizer);
  # its config.json sets the fields it fixes (jaxrl/models/hf.py). Not read by the model itself.
  hf_path: str = ""
  rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
  attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
  moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
  layers: LayersConfig = dataclasses.field(default_factory=LayersConfig)

  def __post_init__(self):
    for name, cls in SECTIONS.items():  # (a flat field of before the sections, say)
      if not isinstance(getattr(self, name), cls):
        raise ValueError(f"{name}: expected a {cls.__name__} (model.{name}.*), got "
                         f"{getattr(self, name)!r}")
    if self.family not in FAMILIES:
      raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {self.family!r}")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                 "norm_eps"):
      if not getattr(self, name) > 0:
        raise ValueError(f"{name}: expected > 0, got {getattr(self, name)!r}")
    choice(self, "dtype", DTYPES)
    at_least_zero(self, "logit_softcap")
    if self.head_dim % 2:
      raise ValueError(f"head_dim: RoPE rotates pairs, expected an even number, got "
                       f"{self.head_dim}")
    if self.block.mlp_activation not in ACTIVATIONS:
      raise ValueError(f"family: {self.family!r} names the MLP activation "
                       f"{self.block.mlp_activation!r}, expected one of {sorted(ACTIVATIONS)}")
    if bool(self.moe.experts) != self.block.moe:
      raise ValueError(f"moe.experts: {self.moe.experts} with family={self.family!r}, expected "
                       + ("> 0 (a mixture-of-experts family)" if self.block.moe else
                          f"0 (a dense family; {MOE_FAMILIES} have experts)"))
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"n_heads: {self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")

  def is_local(self, layer: int) -> bool:
    """Whether decoder layer `layer` (0-based) attends within `attention.sliding_window`
    tokens."""
    a = self.attention
    return bool(a.sliding_window) and (not a.global_every or (layer + 1) % a.global_every != 0)

  def layer_types(self) -> list[str]:
    """Hugging Face's names of the layers' attention kinds."""
    return ["sliding_attention" if self.is_local(i) else "full_attention"
            for i in range(self.n_layers)]

  @property
  def scanned(self) -> bool:
    """Whether the decoder is scanned (`layers.scan`, "auto" resolved for the platform the
    programs are built for: jaxrl/platform.py)."""
    if self.layers.scan == "auto":
      return platform.backend() != "cpu"
    return self.layers.scan == "true"

  @property
  def query_scale_factor(self) -> float:
    return (self.attention.query_scale or self.head_dim) ** -0.5

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def block(self) -> BlockOptions:
    """What the family's decoder blocks compute besides the Llama block."""
    return FAMILIES[self.family].block


def fields(cfg: ModelConfig) -> dict[str, Any]:
  """Every field of `cfg` by its dotted name ("d_model", "rope.theta", "moe.experts")."""
  out = {}
  for f in dataclasses.fields(cfg):
    value = getattr(cfg, f.name)
    if f.name in SECTIONS:
      out.update({f"{f.name}.{k}": v for k, v in dataclasses.asdict(value).items()})
    else:
      out[f.name] = value
  return out


FIELDS = tuple(fields(ModelConfig()))  # every dotted name


def from_fields(values: Mapping[str, Any], base: ModelConfig | None = None) -> ModelConfig:
  """A ModelConfig of dotted field names (`fields`' form), over `base`'s (default: the
  schema's defaults); a name that is no field is a ValueError naming it."""
  unknown = sorted(set(values) - set(FIELDS))
  if unknown:
    raise ValueError(f"{unknown[0]}: no such model field")
  flat = {**fields(base or ModelConfig()), **values}
  top = {k: v for k, v in flat.items() if "." not in k}
  for name, cls in SECTIONS.items():
    try:
      top[name] = cls(**{k.split(".", 1)[1]: v for k, v in flat.items()
                         if k.startswith(name + ".")})
    except ValueError as e:  # a section's check names its field: named in the model's terms
      raise ValueError(f"{name}.{e}") from None
  return ModelConfig(**top)
