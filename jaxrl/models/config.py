"""`ModelConfig`: the dimensions and options of one decoder; its `family` (jaxrl/models/families.py)
fixes what a block computes and how Hugging Face checkpoints name it."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxrl import platform
from jaxrl.models.families import FAMILIES, BlockOptions
from jaxrl.models.moe import MOE_IMPLS

MOE_FAMILIES = sorted(name for name, f in FAMILIES.items() if f.block.moe)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ROPE_SCALINGS = ("none", "linear", "llama3")
ATTENTIONS = ("auto", "einsum", "xla", "cudnn", "splash")
# What a decoder block saves for the backward under `model.remat` (the rest is recomputed):
# "dots" keeps the projections' and MLP's matrix products (`dense` multiplies flat 2-D rows, no
# batch dimension) and recomputes attention's batched [T, S] products, norms and activations;
# "full" keeps only each block's input.
REMAT_POLICIES = {"dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  "full": jax.checkpoint_policies.nothing_saveable}
REMATS = ("none", *REMAT_POLICIES)
# The gated MLP's activation (a family's `BlockOptions.mlp_activation`), dense and experts alike.
MLP_ACTIVATIONS = {"silu": jax.nn.silu,
                   "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


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
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  # jaxrl's own init draws N(0, 1) embeddings and reads the tied LM head as embed / sqrt(d_model);
  # Hugging Face models (Llama 3.2, Qwen2.5) use the embedding itself: False.
  scale_tied_head: bool = True
  rope_scaling: str = "none"  # none | linear | llama3 (Llama 3.1+)
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  dtype: str = "float32"  # compute dtype; trained parameters are always stored in float32
  # The frozen reference (and, always, the sampler's copy) holds its matrices in the compute
  # dtype, which scores exactly as float32 weights would (models/dtypes.py); True keeps float32.
  frozen_float32: bool = False
  # none | dots | full: recompute the decoder blocks' activations in the backward instead of
  # keeping them (REMAT_POLICIES); training only: the sampler's cached passes never remat.
  remat: str = "none"
  # The decoder's blocks stacked along a `layers` axis and every pass (training, scoring,
  # prefill, decode, its KV cache stacked too) one scan over them: traced and compiled once
  # whatever the depth (jaxrl/models/scan.py). Checkpoints and Hugging Face files stay per
  # layer. auto | true | false; auto (`scanned`): scanned on GPUs and TPUs and in TPU target
  # compiles, unrolled on the CPU (where the scanned RL step measured 1.25x slower).
  scan_layers: str = "auto"
  # Training, scoring and prefill attention (decode steps always use the einsum form over the
  # cache): auto | einsum (explicit products, float32 softmax) | xla | cudnn, the last two
  # through `jax.nn.dot_product_attention` (cudnn: fused flash attention, GPU, bf16/fp16 only)
  # | splash (JAX's Pallas splash kernel: TPU; elsewhere interpreted, for tests). auto: cudnn
  # on a GPU in bf16, splash on a TPU, else xla (jaxrl/models/attention.attention_impl).
  attention: str = "auto"
  # Sliding-window attention (Gemma 3): the local layers' window in tokens (0: every layer
  # attends to all earlier tokens); every `global_every`-th layer (1-based) is a global one
  # (0: none is), the others local; the local layers' RoPE base (the global ones keep
  # `rope_theta` and `rope_scaling`).
  sliding_window: int = 0
  global_every: int = 0
  rope_local_theta: float = 10_000.0
  # The queries' scale is query_scale**-0.5 (Gemma's query_pre_attn_scalar); 0: head_dim.
  query_scale: float = 0.0
  # Soft-capped logits (Gemma 2's final_logit_softcapping): logits -> cap * tanh(logits / cap),
  # applied by the LM head (jaxrl/models/lm_head.py) for the sampler and the trainer alike; 0: none.
  logit_softcap: float = 0.0
  # Mixture of experts (Qwen3-MoE; jaxrl/models/moe.py): n_experts > 0 replaces every block's
  # MLP by a router over n_experts SwiGLU experts of width expert_d_ff, experts_per_token of
  # them per token (top-k of the router's softmax, renormalised over the k if norm_topk);
  # moe_impl: auto | ragged (sorted assignments, `ragged_dot` grouped products) | blocked (the
  # same in blocks of rows, batched: faster on CPU and H200) | dense (every expert on every
  # token); auto: dense for a decode-sized batch, else blocked (moe.experts_impl). The update
  # adds router_aux_loss x the load-balancing loss and router_z_loss x the router z-loss.
  n_experts: int = 0
  experts_per_token: int = 0
  expert_d_ff: int = 0
  norm_topk: bool = False
  moe_impl: str = "auto"
  router_aux_loss: float = 0.0
  router_z_loss: float = 0.0
  # off | rollout: the trainer's passes route each token to the experts the sampler used for it
  # (recorded at rollout; verl's and NeMo-RL's R3, "rollout routing replay"), instead of its own
  # top k. Either way the update reports the share of tokens whose choices differ.
  routing_replay: str = "off"
  # A local Hugging Face model directory to start from (config.json, *.safetensors, tokenizer);
  # its config.json sets the fields above (jaxrl/models/hf.py). Not read by the model itself.
  hf_path: str = ""

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {self.family!r}")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                 "rope_theta", "norm_eps"):
      if not getattr(self, name) > 0:
        raise ValueError(f"{name}: expected > 0, got {getattr(self, name)!r}")
    scan = str(self.scan_layers).lower()  # (True from Python, "True" from a command line)
    object.__setattr__(self, "scan_layers", scan)
    for name, allowed in (("scan_layers", ["auto", "true", "false"]), ("dtype", sorted(DTYPES)), ("rope_scaling", list(ROPE_SCALINGS)),
                          ("attention", list(ATTENTIONS)), ("remat", list(REMATS)),
                          ("moe_impl", list(MOE_IMPLS)), ("routing_replay", ["off", "rollout"])):
      if getattr(self, name) not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {getattr(self, name)!r}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim: RoPE rotates pairs, expected an even number, got "
                       f"{self.head_dim}")
    for name in ("sliding_window", "global_every", "query_scale", "logit_softcap", "n_experts",
                 "router_aux_loss", "router_z_loss"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)!r}")
    if self.block.mlp_activation not in MLP_ACTIVATIONS:
      raise ValueError(f"family: {self.family!r} names the MLP activation "
                       f"{self.block.mlp_activation!r}, expected one of {sorted(MLP_ACTIVATIONS)}")
    if bool(self.n_experts) != self.block.moe:
      raise ValueError(f"n_experts: {self.n_experts} with family={self.family!r}, expected "
                       + ("> 0 (a mixture-of-experts family)" if self.block.moe else
                          f"0 (a dense family; {MOE_FAMILIES} have experts)"))
    if self.routing_replay != "off" and not self.n_experts:
      raise ValueError(f"routing_replay: {self.routing_replay!r} replays a mixture of experts' "
                       "routing; this model has no experts (n_experts=0), expected 'off'")
    if self.n_experts and not 0 < self.experts_per_token <= self.n_experts:
      raise ValueError(f"experts_per_token: expected 1 to n_experts={self.n_experts}, got "
                       f"{self.experts_per_token}")
    if self.n_experts and self.expert_d_ff <= 0:
      raise ValueError(f"expert_d_ff: expected > 0 with n_experts={self.n_experts}, got "
                       f"{self.expert_d_ff}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"n_heads: {self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")

  def is_local(self, layer: int) -> bool:
    """Whether decoder layer `layer` (0-based) attends within `sliding_window` tokens."""
    return bool(self.sliding_window) and (not self.global_every
                                          or (layer + 1) % self.global_every != 0)

  def layer_types(self) -> list[str]:
    """Hugging Face's names of the layers' attention kinds."""
    return ["sliding_attention" if self.is_local(i) else "full_attention"
            for i in range(self.n_layers)]

  @property
  def scanned(self) -> bool:
    """Whether the decoder is scanned (`scan_layers`, "auto" resolved for the platform the
    programs are built for: jaxrl/platform.py)."""
    if self.scan_layers == "auto":
      return platform.backend() != "cpu"
    return self.scan_layers == "true"

  @property
  def query_scale_factor(self) -> float:
    return (self.query_scale or self.head_dim) ** -0.5

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def block(self) -> BlockOptions:
    """What the family's decoder blocks compute besides the Llama block."""
    return FAMILIES[self.family].block
