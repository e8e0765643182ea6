"""Model families from their `FAMILIES` entry alone (jaxrl/models/families.py), as
docs/architecture.md's "Where to change what" says: a family with one of Gemma's block
behaviours and none of the others, and a family with soft-capped logits (its entry and the
config.json key it reads), built, decoded and scored like the families that exist."""
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.data.tokenizer import ByteTokenizer
from jaxrl.models.families import FAMILIES, BlockOptions, Family
from jaxrl.models.hf import model_config_from_hf
from jaxrl.models.hf_config import hf_config_dict
from jaxrl.models.transformer import LanguageModel
from sampler.engine import generate
from sampler.methods import SamplingConfig
from model_checks import assert_decoding_matches_forward, perturbed
from train.updates.forward import completion_logprobs

# Gemma's four behaviours, one at a time
ONE_OPTION = {"norm_offset": dict(norm_offset=True), "sandwich_norms": dict(sandwich_norms=True),
              "gelu_tanh": dict(mlp_activation="gelu_tanh"),
              "scale_embedding": dict(scale_embedding=True)}




@pytest.mark.parametrize("option", sorted(ONE_OPTION))
def test_a_family_with_one_gemma_block_option(tiny_cfg, monkeypatch, option):
  """A test-local family with only `option`: its model decodes as it runs forward, and the
  option is in effect (the same weights under Llama's blocks give other logits; sandwich norms
  add their own weights)."""
  name = f"only_{option}"
  monkeypatch.setitem(FAMILIES, name, Family("OnlyForCausalLM",
                                             BlockOptions(**ONE_OPTION[option])))
  cfg = dataclasses.replace(tiny_cfg, family=name)
  assert cfg.block == BlockOptions(**ONE_OPTION[option])
  graphdef, params = perturbed(cfg)
  logits_BTV, batch = assert_decoding_matches_forward(nnx.merge(graphdef, params))
  llama_graphdef, llama_params = nnx.split(LanguageModel(tiny_cfg, rngs=nnx.Rngs(0)))
  if option == "sandwich_norms":
    sandwich = {"post_attn_norm", "post_mlp_norm"}
    assert sandwich <= set(params["decoder"]["blocks"][0])
    assert not sandwich & set(llama_params["decoder"]["blocks"][0])
  else:
    llama_BTV = nnx.merge(llama_graphdef, params)(*batch)[0]
    assert float(jnp.abs(llama_BTV - logits_BTV).max()) > 1e-2


def _capped_family() -> Family:
  """What a family with soft-capped logits adds: its entry, reading (and writing back) the
  config.json key Hugging Face names the cap by."""
  return Family("CappedForCausalLM",
                hf_read=lambda raw: dict(
                    logit_softcap=float(raw.get("final_logit_softcapping") or 0.0)),
                hf_fields=lambda cfg: dict(final_logit_softcapping=cfg.logit_softcap or None))


def _sample(graphdef, params, prompts, layout: str):
  tok = ByteTokenizer()
  tokens, valid = tok.pad_left([tok.encode(p, bos=True) for p in prompts], 8)
  cfg = SamplingConfig(max_new_tokens=6, eos_id=-1, pad_id=tok.pad_id, method="temperature",
                       temperature=1.0, decode_layout=layout)
  fn = jax.jit(functools.partial(generate, graphdef, cfg=cfg))
  return fn(params, jnp.asarray(tokens), jnp.asarray(valid), jax.random.key(0))


@pytest.mark.parametrize("layout", ["features", "rows"])
def test_a_family_with_soft_capped_logits_needs_only_its_entry(tmp_path, monkeypatch, layout):
  """A FAMILIES entry whose `hf_read` takes final_logit_softcapping, and nothing else: a
  checkpoint's config.json naming its architecture gives a model whose sampled tokens'
  log-probs equal the trainer's (the LM head applies `logit_softcap` for both), other than the
  uncapped model's; its export writes the cap back."""
  monkeypatch.setitem(FAMILIES, "capped", _capped_family())
  raw = dict(architectures=["CappedForCausalLM"], vocab_size=264, hidden_size=32,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             intermediate_size=64, rms_norm_eps=1e-6, rope_theta=10_000.0,
             tie_word_embeddings=True, final_logit_softcapping=1.0)
  (tmp_path / "config.json").write_text(json.dumps(raw))
  cfg = model_config_from_hf(str(tmp_path))
  assert (cfg.family, cfg.logit_softcap) == ("capped", 1.0)
  graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  rollout = _sample(graphdef, params, ["12+34=", "7+5=", "rev ab="], layout)
  logp_BN, _ = completion_logprobs(graphdef, params, rollout.tokens_BT, rollout.valid_BT, 8)
  np.testing.assert_allclose(logp_BN, rollout.logprobs_BN, atol=1e-4)
  uncapped = nnx.split(LanguageModel(dataclasses.replace(cfg, logit_softcap=0.0),
                                     rngs=nnx.Rngs(0)))[0]
  logp_uncapped, _ = completion_logprobs(uncapped, params, rollout.tokens_BT, rollout.valid_BT,
                                         8)
  assert float(jnp.abs(logp_uncapped - logp_BN).max()) > 0.1
  out = hf_config_dict(cfg, tied=True, dtype="float32", max_positions=64, token_ids={})
  assert (out["architectures"], out["final_logit_softcapping"]) == (["CappedForCausalLM"], 1.0)
