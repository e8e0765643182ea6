"""A bf16 model's weights cast once per update (not per micro-batch), and a frozen reference held
in bf16, compute what the float32 weights cast at every product compute."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core import jaxprs_in_params
from jax.sharding import Mesh

from jaxrl.models import LanguageModel, ModelConfig
from jaxrl.models.dtypes import compute_dtypes
from train.roles.role import ModelRole
from train.updates.batching import accumulate_grads, compute_copy
from train.updates.forward import completion_logprobs

CFG = ModelConfig(vocab_size=96, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12,
                  d_ff=80, dtype="bfloat16", family="qwen2")  # no two shapes alike


def _batch(b=8, t=10, p=4):  # no activation shares a weight's shape
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, t)), jnp.int32)
  valid = jnp.asarray(np.arange(t)[None] >= rng.integers(0, 3, (b, 1)))
  return tokens, valid, p


def _loop_casts(jaxpr, shapes, in_loop=False) -> int:
  """float32 -> bfloat16 conversions of arrays of `shapes` inside `jaxpr`'s loops."""
  count = 0
  for eqn in jaxpr.eqns:
    if (in_loop and eqn.primitive.name == "convert_element_type"
        and eqn.invars[0].aval.dtype == jnp.float32 and eqn.outvars[0].aval.dtype == jnp.bfloat16
        and eqn.invars[0].aval.shape in shapes):
      count += 1
    for sub in jaxprs_in_params(eqn.params):
      count += _loop_casts(sub, shapes, in_loop or eqn.primitive.name in ("scan", "while"))
  return count


@pytest.mark.parametrize("tie,scale", [(True, True), (True, False)])  # jaxrl's head, HF's
def test_compute_copy_casts_once_and_keeps_the_gradient(tie, scale):
  """The micro-batch loop reads weights cast before it (no per-micro-batch convert); the
  gradient is float32, each micro-batch's rounded as a bf16 product's gradient is (as
  PyTorch autocast does), so it matches the per-product casts' to bf16 precision."""
  cfg = dataclasses.replace(CFG, tie_embeddings=tie, scale_tied_head=scale)
  graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  tokens, valid, p = _batch()

  def loss_fn(params, micro):
    tokens_BT, valid_BT = micro
    logp_BN, ent_BN = completion_logprobs(graphdef, params, tokens_BT, valid_BT, p)
    return (logp_BN * valid_BT[:, p:]).sum() + 0.1 * ent_BN.sum(), {}

  def grads(params, cast: bool):
    start = compute_copy(graphdef, params) if cast else params
    return accumulate_grads(loss_fn, start, (tokens, valid), 2)

  shapes = set()  # of the decoder layers' matrices (the embedding's [V, D] also appears as the
  # tied head's gradient, which the log-prob VJP returns in the head's dtype)
  jax.tree.map(lambda x, d: d and shapes.add(x.shape), params["decoder"]["blocks"],
               compute_dtypes(cfg, params["decoder"]["blocks"]))
  per_call, once = (jax.make_jaxpr(functools.partial(grads, cast=c))(params).jaxpr
                    for c in (False, True))
  assert _loop_casts(per_call, shapes) > 0 and _loop_casts(once, shapes) == 0
  (loss_a, _, g_a), (loss_b, _, g_b) = (jax.jit(grads, static_argnums=1)(params, c)
                                        for c in (False, True))
  assert {x.dtype for x in jax.tree.leaves(g_b)} == {np.dtype("float32")}
  np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g_a), jax.tree.leaves(g_b)):
    np.testing.assert_allclose(b, a, atol=2**-7 * float(np.abs(a).max()), rtol=0)


def test_a_bf16_reference_scores_as_its_float32_weights():
  cfg = dataclasses.replace(CFG, scale_tied_head=False)  # HF-style: the head is the embedding
  mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  make = lambda: LanguageModel(cfg, rngs=nnx.Rngs(0))
  actor = ModelRole("actor", make, mesh).initialize()
  ref = ModelRole("reference", make, mesh, stored_dtypes=functools.partial(compute_dtypes, cfg))
  ref.load(actor.params)
  dtypes = {x.dtype for x in jax.tree.leaves(ref.params) if x.ndim > 1}
  assert dtypes == {np.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(ref.params) if x.ndim == 1} == {np.dtype("float32")}
  held = lambda params: sum(x.nbytes for x in jax.tree.leaves(params))
  assert held(ref.params) < 0.55 * held(actor.params)
  tokens, valid, p = _batch()
  score = jax.jit(lambda params: completion_logprobs(actor.graphdef, params, tokens, valid,
                                                           p))
  for a, b in zip(score(actor.params), score(ref.params)):
    np.testing.assert_array_equal(a, b)
