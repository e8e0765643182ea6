"""Checkpoints restore into any layout; `init_checkpoint` errors name the directory."""
import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.models.llama import LanguageModel, ModelConfig
from sharding.mesh import init_sharded, make_mesh
from sharding.rules import SAMPLER_RULES, TRAIN_RULES
from train.checkpoint import Checkpointer, load_params


def test_restore_into_another_layout_and_errors(tmp_path, tiny_cfg):
  make = lambda: LanguageModel(tiny_cfg, rngs=nnx.Rngs(0))
  _, params, _ = init_sharded(make, TRAIN_RULES, make_mesh({"fsdp": 4}, jax.devices()[:4]))
  ckpt = Checkpointer(str(tmp_path), "sft", 1)
  ckpt.save(7, params)
  ckpt.close()
  # Into a tensor-parallel layout on the other four devices.
  _, like, shardings = init_sharded(lambda: LanguageModel(tiny_cfg, rngs=nnx.Rngs(1)), SAMPLER_RULES,
                                    make_mesh({"data": 2, "tensor": 2}, jax.devices()[4:]))
  restored, step = load_params(str(tmp_path / "checkpoints" / "sft"), like)
  assert step == 7
  for a, b, s in zip(jax.tree.leaves(params), jax.tree.leaves(restored), jax.tree.leaves(shardings)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert b.sharding == s
  with pytest.raises(ValueError, match="config.init_checkpoint: no such directory"):
    load_params(str(tmp_path / "nope"), like)
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="config.init_checkpoint: no checkpoint under"):
    load_params(str(tmp_path / "empty"), like)
  other = ModelConfig(**{**tiny_cfg.__dict__, "d_model": 48})
  _, wrong, _ = init_sharded(lambda: LanguageModel(other, rngs=nnx.Rngs(1)), TRAIN_RULES,
                             make_mesh({"fsdp": 4}, jax.devices()[:4]))
  with pytest.raises(ValueError, match=r"does not fit this model: decoder/blocks/0/attn/wk is "
                     r"\(2, 8, 32\) there, \(2, 8, 48\) here"):
    load_params(str(tmp_path / "checkpoints" / "sft"), wrong)
