"""The mixture-of-experts block: the grouped product against the dense one-hot form, experts
sharded over devices, routing replay, the router's losses and the config's refusals."""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import ExperimentConfig
from jaxrl.config_rl import EnvironmentConfig, RLConfig, RolloutConfig
from jaxrl.models.config import ModelConfig, MoEConfig, from_fields
from jaxrl.models.lora import LoRAConfig
from jaxrl.models.moe import (aux_losses, blocked_experts, dense_experts, grouped_experts,
                              route, split_experts)
from jaxrl.partitioning import activation_rules
from jaxrl.models.transformer import LanguageModel
from jaxrl.models.rope import positions_from_valid
from sharding.mesh import make_mesh, param_shardings
from sharding.rules import SAMPLER_RULES
from train.roles.role import ModelRole

CFG = ModelConfig(family="qwen3_moe", d_ff=64,
                  moe=MoEConfig(experts=8, per_token=2, d_ff=32, norm_topk=True))


def _batch(b: int = 4, t: int = 10):
  tokens_BT = jax.random.randint(jax.random.key(1), (b, t), 0, CFG.vocab_size)
  valid_BT = jnp.arange(t)[None] >= jnp.array([0, 3, 5, 0])[:b, None]
  return tokens_BT, positions_from_valid(valid_BT), valid_BT


@pytest.mark.parametrize("experts", [grouped_experts, functools.partial(blocked_experts, block=8)],
                         ids=["ragged", "blocked"])
def test_grouped_products_equal_the_dense_one_hot_form(experts):
  """Outputs and gradients (input, weights, router weights) agree in float32; the blocked form
  with runs that do not fill their blocks."""
  keys = jax.random.split(jax.random.key(0), 5)
  x_RD = jax.random.normal(keys[0], (40, 16))
  router_ED = jax.random.normal(keys[1], (8, 16))
  w = [jax.random.normal(k, s) * 0.3 for k, s in zip(keys[2:], [(8, 24, 16), (8, 24, 16),
                                                                  (8, 16, 24)])]

  def out(experts, x, router, *w):
    ids, weights, *_ = route(x, router, 3, True)
    return experts(x, ids, weights, *w, jax.nn.silu)
  loss = lambda experts: jax.grad(lambda *a: (out(experts, *a) ** 2).sum(), argnums=(0, 1, 2, 4))
  np.testing.assert_allclose(out(experts, x_RD, router_ED, *w),
                             out(dense_experts, x_RD, router_ED, *w), atol=1e-5)
  for g, d in zip(loss(experts)(x_RD, router_ED, *w), loss(dense_experts)(x_RD, router_ED, *w)):
    np.testing.assert_allclose(g, d, atol=1e-4, rtol=1e-5)


def test_experts_sharded_over_four_devices_give_the_unsharded_result():
  """Experts' width split 4 ways over the tensor axis (and the batch over data): the logits of
  the unsharded model, 1e-5."""
  cfg = dataclasses.replace(CFG, n_kv_heads=4)  # (the KV heads split 4 ways too)
  tokens_BT, positions_BT, valid_BT = _batch()
  want = LanguageModel(cfg, rngs=nnx.Rngs(0))(tokens_BT, positions_BT, valid_BT)[0]
  role = ModelRole("actor", lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)),
                   make_mesh({"data": 2, "tensor": 4})).initialize()
  w_gate = role.params["decoder"]["blocks"][0]["mlp"]["w_gate"][...]
  assert {s.data.shape[:2] for s in w_gate.addressable_shards} == {(8, 8)}  # width 32 / 4
  fwd = role.jit(lambda p, *a: nnx.merge(role.graphdef, p)(*a)[0])
  got = fwd(role.params, tokens_BT, positions_BT, valid_BT)
  np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("table", [(("expert", "tensor"),), (("mlp", "tensor"),)],
                         ids=["by_expert", "by_width"])
def test_split_experts_equal_the_unsplit_products_with_one_all_reduce(table):
  """Experts split over 4 devices by expert or by width: every form's outputs and gradients are
  the unsplit ones, and the compiled step's only collectives are all-reduces of [R, D] (and of
  [R, k] or [R, E], the routing weights' gradient; left to the compiler, the blocked form
  all-reduced its gathered weights)."""
  keys = jax.random.split(jax.random.key(0), 5)
  x_RD, router_ED = jax.random.normal(keys[0], (48, 16)), jax.random.normal(keys[1], (8, 16))
  w = [jax.random.normal(k, s) * 0.3 for k, s in zip(keys[2:], [(8, 24, 16), (8, 24, 16),
                                                                  (8, 16, 24)])]
  mesh = make_mesh({"tensor": 4}, jax.devices()[:4])
  for impl in ("ragged", "blocked", "dense"):
    def loss(x, router, *w):
      ids, weights, *_ = route(x, router, 3, True)
      return (split_experts(impl, x, ids, weights, *w, jax.nn.silu) ** 2).sum()
    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 4))
    want = value_and_grad(x_RD, router_ED, *w)
    with activation_rules(mesh, table):
      step = jax.jit(value_and_grad)
      got = step(x_RD, router_ED, *w)
      hlo = step.lower(x_RD, router_ED, *w).compile().as_text()
    for g, d in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, d, atol=2e-4, rtol=1e-5)
    collectives = re.findall(r"= (.+?) (all-gather|all-reduce|all-to-all|reduce-scatter|"
                             r"collective-permute)(?:-start)?\(", hlo)
    shapes = {(s, op) for types, op in collectives for s in re.findall(r"\w+\[[\d,]*\]", types)}
    assert ("f32[48,16]", "all-reduce") in shapes, (impl, collectives)
    routing = {("f32[48,3]", "all-reduce"), ("f32[48,8]", "all-reduce")}  # [R, k] or [R, E]
    assert shapes <= {("f32[48,16]", "all-reduce")} | routing, (impl, collectives)


def test_routing_replay_uses_the_recorded_experts_and_trains_the_router():
  """Replayed: the recorded experts are used (-1: routed here), the router still gets a
  gradient; not replayed: they are only compared (`replay_differs`)."""
  model = LanguageModel(from_fields({"moe.routing_replay": "rollout"}, base=CFG),
                        rngs=nnx.Rngs(0))
  tokens_BT, positions_BT, valid_BT = _batch()
  h, _, routing = model.decoder.forward(tokens_BT, positions_BT, valid_BT)
  assert routing.ids.shape == (4, 10, CFG.n_layers, 2)
  same, _, replayed = model.decoder.forward(tokens_BT, positions_BT, valid_BT,
                                            routes_BTLK=routing.ids)
  np.testing.assert_array_equal(same, h)
  np.testing.assert_array_equal(replayed.ids, routing.ids)
  assert float(replayed.replay_differs.max()) == 0.0
  other_BTLK = (routing.ids + 1) % CFG.moe.experts
  moved, _, differs = model.decoder.forward(tokens_BT, positions_BT, valid_BT,
                                            routes_BTLK=other_BTLK)
  assert float(jnp.abs(moved - h).max()) > 1e-3
  np.testing.assert_allclose(differs.replay_differs, 1.0)
  unrecorded, _, _ = model.decoder.forward(tokens_BT, positions_BT, valid_BT,
                                           routes_BTLK=jnp.full_like(other_BTLK, -1))
  np.testing.assert_array_equal(unrecorded, h)

  def loss(model):
    out, _, _ = model.decoder.forward(tokens_BT, positions_BT, valid_BT, routes_BTLK=other_BTLK)
    return (out ** 2).sum()
  router_grad = nnx.grad(loss)(model).decoder.blocks[0].mlp.router[...]
  assert float(jnp.abs(router_grad).max()) > 0
  compared = LanguageModel(CFG, rngs=nnx.Rngs(0))  # routing_replay="off"
  own, _, seen = compared.decoder.forward(tokens_BT, positions_BT, valid_BT,
                                          routes_BTLK=other_BTLK)
  np.testing.assert_array_equal(own, h)
  np.testing.assert_allclose(seen.replay_differs, 1.0)


def test_router_losses():
  """Balance: 1 for uniform load and probabilities, E when all goes to one expert; only valid
  tokens count."""
  uniform = jnp.full((2, 4), 0.25)
  balance, z = aux_losses(uniform, uniform, jnp.array([1.0, 3.0]))
  assert float(balance) == pytest.approx(1.0) and float(z) == pytest.approx(2.0)
  one = jnp.array([[1.0, 0, 0, 0]])
  assert float(aux_losses(one, one, jnp.zeros(1))[0]) == pytest.approx(4.0)
  model = LanguageModel(CFG, rngs=nnx.Rngs(0))
  tokens_BT, positions_BT, valid_BT = _batch()
  _, _, routing = model.decoder.forward(tokens_BT, positions_BT, valid_BT)
  np.testing.assert_allclose(routing.load_E.sum(-1), 1.0, rtol=1e-6)
  np.testing.assert_allclose(routing.prob_E.sum(-1), 1.0, rtol=1e-5)
  # Padding changes nothing: the padded tokens' routing is left out.
  padded = jnp.where(valid_BT, tokens_BT, 7)
  _, _, again = model.decoder.forward(padded, positions_BT, valid_BT)
  np.testing.assert_allclose(again.load_E, routing.load_E, atol=1e-6)


@pytest.mark.parametrize("model, lora, words", [
    ({"family": "llama", "moe.experts": 8, "moe.per_token": 2, "moe.d_ff": 32}, None,
     ["moe.experts", "dense family"]),
    ({"family": "qwen3_moe"}, None, ["moe.experts", "> 0"]),
    ({"moe.per_token": 9}, None, ["moe.per_token", "1 to experts=8"]),
    ({"moe.d_ff": 0}, None, ["moe.d_ff"]),
    ({}, LoRAConfig(rank=4), ["lora.targets", "w_down,w_gate,w_up"]),
    ({"family": "qwen3", "moe.experts": 0, "moe.routing_replay": "rollout"}, None,
     ["moe.routing_replay", "experts=0"]),
])
def test_bad_moe_configs_are_refused(model, lora, words):
  base = ModelConfig() if model.get("family") in ("llama", "qwen3_moe") else CFG
  with pytest.raises(ValueError) as e:
    ExperimentConfig(model=from_fields(model, base=base), lora=lora or LoRAConfig())
  assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)


def test_replay_with_multi_turn_rollouts_is_refused():
  model = from_fields({"moe.routing_replay": "rollout"}, base=CFG)
  with pytest.raises(ValueError, match="model.moe.routing_replay: multi-turn"):
    ExperimentConfig(model=model, rl=RLConfig(environment=EnvironmentConfig(name="calculator")))
  ExperimentConfig(
      model=model,
      rl=RLConfig(rollout=RolloutConfig(inflight_slots=8)))  # the in-flight engine records


def test_lora_on_the_attention_of_an_moe():
  cfg = ExperimentConfig(model=CFG, lora=LoRAConfig(rank=4, targets="wq,wv"))
  model = LanguageModel(cfg.model, rngs=nnx.Rngs(0), lora=cfg.lora)
  assert hasattr(model.decoder.blocks[0].attn, "wq_lora")
  tokens_BT, positions_BT, valid_BT = _batch()
  base = LanguageModel(dataclasses.replace(cfg.model), rngs=nnx.Rngs(0))
  np.testing.assert_allclose(model(tokens_BT, positions_BT, valid_BT)[0],
                             base(tokens_BT, positions_BT, valid_BT)[0], atol=1e-5)


def test_both_engines_record_the_experts_the_trainer_picks():
  """The static engine's and the in-flight sampler's recorded routes agree (the in-flight one
  on a data 2 x tensor 2 mesh, the experts' width split), and equal the trainer's own routing
  of the same tokens (float32; -1 where the static engine routed nothing: the prefill's last
  layer before the last prompt token, the final token)."""
  from sampler.engine import generate
  from sampler.methods import SamplingConfig
  from sampler.sampler import Sampler
  graphdef, params = nnx.split(LanguageModel(CFG, rngs=nnx.Rngs(0)))
  tokens_BP = jax.random.randint(jax.random.key(3), (4, 6), 3, CFG.vocab_size)
  valid_BP = jnp.arange(6)[None] >= jnp.array([0, 2, 0, 4])[:, None]
  cfg = SamplingConfig(max_new_tokens=5, eos_id=-1, pad_id=0, method="greedy")
  static = jax.jit(functools.partial(generate, graphdef, cfg=cfg))(params, tokens_BP, valid_BP,
                                                                   jax.random.key(0))
  mesh = make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4])
  shardings = param_shardings(params, SAMPLER_RULES, mesh)
  inflight = Sampler(graphdef, cfg, inflight_slots=4, mesh=mesh, param_shardings=shardings
                     ).generate(jax.device_put(params, shardings), tokens_BP, valid_BP,
                                jax.random.key(0))
  np.testing.assert_array_equal(inflight.tokens_BT, static.tokens_BT)
  routes, valid = np.asarray(static.routes_BTLK), np.asarray(static.valid_BT)
  assert routes.shape == (4, 11, CFG.n_layers, 2)
  assert (routes[:, -1] == -1).all() and (routes[:, :5, -1] == -1).all()  # not routed
  assert (routes[:, 5:-1] >= 0).all()
  both = valid[:, :, None, None] & (routes >= 0)  # (in flight, the last token is routed too)
  np.testing.assert_array_equal(np.asarray(inflight.routes_BTLK)[both], routes[both])
  model = nnx.merge(graphdef, params)
  _, _, own = model.decoder.forward(static.tokens_BT, positions_from_valid(static.valid_BT),
                                    static.valid_BT)
  recorded = valid[:, :, None, None] & (routes >= 0)
  np.testing.assert_array_equal(np.sort(np.asarray(own.ids), -1)[recorded[..., 0]],
                                np.sort(routes, -1)[recorded[..., 0]])
