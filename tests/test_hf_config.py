"""Reading and checking Hugging Face config.json files: refusals name the file and the field."""
import dataclasses
import os

import pytest

from jaxrl.models.config import FIELDS, ModelConfig
from jaxrl.models.hf import HFError, check_config, model_config_from_hf
from jaxrl.models.hf_config import ARCH_FIELDS, USER_FIELDS, hf_config_dict

from hf_models import config_dir, one_line


@pytest.mark.parametrize("arch, changes, field", [
    ("llama", {"architectures": ["MistralForCausalLM"]}, "architectures"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope_type"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    # attention soft-capping in a family that does not read it (Gemma 3's does), another
    # activation, bidirectional attention, another layer pattern
    ("llama", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3", {"hidden_activation": "gelu"}, "hidden_activation"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("gemma3", {"architectures": ["Gemma2ForCausalLM"]}, "architectures"),
    # MoE variants the block does not compute: dense layers between, a shared expert, noise
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers"),
    ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ("qwen3_moe", {"architectures": ["Qwen2MoeForCausalLM"]}, "architectures"),
    ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window"),
])
def test_unsupported_configs_are_refused(tmp_path, arch, changes, field):
  path = config_dir(tmp_path, arch, **changes)
  with pytest.raises(HFError) as e:
    model_config_from_hf(path)
  one_line(e, os.path.join(path, "config.json"), field)


def test_every_model_field_is_classified():
  """check_config compares ARCH_FIELDS; a new ModelConfig field must say whether a checkpoint
  fixes it."""
  assert set(FIELDS) == set(ARCH_FIELDS) | set(USER_FIELDS)
  assert not set(ARCH_FIELDS) & set(USER_FIELDS)


def test_transformers4_spelling_reads_the_same(tmp_path):
  """rope_theta + rope_scaling (with the old `type` key) as transformers 4 writes them."""
  v5 = model_config_from_hf(config_dir(tmp_path, "llama"))
  legacy = dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64)
  path = config_dir(tmp_path / "v4", "llama", rope_parameters=None, rope_theta=10_000.0,
                     rope_scaling=legacy)
  assert model_config_from_hf(path) == dataclasses.replace(v5, hf_path=path)


def test_check_config(tmp_path):
  path = config_dir(tmp_path, "qwen2")
  hf = model_config_from_hf(path)
  with pytest.raises(HFError) as e:
    check_config(ModelConfig(d_model=256, hf_path=path), hf, ModelConfig())
  assert str(e.value) == f"config.model.d_model: 256 contradicts 64 in {path}/config.json"
  # Fields left at the schema default, or set to the checkpoint's value, take the checkpoint's.
  cfg = check_config(ModelConfig(d_model=64, dtype="bfloat16", hf_path=path), hf, ModelConfig())
  assert cfg == dataclasses.replace(hf, dtype="bfloat16")
  assert cfg.scale_tied_head is False and cfg.family == "qwen2" and cfg.block.qkv_bias


@pytest.mark.parametrize("cap", [None, 30.0])
def test_final_logit_softcapping_is_read_and_written_back(tmp_path, cap):
  """Gemma's final_logit_softcapping (null: none) is `logit_softcap`, and an export writes it
  back; a family whose config.json has no such field refuses to export soft-capped logits."""
  cfg = model_config_from_hf(config_dir(tmp_path, "gemma3", final_logit_softcapping=cap))
  assert cfg.logit_softcap == (cap or 0.0)
  out = hf_config_dict(cfg, tied=True, dtype="float32", max_positions=64, token_ids={})
  assert out["final_logit_softcapping"] == cap and out["attn_logit_softcapping"] is None
  llama = dataclasses.replace(model_config_from_hf(config_dir(tmp_path, "llama")),
                              logit_softcap=cap or 0.0)
  if cap:
    with pytest.raises(HFError) as e:
      hf_config_dict(llama, tied=True, dtype="float32", max_positions=64, token_ids={})
    one_line(e, "config.model.logit_softcap", "LlamaForCausalLM", "final_logit_softcapping")
  else:
    assert "final_logit_softcapping" not in hf_config_dict(llama, tied=True, dtype="float32",
                                                           max_positions=64, token_ids={})
