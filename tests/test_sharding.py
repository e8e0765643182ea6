import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import LanguageModel
from jaxrl.models.rope import positions_from_valid
from jaxrl.partitioning import activation_rules, logical_to_spec
from sharding.mesh import make_mesh, param_specs
from sharding.rules import SAMPLER_RULES, TRAIN_RULES

from sharded_init import init_sharded

CFG = ModelConfig(vocab_size=264, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  d_ff=128)


def test_logical_to_spec_drops_absent_and_size_one_axes():
  mesh = make_mesh({"fsdp": 4, "tensor": 2})
  assert logical_to_spec(("embed", "mlp"), TRAIN_RULES, mesh) == P("fsdp", "tensor")
  assert logical_to_spec(("batch", None), TRAIN_RULES, mesh) == P("fsdp", None)
  assert logical_to_spec(("embed", "mlp"), SAMPLER_RULES, mesh) == P(None, "tensor")
  assert logical_to_spec(("head_dim",), TRAIN_RULES, mesh) == P(None)


def test_large_matrices_are_sharded_in_the_train_layout():
  mesh = make_mesh({"fsdp": 8})
  _, state, _ = init_sharded(lambda: LanguageModel(CFG, rngs=nnx.Rngs(0)), TRAIN_RULES, mesh)
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    if leaf.size >= 4096:
      shard = leaf.addressable_shards[0].data
      assert shard.size * 8 == leaf.size, (jax.tree_util.keystr(path), leaf.sharding.spec)


def test_mesh_size_mismatch_is_reported():
  with pytest.raises(ValueError, match="needs 6 devices, but 8 are available"):
    make_mesh({"fsdp": 3, "tensor": 2})


def test_indivisible_dimension_is_reported():
  mesh = make_mesh({"fsdp": 8})
  cfg = ModelConfig(vocab_size=264, d_model=36, n_heads=2, n_kv_heads=1, head_dim=18, d_ff=64)
  abstract = nnx.state(nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0))))
  with pytest.raises(ValueError, match="dimension 36 is not divisible by mesh axis fsdp=8"):
    param_specs(abstract, TRAIN_RULES, mesh)


@pytest.mark.parametrize("shape,rules", [({"fsdp": 8}, TRAIN_RULES),
                                         ({"fsdp": 4, "tensor": 2}, TRAIN_RULES),
                                         ({"data": 4, "tensor": 2}, SAMPLER_RULES)])
def test_sharded_forward_equals_single_device(shape, rules):
  model = LanguageModel(CFG, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  tokens_BT = jnp.asarray(rng.integers(0, 256, (8, 12)), jnp.int32)
  valid_BT = jnp.ones((8, 12), bool).at[:3, :2].set(False)
  want = model(tokens_BT, positions_from_valid(valid_BT), valid_BT)[0]

  mesh = make_mesh(shape)
  graphdef, state, _ = init_sharded(lambda: LanguageModel(CFG, rngs=nnx.Rngs(0)), rules, mesh)

  @jax.jit
  def forward(state, tokens_BT, valid_BT):
    with activation_rules(mesh, rules):
      return nnx.merge(graphdef, state)(tokens_BT, positions_from_valid(valid_BT), valid_BT)[0]

  got = forward(state, tokens_BT, valid_BT)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
