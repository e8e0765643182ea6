"""Tiny random Hugging Face model configs shared by the transformers parity tests."""
import json
import os

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from jaxrl.models.rope import positions_from_valid

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=128, rms_norm_eps=1e-5,
              max_position_embeddings=512, initializer_range=0.2)
ARCHS = {
    # transformers 4's keywords, which 5 still takes (and saves as rope_parameters).
    "llama": lambda: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=True, rope_theta=10_000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64)),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=False, rope_theta=1e6),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
    # 8 experts, 2 per token, renormalised: the router's choices differ between tokens.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, head_dim=16, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True),
    # A local (sliding-window) layer, then a global one: a window of 4 over 12 positions, the
    # local layers' own RoPE base, linear scaling on the global ones, a query scale of its own.
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**COMMON, "initializer_range": 0.05}, head_dim=16, tie_word_embeddings=True,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
        rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e4),
                         "sliding_attention": dict(rope_type="default", rope_theta=1e3)}),
}


def config_dir(tmp_path, arch: str, **changes) -> str:
  path = str(tmp_path / f"{arch}-config")
  ARCHS[arch]().save_pretrained(path)
  with open(os.path.join(path, "config.json")) as f:
    raw = json.load(f)
  name = ARCHS[arch]().__class__.__name__.replace("TextConfig", "Config")  # (Gemma3TextConfig)
  raw["architectures"] = [name.replace("Config", "ForCausalLM")]
  raw.update(changes)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(raw, f)
  return path


def one_line(excinfo, *words) -> str:
  msg = str(excinfo.value)
  assert "\n" not in msg and all(w in msg for w in words), msg
  return msg


def sized_mesh():
  """A (data, fsdp, tensor) mesh over all devices: 2 x 2 x 2 on the 8 CPU devices; on a real
  machine tensor 2 where the count is even, fsdp 2 where it is a multiple of 4, the rest data."""
  import jax
  from sharding.mesh import make_mesh
  n = len(jax.devices())
  tensor = 2 if n % 2 == 0 else 1
  fsdp = 2 if n % 4 == 0 else 1
  return make_mesh({"data": n // (tensor * fsdp), "fsdp": fsdp, "tensor": tensor})


# Rows of one batch, left-padded: valid lengths (every row ends at the last position).
LENGTHS, T = (12, 9, 5, 12), 12


def randomise(model: torch.nn.Module, seed: int) -> None:
  """Norm scales away from 1 and biases away from 0, so their paths are tested."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
      elif name.endswith("bias"):
        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def batch():
  rng = np.random.default_rng(0)
  tokens_BT = rng.integers(3, 256, (len(LENGTHS), T)).astype(np.int32)
  valid_BT = np.arange(T)[None, :] >= T - np.asarray(LENGTHS)[:, None]
  tokens_BT[~valid_BT] = 0
  return tokens_BT, valid_BT, np.array(positions_from_valid(jnp.asarray(valid_BT)))


def torch_logits(model, tokens_BT, valid_BT, positions_BT) -> np.ndarray:
  with torch.no_grad():
    out = model(torch.as_tensor(tokens_BT, dtype=torch.long),
                attention_mask=torch.as_tensor(valid_BT, dtype=torch.long),
                position_ids=torch.as_tensor(positions_BT, dtype=torch.long))
  return out.logits.numpy()


def jax_logits(role, params, tokens_BT, valid_BT, positions_BT) -> np.ndarray:
  fwd = role.jit(lambda p, *a: nnx.merge(role.graphdef, p)(*a)[0])
  return np.asarray(fwd(params, tokens_BT, positions_BT, valid_BT))
