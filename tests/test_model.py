import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import LanguageModel, ModelConfig, RewardModel, ValueModel, init_kv_cache
from jaxrl.models.config import from_fields
from jaxrl.models.layouts import FEATURES
from jaxrl.models.lora import LoRAConfig
from jaxrl.models.rope import rope_table
from jaxrl.models.rope import positions_from_valid
from model_checks import assert_decoding_matches_forward, forward_batch, perturbed


def _forward(model, tokens_BT, valid_BT=None):
  valid_BT = jnp.ones(tokens_BT.shape, bool) if valid_BT is None else valid_BT
  return model(tokens_BT, positions_from_valid(valid_BT), valid_BT)[0]


def test_forward_shapes(tiny_cfg):
  tokens_BT = jnp.zeros((3, 5), jnp.int32)
  valid_BT = jnp.ones((3, 5), bool)
  pos_BT = positions_from_valid(valid_BT)
  lm = LanguageModel(tiny_cfg, rngs=nnx.Rngs(0))
  logits_BTV, cache = lm(tokens_BT, pos_BT, valid_BT)
  assert logits_BTV.shape == (3, 5, tiny_cfg.vocab_size) and logits_BTV.dtype == jnp.float32
  assert cache is None
  assert ValueModel(tiny_cfg, rngs=nnx.Rngs(0))(tokens_BT, pos_BT, valid_BT).shape == (3, 5)
  assert RewardModel(tiny_cfg, rngs=nnx.Rngs(0))(tokens_BT, pos_BT, valid_BT).shape == (3,)


def test_untied_head_and_bf16(tiny_cfg):
  cfg = ModelConfig(**{**tiny_cfg.__dict__, "tie_embeddings": False, "dtype": "bfloat16"})
  model = LanguageModel(cfg, rngs=nnx.Rngs(0))
  tokens_BT = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
  logits_BTV = _forward(model, tokens_BT)
  assert logits_BTV.shape == (2, 6, cfg.vocab_size)
  ref = _forward(LanguageModel(ModelConfig(**{**cfg.__dict__, "dtype": "float32"}),
                               rngs=nnx.Rngs(0)), tokens_BT)
  np.testing.assert_allclose(logits_BTV, ref, atol=0.1)  # bf16 compute stays close to fp32
  assert model.lm_head.shape == (cfg.vocab_size, cfg.d_model)


def test_bad_model_config():
  with pytest.raises(ValueError, match="dtype: expected one of"):
    ModelConfig(dtype="float16")
  with pytest.raises(ValueError, match="n_kv_heads"):
    ModelConfig(n_heads=4, n_kv_heads=3)


def test_causal_masking(tiny_model):
  rng = np.random.default_rng(0)
  tokens_BT = jnp.asarray(rng.integers(0, 256, (2, 9)), jnp.int32)
  changed_BT = tokens_BT.at[:, 6].set((tokens_BT[:, 6] + 1) % 256)
  a, b = _forward(tiny_model, tokens_BT), _forward(tiny_model, changed_BT)
  np.testing.assert_array_equal(a[:, :6], b[:, :6])
  assert not np.allclose(a[:, 6:], b[:, 6:])


def test_left_padding_does_not_change_logits(tiny_model):
  tokens_T = jnp.asarray([257, 49, 50, 43, 51, 61], jnp.int32)
  alone = _forward(tiny_model, tokens_T[None])
  padded_BT = jnp.concatenate([jnp.full((1, 3), 256, jnp.int32), tokens_T[None]], axis=1)
  valid_BT = padded_BT != 256
  np.testing.assert_allclose(_forward(tiny_model, padded_BT, valid_BT)[:, 3:], alone, atol=1e-5)


def test_kv_cache_decode_matches_full_forward(tiny_model, tiny_cfg):
  rng = np.random.default_rng(1)
  b, p, n = 2, 5, 6
  tokens_BT = jnp.asarray(rng.integers(0, 256, (b, p + n)), jnp.int32)
  valid_BT = jnp.ones((b, p + n), bool).at[0, :2].set(False)  # row 0 is left-padded
  full_BTV = tiny_model(tokens_BT, positions_from_valid(valid_BT), valid_BT)[0]
  pos_BT = positions_from_valid(valid_BT)
  cache = init_kv_cache(tiny_cfg, b, p + n)
  logits, cache = tiny_model(tokens_BT[:, :p], pos_BT[:, :p], valid_BT, cache, 0)
  steps = [logits]
  for i in range(p, p + n):
    logits, cache = tiny_model(tokens_BT[:, i:i + 1], pos_BT[:, i:i + 1], valid_BT, cache, i)
    steps.append(logits)
  cached_BTV = jnp.concatenate(steps, axis=1)
  np.testing.assert_allclose(cached_BTV[1], full_BTV[1], atol=1e-4)
  np.testing.assert_allclose(cached_BTV[0, 2:], full_BTV[0, 2:], atol=1e-4)


def test_sampler_paths_match_the_model(tiny_model, tiny_cfg):
  """The sampler's prefill (`last_only`) and its feature-major decode step against the model."""
  b, p, n = 3, 5, 4
  (tokens_BT, pos_BT, valid_BT), full_BTV = forward_batch(tiny_model, b, p + n, seed=2)
  prefill = lambda last_only: tiny_model.decoder(tokens_BT[:, :p], pos_BT[:, :p], valid_BT,
                                                 init_kv_cache(tiny_cfg, b, p + n), 0,
                                                 last_only=last_only)
  (h_BPD, want_cache), (h_B1D, cache) = prefill(False), prefill(True)
  assert h_B1D.shape == (b, 1, tiny_cfg.d_model)
  np.testing.assert_allclose(h_B1D[:, 0], h_BPD[:, -1], atol=1e-5)
  for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(want_cache)):
    np.testing.assert_array_equal(got, want)
  for i in range(p, p + n):  # the forward itself, feature-major (the CPU's decode layout)
    sin_B1H, cos_B1H = rope_table(pos_BT[:, i:i + 1], tiny_cfg)
    h_DB, cache = tiny_model.decoder(tokens_BT[:, i], (sin_B1H[:, 0], cos_B1H[:, 0]), valid_BT,
                                     cache, i, layout=FEATURES)
    logits_BV = FEATURES.logits(h_DB, tiny_model.head_VD(), tiny_cfg.logit_softcap)
    np.testing.assert_allclose(logits_BV, full_BTV[:, i], atol=1e-4)


def test_params_carry_logical_axes(tiny_model):
  _, state = nnx.split(tiny_model)
  leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  for v in leaves:
    axes = v.get_metadata()["logical_axes"]
    assert len(axes) == v.ndim


VARIANTS = {
    "qwen2": dict(family="qwen2", tie_embeddings=False),
    "qwen3": dict(family="qwen3", head_dim=16, scale_tied_head=False),
    "llama3": {"rope.scaling": "llama3", "rope.factor": 8.0, "rope.original_max_positions": 16},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS) + ["lora"])
def test_decoding_protocol_matches_forward(tiny_cfg, variant):
  """The sampler's decoding view (`LMDecoding`) (prefill + one-token steps, both layouts) against the full
  forward, for each architecture variant, with biases and norm scales made non-trivial (and
  "lora": LoRA adapters on every projection of a Qwen2-style model, B away from zero)."""
  lora = LoRAConfig(rank=4, alpha=8.0) if variant == "lora" else None
  cfg = from_fields(VARIANTS["qwen2" if lora else variant], base=tiny_cfg)
  assert_decoding_matches_forward(nnx.merge(*perturbed(cfg, lora)))
