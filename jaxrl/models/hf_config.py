"""Hugging Face config.json <-> ModelConfig, for the checkpoints of jaxrl's model families
(jaxrl/models/families.py: Llama, Qwen2, Qwen3, Qwen3-MoE, Gemma 3 text).

Only what the model computes exactly is accepted: anything else in a config.json (another
architecture, Qwen's sliding-window option, attention-logit soft-capping in a family that does
not read it, YaRN, an MLP or output-projection bias) is an `HFError` naming the file and the
field, never a silent approximation; an export of what the family's architecture cannot express
(soft-capped logits or scores in a Llama) is refused the same way. transformers 4 writes
`rope_theta` and `rope_scaling`, transformers 5 `rope_parameters`; both are read, and exports
write both, so either version (and vLLM) loads them.
"""
from __future__ import annotations

import json
import os

from jaxrl.models.config import ModelConfig, fields, from_fields
from jaxrl.models.families import (ACTIVATIONS, FAMILIES, family_of_architecture, global_every,
                                   layer_types)


class HFError(ValueError):
  """A Hugging Face checkpoint or config that jaxrl cannot load (or write) exactly."""


# The ModelConfig fields (dotted names) a checkpoint fixes, and those that stay the user's (a new
# field must join one of them: tests/test_hf_config.py checks).
USER_FIELDS = ("dtype", "hf_path", "frozen_float32", "attention.impl", "moe.impl", "moe.aux_loss",
               "moe.z_loss", "moe.routing_replay", "layers.scan", "layers.remat")
ARCH_FIELDS = ("family", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
               "d_ff", "norm_eps", "tie_embeddings", "scale_tied_head", "logit_softcap",
               *(f"rope.{name}" for name in ("theta", "scaling", "factor", "low_freq_factor",
                                            "high_freq_factor", "original_max_positions",
                                            "local_theta")),
               "attention.sliding_window", "attention.global_every", "attention.query_scale",
               "attention.softcap", "moe.experts", "moe.per_token", "moe.d_ff", "moe.norm_topk")
_LLAMA3_KEYS = {"rope.factor": "factor", "rope.low_freq_factor": "low_freq_factor",
                "rope.high_freq_factor": "high_freq_factor",
                "rope.original_max_positions": "original_max_position_embeddings"}


def read_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise HFError(f"{path}: not found") from None
  except json.JSONDecodeError as e:
    raise HFError(f"{path}: not valid JSON ({e})") from None


def _require(raw: dict, key: str, path: str):
  if raw.get(key) is None:
    raise HFError(f"{path}: {key} is missing")
  return raw[key]


def _unsupported(path: str, key: str, value, why: str) -> HFError:
  return HFError(f"{path}: {key}={json.dumps(value)} is not supported ({why})")


def _family(raw: dict, path: str) -> str:
  names = raw.get("architectures") or []
  family = family_of_architecture(names[0]) if len(names) == 1 else None
  if family is None:
    known = sorted([f.hf_architecture for f in FAMILIES.values()]
                 + [w for f in FAMILIES.values() for w in f.hf_wrappers])
    raise _unsupported(path, "architectures", names, f"expected one of {known}")
  return family


def _refuse_unsupported(raw: dict, family: str, path: str) -> None:
  """Fields whose non-default values change the computation in ways the model does not."""
  block = FAMILIES[family].block
  if block.moe:
    _refuse_moe(raw, path)
  activation = ACTIVATIONS[block.mlp_activation].hf
  for key in ("hidden_act", "hidden_activation"):  # (Gemma's is hidden_activation)
    if raw.get(key) not in (None, activation):
      raise _unsupported(path, key, raw[key], f"the MLP's activation is {activation} only")
  if raw.get("mlp_bias"):
    raise _unsupported(path, "mlp_bias", True, "the MLP has no biases")
  if not block.qkv_bias and raw.get("attention_bias"):
    # Llama's and Qwen3's attention_bias also adds an o_proj bias, which the model lacks.
    raise _unsupported(path, "attention_bias", True, "no output-projection bias")
  if raw.get("use_sliding_window"):
    raise _unsupported(path, "use_sliding_window", True, "full attention only")
  if (raw.get("attn_logit_softcapping") is not None
      and "attention.softcap" not in FAMILIES[family].hf_read(raw)):
    raise _unsupported(path, "attn_logit_softcapping", raw["attn_logit_softcapping"],
                       f"no attention-logit soft-capping in a {family} model")
  if raw.get("use_bidirectional_attention"):
    raise _unsupported(path, "use_bidirectional_attention", True, "causal attention only")
  if raw.get("partial_rotary_factor", 1.0) != 1.0:
    raise _unsupported(path, "partial_rotary_factor", raw["partial_rotary_factor"],
                       "RoPE over the whole head")
  _refuse_layer_types(raw, FAMILIES[family].hf_sliding_every, path)


def _refuse_layer_types(raw: dict, sliding_every: int, path: str) -> None:
  """`layer_types`: full attention only, or, for a family with sliding layers
  (`Family.hf_sliding_every`), a global layer every n-th and sliding ones between."""
  types = raw.get("layer_types") or []
  if not sliding_every:
    if any(t != "full_attention" for t in types):
      raise _unsupported(path, "layer_types", sorted(set(types)), "full attention only")
    return
  if not types:
    raise HFError(f"{path}: layer_types is missing")
  if types != layer_types(len(types), global_every(types)):
    raise _unsupported(path, "layer_types", types, "a global layer every n-th, sliding between")


def _refuse_moe(raw: dict, path: str) -> None:
  """Qwen3-MoE: every layer a routed MoE of plain experts (no dense layers, no shared expert)."""
  if raw.get("decoder_sparse_step", 1) != 1:
    raise _unsupported(path, "decoder_sparse_step", raw["decoder_sparse_step"],
                       "every layer a mixture of experts: 1 only")
  if raw.get("mlp_only_layers"):
    raise _unsupported(path, "mlp_only_layers", raw["mlp_only_layers"],
                       "every layer a mixture of experts: [] only")
  for key in ("shared_expert_intermediate_size", "n_shared_experts", "router_jitter_noise"):
    if raw.get(key):
      raise _unsupported(path, key, raw[key], "routed experts only, no shared expert or noise")
  if not (raw.get("num_experts") or raw.get("num_local_experts")):
    raise HFError(f"{path}: num_experts is missing")


def _rope_fields(raw: dict, path: str) -> dict:
  """ModelConfig's rope fields (dotted) from `rope_parameters` (transformers 5; per layer kind
  where there are sliding layers: the global layers' here) or `rope_theta` + `rope_scaling`
  (transformers 4; its older `type` key too)."""
  params = raw.get("rope_parameters") or {}
  params = params.get("full_attention", params)
  rope = {**(raw.get("rope_scaling") or {}), **params}
  kind = rope.get("rope_type", rope.get("type", "default"))
  out = {"rope.theta": float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0)))}
  if kind == "default":
    return out
  if kind == "linear":
    return {**out, "rope.scaling": "linear",
            "rope.factor": float(_require(rope, "factor", path))}
  if kind == "llama3":
    rope.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
    for field, key in _LLAMA3_KEYS.items():
      value = _require(rope, key, path)
      out[field] = int(value) if field == "rope.original_max_positions" else float(value)
    return {**out, "rope.scaling": "llama3"}
  raise _unsupported(path, "rope_type", kind, "default, linear or llama3")


def text_model(raw: dict, family: str) -> tuple[dict, str]:
  """(the language model's config.json fields, its tensors' name prefix): the file's own, or
  those a multimodal wrapper nests (`Family.hf_wrappers`), with the family's defaults for what
  it leaves out."""
  f = FAMILIES[family]
  key, prefix = f.hf_wrappers.get((raw.get("architectures") or [""])[0], (None, ""))
  if key is not None:
    tied = raw.get("tie_word_embeddings")
    raw = {**raw[key], "architectures": [f.hf_architecture]}
    raw.setdefault("tie_word_embeddings", tied)
  raw = {**f.hf_defaults, **{k: v for k, v in raw.items() if v is not None or k not in
                             f.hf_defaults}}
  if f.hf_sliding_every and not raw.get("layer_types"):  # (transformers 4: a pattern)
    every = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern",
                                                      f.hf_sliding_every))
    raw["layer_types"] = layer_types(raw["num_hidden_layers"], every)
  return raw, prefix


def tensor_prefix(hf_dir: str) -> str:
  """The prefix of the language model's tensor names in a checkpoint directory ("" but for a
  multimodal wrapper's)."""
  raw = read_json(os.path.join(hf_dir, "config.json"))
  return text_model(raw, _family(raw, os.path.join(hf_dir, "config.json")))[1]


def model_config_from_hf(hf_dir: str) -> ModelConfig:
  """The ModelConfig of a checkpoint directory of one of the FAMILIES (its config.json; a
  multimodal wrapper's text model); `hf_path` is `hf_dir`, `dtype` float32."""
  path = os.path.join(hf_dir, "config.json")
  raw = read_json(path)
  family = _family(raw, path)
  raw, _ = text_model(raw, family)
  _refuse_unsupported(raw, family, path)
  d_model = _require(raw, "hidden_size", path)
  n_heads = _require(raw, "num_attention_heads", path)
  try:
    return from_fields(dict(
        family=family, vocab_size=_require(raw, "vocab_size", path), d_model=d_model,
        n_layers=_require(raw, "num_hidden_layers", path), n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads,
        head_dim=raw.get("head_dim") or d_model // n_heads,
        d_ff=_require(raw, "intermediate_size", path),
        norm_eps=float(_require(raw, "rms_norm_eps", path)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)), scale_tied_head=False,
        hf_path=str(hf_dir), **_rope_fields(raw, path), **FAMILIES[family].hf_read(raw)))
  except ValueError as e:  # ModelConfig's own checks (e.g. heads vs kv heads)
    raise HFError(f"{path}: {e}") from None


def check_config(user: ModelConfig, hf: ModelConfig,
                 default: ModelConfig = ModelConfig()) -> ModelConfig:
  """`hf` with the user's fields (`USER_FIELDS`). An architecture field the user set (it differs
  from the schema's `default`) to something other than the checkpoint's value is an error."""
  where = os.path.join(hf.hf_path, "config.json")
  mine, theirs, defaults = fields(user), fields(hf), fields(default)
  for name in ARCH_FIELDS:
    if mine[name] != defaults[name] and mine[name] != theirs[name]:
      raise HFError(f"config.model.{name}: {mine[name]!r} contradicts {theirs[name]!r} in "
                    f"{where}")
  kept = {name: mine[name] for name in USER_FIELDS}
  try:
    return from_fields({**kept, "hf_path": user.hf_path or hf.hf_path}, base=hf)
  except ValueError as e:  # the user's fields with the checkpoint's (impl=xla with a score cap)
    raise HFError(f"config.model.{e} (with {where})") from None


def _rope_scaling(cfg: ModelConfig) -> dict | None:
  if cfg.rope.scaling == "linear":
    return {"rope_type": "linear", "factor": cfg.rope.factor}
  if cfg.rope.scaling == "llama3":
    flat = fields(cfg)
    return {"rope_type": "llama3", **{key: flat[field] for field, key in _LLAMA3_KEYS.items()}}
  return None


def default_max_positions(cfg: ModelConfig) -> int:
  """max_position_embeddings for an export: the source checkpoint's where there is one, else
  the scaled RoPE's context."""
  source = os.path.join(cfg.hf_path, "config.json") if cfg.hf_path else ""
  if source and os.path.exists(source):
    if (positions := read_json(source).get("max_position_embeddings")):
      return int(positions)
  factor = cfg.rope.factor if cfg.rope.scaling != "none" else 1.0
  return int(cfg.rope.original_max_positions * factor)


def hf_config_dict(cfg: ModelConfig, *, tied: bool, dtype: str, max_positions: int,
                   token_ids: dict) -> dict:
  """config.json for an export of `cfg` (`tied`: whether the files share the embedding as the
  LM head)."""
  scaling = _rope_scaling(cfg)
  family = FAMILIES[cfg.family]
  out = dict(
      architectures=[family.hf_architecture], model_type=family.hf_model_type or cfg.family,
      vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
      num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
      num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
      hidden_act=ACTIVATIONS[family.block.mlp_activation].hf,
      max_position_embeddings=max_positions, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope.theta,
      rope_scaling=scaling,
      rope_parameters={"rope_type": "default", **(scaling or {}), "rope_theta": cfg.rope.theta},
      tie_word_embeddings=tied, attention_dropout=0.0, initializer_range=0.02, use_cache=True,
      torch_dtype=dtype, dtype=dtype, **token_ids)
  if cfg.attention.sliding_window:  # per layer kind (transformers 5)
    out["rope_parameters"] = {"full_attention": out["rope_parameters"], "sliding_attention": {
        "rope_type": "default", "rope_theta": cfg.rope.local_theta}}
  out.update(family.hf_fields(cfg))
  for name, key, value in (("logit_softcap", "final_logit_softcapping", cfg.logit_softcap),
                           ("attention.softcap", "attn_logit_softcapping",
                            cfg.attention.softcap)):
    if value and out.get(key) != value:
      raise HFError(f"config.model.{name}: {value} has no field in a {family.hf_architecture} "
                    f"config.json ({key}); transformers would compute it uncapped")
  return out
