"""Model families: one registry entry each (`FAMILIES`), named by `ModelConfig.family`.

An entry says what the family's decoder blocks compute (`BlockOptions`, read by the one forward
pass in transformer.py), which Hugging Face architecture its checkpoints are, which config.json
keys of its own it reads, which tensor names they use and which config.json fields its export
writes. A family whose blocks the model already computes is one entry here; a new kind of block
adds an option to `BlockOptions` and its code to transformer.py. Hugging Face config.json fields
whose values the model does not compute are refused on import (jaxrl/models/hf_config.py), never
approximated.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Activation:
  """A gated MLP's activation: its function, and its name in a Hugging Face config.json
  (`hidden_act`, Gemma's `hidden_activation`)."""
  fn: Callable[[jax.Array], jax.Array]
  hf: str


# The gated MLP's activations (a family's `BlockOptions.mlp_activation`), dense and experts alike:
# a new one is one entry here.
ACTIVATIONS = {"silu": Activation(jax.nn.silu, "silu"),
               "gelu_tanh": Activation(functools.partial(jax.nn.gelu, approximate=True),
                                       "gelu_pytorch_tanh")}


@dataclasses.dataclass(frozen=True)
class BlockOptions:
  qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
  qk_norm: bool = False  # RMSNorm over head_dim on queries and keys before RoPE (Qwen3, Gemma 3)
  # Every RMSNorm scales by (1 + its weight), the weight stored as the offset (Gemma).
  norm_offset: bool = False
  # The attention's and the MLP's outputs are normed before the residual adds ("sandwich"
  # norms: Gemma 2 and 3).
  sandwich_norms: bool = False
  # The gated MLP's activation, an `ACTIVATIONS` name: "silu" (SwiGLU: Llama, Qwen) or
  # "gelu_tanh" (GeGLU with tanh-approximated GELU: Gemma).
  mlp_activation: str = "silu"
  # The embedding is multiplied by sqrt(d_model), rounded to the compute dtype (Gemma).
  scale_embedding: bool = False
  # Mixture of experts: the MLP is a router and experts (jaxrl/models/moe.py; ModelConfig's
  # `moe` section sizes it).
  moe: bool = False


# jaxrl's projection names -> the Hugging Face module each one is (LoRA's targets; PEFT names
# adapters by these modules).
HF_PROJECTIONS = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
                  "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
                  "w_down": "mlp.down_proj"}

# Block parameter -> (its tensor under `model.layers.{i}.`, the jaxrl axis a such that axes
# (a, a + 1) are the checkpoint's axis a split into (heads, head_dim); None: same shape).
BLOCK_TENSORS = {
    ("attn_norm", "scale"): ("input_layernorm.weight", None),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", None),
    ("attn", "wq"): ("self_attn.q_proj.weight", 0),
    ("attn", "wk"): ("self_attn.k_proj.weight", 0),
    ("attn", "wv"): ("self_attn.v_proj.weight", 0),
    ("attn", "wo"): ("self_attn.o_proj.weight", 1),
    ("attn", "bq"): ("self_attn.q_proj.bias", 0),
    ("attn", "bk"): ("self_attn.k_proj.bias", 0),
    ("attn", "bv"): ("self_attn.v_proj.bias", 0),
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", None),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", None),
    ("mlp", "w_gate"): ("mlp.gate_proj.weight", None),
    ("mlp", "w_up"): ("mlp.up_proj.weight", None),
    ("mlp", "w_down"): ("mlp.down_proj.weight", None),
}
GEMMA_TENSORS = {
    **BLOCK_TENSORS,
    ("mlp_norm", "scale"): ("pre_feedforward_layernorm.weight", None),
    ("post_attn_norm", "scale"): ("post_attention_layernorm.weight", None),
    ("post_mlp_norm", "scale"): ("post_feedforward_layernorm.weight", None),
}
# Qwen3-MoE: each block's MLP is a router and experts, one checkpoint tensor per expert (the
# stacked [E, out, in] parameter's `EXPERTS` marker; `{e}`: the expert's index).
EXPERTS = "experts"
MOE_TENSORS = {
    **{k: v for k, v in BLOCK_TENSORS.items() if k[0] != "mlp"},
    ("mlp", "router"): ("mlp.gate.weight", None),
    ("mlp", "w_gate"): ("mlp.experts.{e}.gate_proj.weight", EXPERTS),
    ("mlp", "w_up"): ("mlp.experts.{e}.up_proj.weight", EXPERTS),
    ("mlp", "w_down"): ("mlp.experts.{e}.down_proj.weight", EXPERTS),
}
TOP_TENSORS = {("decoder", "embed"): "model.embed_tokens.weight",
               ("decoder", "final_norm", "scale"): "model.norm.weight",
               ("lm_head",): "lm_head.weight"}


def _qwen_fields(cfg) -> dict:
  return dict(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers,
              layer_types=["full_attention"] * cfg.n_layers)


@dataclasses.dataclass(frozen=True)
class Family:
  hf_architecture: str  # config.json's `architectures` entry
  block: BlockOptions = BlockOptions()
  # ModelConfig fields, by dotted name ("attention.softcap"), from config.json keys of the
  # family's own (the keys every family shares, hidden_size, num_attention_heads, rope, ...,
  # are read by hf_config.py): raw dict -> dict. A soft cap of the scores or the logits is read
  # and written here, by the families whose config.json has it; others refuse it.
  hf_read: Callable[[dict], dict] = lambda raw: {}
  # config.json fields an export writes besides the ones every family has (ModelConfig -> dict)
  hf_fields: Callable[[Any], dict] = lambda cfg: {}
  block_tensors: dict = dataclasses.field(default_factory=lambda: BLOCK_TENSORS)
  hf_model_type: str = ""  # config.json's model_type (default: the family's name)
  # config.json defaults of the family's own config class, for keys a checkpoint leaves out
  hf_defaults: dict = dataclasses.field(default_factory=dict)
  # Architectures that wrap the family's language model (a multimodal checkpoint): its name ->
  # where the text model's config (a config.json key) and tensors (a name prefix) are. Only the
  # text model is read; an export writes the family's own architecture.
  hf_wrappers: dict = dataclasses.field(default_factory=dict)
  # Sliding-window layers in its config.json's `layer_types` (a global layer every n-th, the
  # others sliding: Gemma 3), with n's default where transformers 4 left `layer_types` out (as
  # `sliding_window_pattern`); 0: none, every layer attends globally.
  hf_sliding_every: int = 0


# transformers' Gemma3TextConfig defaults: the multimodal checkpoints' text_config (Gemma 3 4B and
# larger) lists only the fields that differ from them.
GEMMA3_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                       num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=256, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
                       sliding_window=4096, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                       max_position_embeddings=131072, tie_word_embeddings=True,
                       hidden_activation=ACTIVATIONS["gelu_tanh"].hf)


def global_every(layer_types: list[str]) -> int:
  """The period of the global layers in Hugging Face's `layer_types` (0: none is global)."""
  return layer_types.index("full_attention") + 1 if "full_attention" in layer_types else 0


def layer_types(n_layers: int, every: int) -> list[str]:
  """`layer_types` of `n_layers` layers with every `every`-th global, the others sliding."""
  return ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention"
          for i in range(n_layers)]


def _gemma3_read(raw: dict) -> dict:
  """Gemma 3's own config.json keys: the sliding window, the layers' pattern (checked by
  hf_config.py), the sliding layers' RoPE base, the queries' scale, the scores' and the
  logits' soft caps (null: none)."""
  every = global_every(raw.get("layer_types") or [])
  rope = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
  return {"attention.sliding_window": int(raw.get("sliding_window") or 0),
          "attention.global_every": every,
          "rope.local_theta": float(rope.get("rope_theta", raw.get("rope_local_base_freq",
                                                                   10_000.0))),
          "attention.query_scale": float(raw.get("query_pre_attn_scalar") or 0.0),
          "attention.softcap": float(raw.get("attn_logit_softcapping") or 0.0),
          "logit_softcap": float(raw.get("final_logit_softcapping") or 0.0)}


def _gemma3_fields(cfg) -> dict:
  a, gelu = cfg.attention, ACTIVATIONS["gelu_tanh"].hf
  scale = a.query_scale or cfg.head_dim
  return dict(sliding_window=a.sliding_window, layer_types=cfg.layer_types(),
              rope_local_base_freq=cfg.rope.local_theta,
              query_pre_attn_scalar=int(scale) if scale == int(scale) else scale,
              hidden_activation=gelu, hidden_act=gelu,
              attention_bias=False, final_logit_softcapping=cfg.logit_softcap or None,
              attn_logit_softcapping=a.softcap or None, use_bidirectional_attention=False)


def _moe_read(raw: dict) -> dict:
  """Qwen3-MoE's own config.json keys (transformers 5 writes `num_experts` as
  `num_local_experts`); its unsupported variants are refused by hf_config.py."""
  return {"moe.experts": int(raw.get("num_experts") or raw.get("num_local_experts") or 0),
          "moe.per_token": int(raw.get("num_experts_per_tok") or 0),
          "moe.d_ff": int(raw.get("moe_intermediate_size") or 0),
          "moe.norm_topk": bool(raw.get("norm_topk_prob", False))}


def _moe_fields(cfg) -> dict:
  m = cfg.moe
  return dict(_qwen_fields(cfg), attention_bias=False, num_experts=m.experts,
              num_experts_per_tok=m.per_token, moe_intermediate_size=m.d_ff,
              norm_topk_prob=m.norm_topk, decoder_sparse_step=1, mlp_only_layers=[],
              output_router_logits=False)


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM",
                    hf_fields=lambda cfg: dict(attention_bias=False, mlp_bias=False)),
    "qwen2": Family("Qwen2ForCausalLM", BlockOptions(qkv_bias=True), hf_fields=_qwen_fields),
    "qwen3": Family("Qwen3ForCausalLM", BlockOptions(qk_norm=True),
                    hf_fields=lambda cfg: dict(_qwen_fields(cfg), attention_bias=False)),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", BlockOptions(qk_norm=True, moe=True),
                        hf_read=_moe_read, hf_fields=_moe_fields, block_tensors=MOE_TENSORS),
    "gemma3": Family("Gemma3ForCausalLM",
                     BlockOptions(qk_norm=True, norm_offset=True, sandwich_norms=True,
                                  mlp_activation="gelu_tanh", scale_embedding=True),
                     hf_read=_gemma3_read, hf_fields=_gemma3_fields,
                     block_tensors=GEMMA_TENSORS, hf_model_type="gemma3_text",
                     hf_defaults=GEMMA3_DEFAULTS, hf_sliding_every=6,
                     hf_wrappers={"Gemma3ForConditionalGeneration": ("text_config",
                                                                     "language_model.")}),
}


def family_of_architecture(architecture: str) -> str | None:
  """The family whose checkpoints name `architecture`, or wrap its model so (None: no family
  does)."""
  return next((name for name, f in FAMILIES.items()
               if architecture == f.hf_architecture or architecture in f.hf_wrappers), None)
