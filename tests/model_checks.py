"""Model checks that several test files run on their models."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models.decoding import LMDecoding
from jaxrl.models.transformer import LanguageModel
from jaxrl.models.rope import positions_from_valid


def perturbed(cfg, lora=None):
  """A model of `cfg` with every parameter moved off its init (norm scales, offsets too)."""
  graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0), lora=lora))
  keys = iter(jax.random.split(jax.random.key(3), 100))
  return graphdef, jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape),
                                params)


def forward_batch(model, b: int, t: int, seed: int):
  """`b` random rows of `t` tokens, row 0 left-padded by 2, and the model's full forward over
  them: (tokens_BT, pos_BT, valid_BT), logits_BTV."""
  rng = np.random.default_rng(seed)
  tokens_BT = jnp.asarray(rng.integers(0, 256, (b, t)), jnp.int32)
  valid_BT = jnp.ones((b, t), bool).at[0, :2].set(False)
  pos_BT = positions_from_valid(valid_BT)
  return (tokens_BT, pos_BT, valid_BT), model(tokens_BT, pos_BT, valid_BT)[0]


def assert_decoding_matches_forward(model):
  """The sampler's prefill and one-token steps (both layouts) against the full forward."""
  b, p, n = 2, 5, 4
  (tokens_BT, pos_BT, valid_BT), full_BTV = forward_batch(model, b, p + n, seed=4)
  dec = LMDecoding.of(model)
  logits_BV, cache, _ = dec.prefill(tokens_BT[:, :p], valid_BT[:, :p])
  np.testing.assert_allclose(logits_BV, full_BTV[:, p - 1], atol=1e-4)
  sin_BTH, cos_BTH = dec.rope(pos_BT)
  for layout in ("rows", "features"):
    step_cache, step = dec.grow_cache(cache, p + n), jax.jit(dec.decode_fn(layout))
    for i in range(p, p + n):
      logits_BV, step_cache, _ = step(tokens_BT[:, i], (sin_BTH[:, i], cos_BTH[:, i]),
                                      valid_BT, step_cache, i)
      np.testing.assert_allclose(logits_BV, full_BTV[:, i], atol=1e-4, err_msg=layout)
  return full_BTV, (tokens_BT, pos_BT, valid_BT)


def per_layer(flat: dict, n_layers: int) -> dict:
  """A flat {path tuple: array} of a scanned model (`model.layers.scan`) under the unrolled
  model's names: each stacked `decoder/blocks/...` leaf split along axis 0 into
  `decoder/blocks/{i}/...`."""
  from jaxrl.models.scan import layer_keys, stacked_keys
  out = {}
  for path, value in flat.items():
    if not stacked_keys(tuple(path)):
      out[path] = value
      continue
    for i in range(n_layers):
      out[layer_keys(path, i)] = value[i]
  return out
