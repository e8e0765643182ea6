"""The memory model (planner/footprint.py, through the dry run's `update_footprint`)
against XLA's own count: the temporary bytes of the real RL update, compiled by its Learner for
three small configs, allocating nothing.

XLA's `temp_size_in_bytes` is everything the update allocates beyond its arguments and outputs
(the donated state aliases them): gradients, the optimizer's update, activations, log-prob
logits, gathered weights; the estimate counts the same things. The tolerance stays at 25%: when
a model change moves the measured bytes, re-fit footprint.py's per-token counts (the
coefficients at its top), not this bound.
"""
import dataclasses
import functools
import os

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from train.preflight.dry_run import shard_bytes, update_footprint
from train.preflight.target_compile import abstract_experience
from jaxrl.config import DataConfig, ExperimentConfig
from jaxrl.config_rl import BatchingConfig, KLConfig, RLConfig, RolloutConfig
from jaxrl.models.config import from_fields
from jaxrl.models.transformer import LanguageModel
from sharding.rules import MESH_AXES
from train.roles.learner import Learner
from train.roles.role import ModelRole
from train.updates.policy import policy_update
from train.updates.state import make_optimizer

ROOT = __file__.rsplit("/tests/", 1)[0]


def _config(model: dict, *, prompt: int, new: int, rollouts: int, **batching) -> ExperimentConfig:
  heads = dict(n_heads=4, n_kv_heads=2, head_dim=model["d_model"] // 4, d_ff=4 * model["d_model"])
  return ExperimentConfig(
      model=from_fields({**heads, **model}), data=DataConfig(max_prompt_tokens=prompt),
      rl=RLConfig(prompts_per_step=rollouts // 2, group_size=2,
                  rollout=RolloutConfig(max_new_tokens=new), kl=KLConfig(coef=0.05),
                  batching=BatchingConfig(**batching)))


CONFIGS = {  # the per-device rows of one pass, the remat and the fsdp degree all differ
    "d128x4, 128 tokens, fsdp 2, no remat": (
        _config(dict(d_model=128, n_layers=4), prompt=64, new=64, rollouts=16,
                num_minibatches=2), 2),
    "d256x2, 96 tokens, micro-batches, dots": (
        _config({"d_model": 256, "n_layers": 2, "layers.remat": "dots"}, prompt=32, new=64, rollouts=16,
                num_minibatches=1, micro_batch_size=4), 1),
    "d64x6, 256 tokens, 2048 vocab, full": (
        _config({"d_model": 64, "n_layers": 6, "vocab_size": 2048, "layers.remat": "full"}, prompt=128,
                new=128, rollouts=8, num_minibatches=1), 1),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_update_estimate_is_within_a_quarter_of_xla(name):
  cfg, fsdp = CONFIGS[name]
  mesh = Mesh(np.array(jax.devices()[:fsdp]).reshape(1, fsdp, 1), MESH_AXES)
  role = ModelRole("actor", lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(0)), mesh)
  learner = Learner(role, functools.partial(policy_update, cfg=cfg.rl),
                    make_optimizer(1e-5), initialize=False)
  xla = learner.lower(abstract_experience(cfg, role)).compile().memory_analysis().temp_size_in_bytes
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(role.abstract()))
  on_device0 = shard_bytes(role.abstract(), 4)[mesh.devices.flat[0].id]
  estimate = sum(update_footprint(cfg, mesh, role.rules, on_device0, params).values())
  print(f"{name}: estimate {estimate / 1e6:.1f} MB, XLA {xla / 1e6:.1f} MB")
  assert estimate == pytest.approx(xla, rel=0.25)


def test_remat_and_micro_batches_shrink_the_estimate():
  """The model's direction, without XLA: every remat saves, and a micro-batch saves more than
  its gradient accumulator costs on an activation-bound update."""
  cfg, _ = CONFIGS["d128x4, 128 tokens, fsdp 2, no remat"]
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), MESH_AXES)
  role = ModelRole("actor", lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(0)), mesh)
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(role.abstract()))
  peak = lambda c: sum(update_footprint(c, mesh, role.rules, 4 * params, params).values())
  with_remat = lambda r: dataclasses.replace(cfg, model=from_fields({"layers.remat": r},
                                                                    base=cfg.model))
  assert peak(with_remat("full")) < peak(with_remat("dots")) < peak(cfg)
  micro = lambda rows: dataclasses.replace(cfg, rl=dataclasses.replace(
      cfg.rl, batching=dataclasses.replace(cfg.rl.batching, micro_batch_size=rows)))
  assert peak(micro(2)) < peak(cfg)
  # one micro-batch per minibatch is no accumulation: the same program as none
  whole = cfg.rl.rollouts // cfg.rl.batching.num_minibatches
  assert peak(micro(whole)) == peak(cfg)


def _llama8b_lora(layers: int = 4) -> ExperimentConfig:
  """configs/llama3_1_8b_gsm8k_lora.py (bf16, rank 16, remat dots, 16 rows x 768 tokens per
  pass) with `layers` of its 32 layers and CPU attention ([T, T] scores: no cuDNN here)."""
  from train.cli.flags import load_config_file
  from jaxrl.config_files import resolve
  raw = load_config_file(os.path.join(ROOT, "configs", "llama3_1_8b_gsm8k_lora.py"))
  raw.model.update(n_layers=layers)
  raw.model.attention.update(impl="xla")
  raw.rl.update(prompts_per_step=2)
  raw.rl.batching.update(num_minibatches=1)
  return resolve(raw, hf=False)


@pytest.mark.parametrize("name", list(CONFIGS)[:2] + ["Llama-3.1-8B LoRA config, 4 layers"])
def test_lora_update_estimate_is_within_a_quarter_of_xla(name):
  """The same updates training rank-8 adapters on a frozen base (lora.rank > 0): gradients and
  optimizer updates of the adapters alone, activations as before; and the 8B LoRA config's
  update at its real widths (all 32 layers: XLA 37.2 GiB, the estimate 30.7: docs/lora.md)."""
  from jaxrl.models import lora
  from jaxrl.models.dtypes import frozen_base_dtypes
  if name in CONFIGS:
    cfg, fsdp = CONFIGS[name]
    cfg = dataclasses.replace(cfg, lora=lora.LoRAConfig(rank=8))
  else:
    cfg, fsdp = _llama8b_lora(), 1
  mesh = Mesh(np.array(jax.devices()[:fsdp]).reshape(1, fsdp, 1), MESH_AXES)
  role = ModelRole("actor", lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(0), lora=cfg.lora),
                   mesh, stored_dtypes=functools.partial(frozen_base_dtypes, cfg.model),
                   trainable=lora.TRAINABLE)
  learner = Learner(role, functools.partial(policy_update, cfg=cfg.rl),
                    make_optimizer(1e-5), initialize=False)
  xla = learner.lower(abstract_experience(cfg, role)).compile().memory_analysis().temp_size_in_bytes
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(role.abstract()))
  trained = shard_bytes(role.split(role.abstract())[0], 4)[mesh.devices.flat[0].id]
  estimate = sum(update_footprint(cfg, mesh, role.rules, trained, params).values())
  print(f"{name} + LoRA: estimate {estimate / 1e6:.1f} MB, XLA {xla / 1e6:.1f} MB")
  assert estimate == pytest.approx(xla, rel=0.25)
