"""Gemma 3 checkpoints against transformers (float32 torch as the reference, as in
tests/test_hf.py): a multimodal one's language model loads; soft-capped logits."""
import dataclasses
import json
import os

import numpy as np
import torch
import transformers
from flax import nnx

from jaxrl.models.hf import load_params, model_config_from_hf
from jaxrl.models.hf_export import export
from jaxrl.models.transformer import LanguageModel
from train.roles.role import ModelRole

from hf_models import ARCHS, COMMON, batch, jax_logits, randomise, sized_mesh, torch_logits


def test_multimodal_gemma3_checkpoint_loads_its_language_model(tmp_path):
  """A Gemma3ForConditionalGeneration directory (the 4B to 27B checkpoints: a vision tower
  beside the language model, whose tensors are under `language_model.` and whose config is
  nested in `text_config`, listing only what differs from Gemma3TextConfig's defaults): the
  language model loads, its logits equal the multimodal model's on text, and the vision
  tensors are left alone."""
  common = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}  # (the default: 4)
  text = transformers.Gemma3TextConfig(
      **{**common, "initializer_range": 0.05}, head_dim=16, sliding_window=4,
      layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24)
  vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=2,
                                           image_size=28, patch_size=14)
  torch.manual_seed(0)
  model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
      text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
      image_token_index=255, boi_token_index=253, eoi_token_index=254))
  randomise(model, seed=1)
  model.eval()
  path = str(tmp_path / "gemma3-mm")
  model.save_pretrained(path)
  raw = json.load(open(os.path.join(path, "config.json")))
  defaults = transformers.Gemma3TextConfig().to_dict()
  raw["text_config"] = {k: v for k, v in raw["text_config"].items()
                        if k == "model_type" or defaults.get(k) != v}
  assert "num_key_value_heads" not in raw["text_config"]  # (a default of the hub's 4B too)
  json.dump(raw, open(os.path.join(path, "config.json"), "w"))
  cfg = model_config_from_hf(path)
  assert (cfg.family, cfg.n_layers, cfg.n_kv_heads, cfg.attention.sliding_window, cfg.attention.global_every,
          cfg.attention.query_scale, cfg.vocab_size) == ("gemma3", 2, 4, 4, 2, 24.0, 256)
  role = ModelRole("actor", lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)), sized_mesh())
  params = load_params(path, cfg, role.abstract())
  tokens_BT, valid_BT, positions_BT = batch()
  tokens_BT = np.minimum(tokens_BT, 252)  # no image token
  want_BTV = torch_logits(model, tokens_BT, valid_BT, positions_BT)
  got_BTV = jax_logits(role, params, tokens_BT, valid_BT, positions_BT)
  np.testing.assert_allclose(got_BTV[valid_BT], want_BTV[valid_BT], atol=1e-4, rtol=0)


def test_soft_capped_gemma3_matches_torch_and_exports_its_cap(tmp_path):
  """final_logit_softcapping (Gemma 2's, which Gemma 3's code applies too): the imported model's
  logits equal transformers' with the cap at 2, where the uncapped logits reach past 3 (so a cap
  left out fails), and an export writes it back."""
  hf_cfg = ARCHS["gemma3"]()
  hf_cfg.final_logit_softcapping = 2.0
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager")
  randomise(model, seed=1)
  model.eval()
  path = str(tmp_path / "capped")
  model.save_pretrained(path)
  cfg = model_config_from_hf(path)
  assert (cfg.family, cfg.logit_softcap) == ("gemma3", 2.0)
  role = ModelRole("actor", lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)), sized_mesh())
  params = load_params(path, cfg, role.abstract())
  tokens_BT, valid_BT, positions_BT = batch()
  want_BTV = torch_logits(model, tokens_BT, valid_BT, positions_BT)
  got_BTV = jax_logits(role, params, tokens_BT, valid_BT, positions_BT)
  np.testing.assert_allclose(got_BTV[valid_BT], want_BTV[valid_BT], atol=1e-4, rtol=0)
  model.config.final_logit_softcapping = None
  assert np.abs(torch_logits(model, tokens_BT, valid_BT, positions_BT)[valid_BT]).max() > 3
  export(params, cfg, str(tmp_path / "out"))
  out = json.load(open(tmp_path / "out" / "config.json"))
  assert out["final_logit_softcapping"] == 2.0
  assert model_config_from_hf(str(tmp_path / "out")) == dataclasses.replace(
      cfg, hf_path=str(tmp_path / "out"))
