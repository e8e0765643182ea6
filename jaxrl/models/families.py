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
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class BlockOptions:
  qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
  qk_norm: bool = False  # RMSNorm over head_dim on queries and keys before RoPE (Qwen3)


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
  # ModelConfig fields from config.json keys of the family's own (the keys every family shares,
  # hidden_size, num_attention_heads, rope, ..., are read by hf_config.py): raw dict -> dict
  hf_read: Callable[[dict], dict] = lambda raw: {}
  # config.json fields an export writes besides the ones every family has (ModelConfig -> dict)
  hf_fields: Callable[[Any], dict] = lambda cfg: {}
  block_tensors: dict = dataclasses.field(default_factory=lambda: BLOCK_TENSORS)


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM",
                    hf_fields=lambda cfg: dict(attention_bias=False, mlp_bias=False)),
    "qwen2": Family("Qwen2ForCausalLM", BlockOptions(qkv_bias=True), hf_fields=_qwen_fields),
    "qwen3": Family("Qwen3ForCausalLM", BlockOptions(qk_norm=True),
                    hf_fields=lambda cfg: dict(_qwen_fields(cfg), attention_bias=False)),
}


def family_of_architecture(architecture: str) -> str | None:
  """The family whose checkpoints name `architecture` (None: no family does)."""
  return next((name for name, f in FAMILIES.items() if f.hf_architecture == architecture), None)
