"""Run-state checkpoints restore into any layout; keep-N plus the best; init_checkpoint errors
name the directory; the fingerprint tells bit-identical weights apart."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import LanguageModel
from sharding.mesh import make_mesh
from sharding.rules import SAMPLER_RULES, TRAIN_RULES
from train.io.checkpoint import RunCheckpointer, load_actor_params, params_fingerprint

from sharded_init import init_sharded


def _save_actor(tmp_path, tiny_cfg, steps=(7,)):
  make = lambda: LanguageModel(tiny_cfg, rngs=nnx.Rngs(0))
  _, params, _ = init_sharded(make, TRAIN_RULES, make_mesh({"fsdp": 4}, jax.devices()[:4]))
  ckpt = RunCheckpointer(str(tmp_path), ["sft"], keep=2)
  for step in steps:
    ckpt.save("sft", step, {"actor": nnx.to_pure_dict(params)}, {"stage": "sft", "done": step},
              metrics={"heldout_acc": {3: 0.9, 5: 0.1}.get(step, 0.5)})
  ckpt.close()
  return params


def test_restore_into_another_layout_and_errors(tmp_path, tiny_cfg):
  params = _save_actor(tmp_path, tiny_cfg)
  # Into a tensor-parallel layout on the other four devices.
  _, like, shardings = init_sharded(lambda: LanguageModel(tiny_cfg, rngs=nnx.Rngs(1)),
                                    SAMPLER_RULES, make_mesh({"data": 2, "tensor": 2},
                                                             jax.devices()[4:]))
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like,
                          shardings)
  restored, step = load_actor_params(str(tmp_path / "checkpoints" / "sft"), abstract)
  assert step == 7
  for a, b, s in zip(jax.tree.leaves(params), jax.tree.leaves(restored), jax.tree.leaves(shardings)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert b.sharding == s
  assert params_fingerprint(restored) == params_fingerprint(params)
  assert params_fingerprint(like) != params_fingerprint(params)
  with pytest.raises(ValueError, match="config.init_checkpoint: no such directory"):
    load_actor_params(str(tmp_path / "nope"), abstract)
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="config.init_checkpoint: no checkpoint under"):
    load_actor_params(str(tmp_path / "empty"), abstract)
  other = ModelConfig(**{**tiny_cfg.__dict__, "d_model": 48})
  _, wrong, _ = init_sharded(lambda: LanguageModel(other, rngs=nnx.Rngs(1)), TRAIN_RULES,
                             make_mesh({"fsdp": 4}, jax.devices()[:4]))
  with pytest.raises(ValueError, match=r"does not fit this model: decoder/blocks/0/attn/wk is "
                     r"\(2, 8, 32\) there, \(2, 8, 48\) here"):
    load_actor_params(str(tmp_path / "checkpoints" / "sft"), wrong)


def test_keeps_the_last_k_and_the_best(tmp_path, tiny_cfg):
  _save_actor(tmp_path, tiny_cfg, steps=(1, 2, 3, 4, 5, 6))  # step 3 has the best accuracy
  ckpt = RunCheckpointer(str(tmp_path), ["sft"], keep=2)
  assert ckpt.saved() == [("sft", 6), ("sft", 5), ("sft", 3)]
  assert ckpt.read_meta("sft", 5) == {"stage": "sft", "done": 5}
  ckpt.close()


def test_fingerprint_sees_one_changed_bit(tiny_cfg):
  _, params = nnx.split(LanguageModel(tiny_cfg, rngs=nnx.Rngs(0)))
  changed = jax.tree.map(lambda x: x, params)
  w = changed["decoder"]["embed"][...]
  bits = np.asarray(w).view(np.uint32).copy()
  bits[0, 0] ^= 1
  changed["decoder"]["embed"][...] = jnp.asarray(bits.view(np.float32))
  assert params_fingerprint(changed) != params_fingerprint(params)
