"""The scanned decoder (`model.layers.scan`, jaxrl/models/scan.py) against the unrolled one of
the same seed: the same weights, and float32 forward, gradient, prefill and cached decode equal
to 1e-5 for every family (Gemma 3's local and global layers with a tail after the last whole
period, a mixture of experts with its routes replayed) and under remat."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import scan
from jaxrl.models.config import ModelConfig, from_fields
from jaxrl.models.decoding import LMDecoding
from jaxrl.models.transformer import LanguageModel
from jaxrl.models.rope import positions_from_valid

from model_checks import per_layer

BASE = dict(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48)
FAMILIES = {
    "llama": ModelConfig(**BASE),
    "qwen2": ModelConfig(**BASE, family="qwen2"),
    "gemma3": from_fields({**BASE, "n_layers": 5, "family": "gemma3",
                           "attention.sliding_window": 3, "attention.global_every": 2}),
    # (periods of 2 layers, then a local layer)
    "qwen3_moe": from_fields({**BASE, "family": "qwen3_moe", "moe.experts": 4, "moe.per_token": 2,
                              "moe.d_ff": 16, "moe.routing_replay": "rollout"}),
}


def _models(cfg: ModelConfig):
  unrolled = LanguageModel(cfg, rngs=nnx.Rngs(3))
  return unrolled, LanguageModel(from_fields({"layers.scan": True}, base=cfg), rngs=nnx.Rngs(3))


def _flat(state) -> dict:
  return {tuple(p): v[...] if isinstance(v, nnx.Variable) else v
          for p, v in nnx.to_flat_state(state)}


def _assert_close(a: dict, b: dict, atol=1e-5):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), atol=atol, rtol=1e-5,
                               err_msg=str(k))


def _batch(b=2, t=7):
  tokens = jax.random.randint(jax.random.key(1), (b, t), 0, BASE["vocab_size"])
  valid = jnp.ones((b, t), bool).at[0, :2].set(False)  # a left-padded row
  return tokens, valid


@pytest.mark.parametrize("family", list(FAMILIES))
def test_scanned_and_unrolled_decoders_agree(family):
  unrolled, scanned = _models(FAMILIES[family])
  cfg = scanned.cfg
  _, u_state = nnx.split(unrolled)
  graphdef, s_state = nnx.split(scanned)
  _assert_close(_flat(u_state), per_layer(_flat(s_state), cfg.n_layers), atol=0)
  assert scanned.decoder.blocks.attn.wq.get_metadata()["logical_axes"][0] == scan.LAYERS
  tokens, valid = _batch()
  positions = positions_from_valid(valid)

  def loss(model, routes=None):
    h, _, routing = model.decoder.forward(tokens, positions, valid, routes_BTLK=routes)
    return (model.logits(h) * jnp.cos(jnp.arange(cfg.vocab_size))).sum(), routing

  (u_loss, u_routing), u_grads = nnx.value_and_grad(loss, has_aux=True)(unrolled)
  (s_loss, s_routing), s_grads = nnx.value_and_grad(loss, has_aux=True)(scanned)
  np.testing.assert_allclose(s_loss, u_loss, rtol=1e-5)
  _assert_close(_flat(u_grads), per_layer(_flat(s_grads), cfg.n_layers))
  if cfg.moe.experts:  # the routes recorded, then replayed: the same experts either way
    np.testing.assert_array_equal(s_routing.ids, u_routing.ids)
    replayed = [jax.jit(loss)(m, u_routing.ids)[0] for m in (unrolled, scanned)]
    np.testing.assert_allclose(replayed[1], replayed[0], rtol=1e-5)
  # prefill into a cache, a cached decode step in each layout, a kept cache extended
  outs = []
  for model in (unrolled, scanned):
    dec = LMDecoding.of(model)
    logits, cache, routes = dec.prefill(tokens, valid)
    got = [logits, routes]
    sin, cos = dec.rope(positions[:, -1:] + 1)
    step_valid = jnp.concatenate([valid, jnp.ones((2, 1), bool)], axis=1)
    for layout in ("rows", "features"):
      nxt, stepped, step_routes = dec.decode_fn(layout)(
          tokens[:, -1], (sin[:, 0], cos[:, 0]), step_valid, dec.grow_cache(cache, 8), 7)
      got += [nxt, step_routes]
    got.append(dec.extend(tokens[:, :2], jnp.ones((2, 2), bool), step_valid.sum(1), stepped,
                          step_valid)[0])
    outs.append([g for g in got if g is not None])
  for u, s in zip(*outs):
    np.testing.assert_allclose(s, u, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_every_engine_decodes_a_scanned_model_as_the_unrolled_one(family):
  """The stacked KV cache (attention.StackedLayer) in the static engine, in-flight slots and a
  conversation's kept cache (sampler/requests.py): the unrolled model's tokens, log-probs and
  experts."""
  from sampler.methods import SamplingConfig
  from sampler.requests import Request
  from sampler.sampler import Sampler
  sampling = SamplingConfig(max_new_tokens=5, eos_id=-1, pad_id=0, method="greedy")
  tokens, valid = _batch(4, 7)
  key, key_data = jax.random.key(0), np.asarray(jax.random.key_data(jax.random.key(1)))
  runs = []
  for model in _models(FAMILIES[family]):
    graphdef, params = nnx.split(model)
    static = Sampler(graphdef, sampling).generate(params, tokens, valid, key)
    slots = Sampler(graphdef, sampling, inflight_slots=2)
    rollout = slots.generate(params, tokens, valid, key)
    engine, turns = slots.requests(params, context_width=16), []
    context = (5, 6, 7)
    for index in range(2):  # a turn, then one continued in the slot that kept its cache
      engine.submit(Request("a", context, 4, key_data, index))
      while not (done := [(ids, logp) for t, ids, logp, _ in engine.poll() if t == "a"]):
        engine.advance()
      turns += [np.asarray(done[0][0]), np.asarray(done[0][1])]
      context += tuple(done[0][0]) + (9,)
    assert engine.stats["continued"] == 1
    runs.append([static.tokens_BT, static.logprobs_BN, rollout.tokens_BT, rollout.logprobs_BN,
                 *turns] + ([static.routes_BTLK, rollout.routes_BTLK] if family == "qwen3_moe"
                            else []))
  for u, s in zip(*runs):
    np.testing.assert_allclose(np.asarray(s), np.asarray(u), atol=1e-5, rtol=1e-5)


def test_a_scanned_update_under_remat_matches_the_unrolled_one():
  cfg = from_fields({"layers.remat": "dots"}, base=FAMILIES["llama"])
  grads = []
  tokens, valid = _batch()
  for model in _models(cfg):
    fn = lambda m: m.logits(m.decoder(tokens, positions_from_valid(valid), valid)[0]).std()
    grads.append(_flat(nnx.grad(fn)(model)))
  _assert_close(grads[0], per_layer(grads[1], cfg.n_layers))


def test_lora_adapters_scan_and_merge_as_the_unrolled_ones():
  """Adapters stacked with their layers: the same forward, and merged into the base (the
  sampler's push) the same weights."""
  from jaxrl.models import lora
  cfg = dict(rank=2, alpha=4.0, targets="wq,wv,w_up")
  models = [LanguageModel(from_fields({"layers.scan": s}, base=FAMILIES["llama"]), rngs=nnx.Rngs(3),
                          lora=lora.LoRAConfig(**cfg)) for s in (False, True)]
  tokens, valid = _batch()
  for m in models:  # B starts at zero: give the adapters a value
    for _, v in nnx.to_flat_state(nnx.state(m, nnx.LoRAParam)):
      v[...] = v[...] + 0.1
  outs = [m.logits(m.decoder(tokens, positions_from_valid(valid), valid)[0]) for m in models]
  np.testing.assert_allclose(outs[1], outs[0], atol=1e-5, rtol=1e-5)
  merged = [_flat(lora.merged(*nnx.split(m))) for m in models]
  _assert_close(merged[0], per_layer(merged[1], 3))
  peft = [lora.peft_tensors(*nnx.split(m)) for m in models]
  _assert_close(peft[0], peft[1], atol=0)


def test_checkpoints_restore_into_either_form(tmp_path):
  """A run dir saved by an unrolled model resumes a scanned one and the other way round (every
  item holding a decoder, an optimizer's moments too: converted on the devices), and
  `init_checkpoint` loads across forms; the fingerprint does not depend on the form."""
  from train.io import layer_forms
  from train.io.checkpoint import RunCheckpointer, load_actor_params, params_fingerprint
  models = _models(FAMILIES["llama"])
  states = [nnx.state(m, nnx.Param) for m in models]
  assert params_fingerprint(states[0]) == params_fingerprint(states[1])
  device = jax.devices()[0]
  abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(device)), tree)
  for i, (saved, wanted) in enumerate([(0, 1), (1, 0)]):
    pure = [nnx.to_pure_dict(s) for s in states]
    items = {"actor": pure[saved], "opt": {"mu": pure[saved]}}
    ckpt = RunCheckpointer(str(tmp_path / str(i)), ["rl"])
    ckpt.save("rl", 3, items, {"step": 3})
    ckpt.wait()
    want = {"actor": abstract(pure[wanted]), "opt": {"mu": abstract(pure[wanted])}}
    got = ckpt.restore("rl", 3, want)
    ckpt.close()
    for tree in (got["actor"], got["opt"]["mu"]):
      flat = {tuple(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}
      expected = {tuple(p): x for p, x in jax.tree_util.tree_leaves_with_path(pure[wanted])}
      assert layer_forms.form(tree) == layer_forms.form(pure[wanted])
      _assert_close(flat, expected, atol=0)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(device)), states[wanted])
    loaded, step = load_actor_params(str(tmp_path / str(i) / "checkpoints" / "rl"), like)
    assert step == 3 and params_fingerprint(loaded) == params_fingerprint(states[wanted])
