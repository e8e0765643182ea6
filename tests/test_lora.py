"""LoRA (jaxrl/models/lora.py): adapters that start as a no-op, fold into the base exactly, and
export as merged Hugging Face weights or a PEFT adapter directory that peft loads."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx
from tests.hf_models import ARCHS

from jaxrl.models import lora
from jaxrl.models.config import AttentionConfig, ModelConfig
from jaxrl.models.hf import HFError, load_params, model_config_from_hf
from jaxrl.models.hf_export import export, export_peft
from jaxrl.models.lora import LoRAConfig
from jaxrl.models.transformer import LanguageModel
from jaxrl.models.rope import positions_from_valid
from sharding.mesh import make_mesh
from train.roles.role import ModelRole

LORA = LoRAConfig(rank=4, alpha=8.0)


def _batch(vocab: int = 256):
  rng = np.random.default_rng(0)
  tokens_BT = rng.integers(3, vocab, (3, 10)).astype(np.int32)
  valid_BT = np.arange(10)[None, :] >= np.array([[0], [3], [6]])
  return tokens_BT, valid_BT, np.asarray(positions_from_valid(jnp.asarray(valid_BT)))


def _logits(graphdef, params, batch):
  tokens_BT, valid_BT, positions_BT = batch
  return np.asarray(nnx.merge(graphdef, params)(tokens_BT, positions_BT, valid_BT)[0])


def _perturbed(adapters, seed: int = 1, scale: float = 0.05):
  """Adapters with B (and A) moved off their start: what training does."""
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(adapters))))
  return jax.tree.map(lambda x: x + scale * jax.random.normal(next(keys), x.shape), adapters)


@pytest.mark.parametrize("model", [ModelConfig(), ModelConfig(family="qwen2", tie_embeddings=False),
                                   ModelConfig(family="qwen3", tie_embeddings=False),
                                   ModelConfig(family="gemma3", scale_tied_head=False,
                                               attention=AttentionConfig(sliding_window=4,
                                                                         global_every=2))],
                         ids=["tied", "qwen2", "qwen3", "gemma3"])
def test_adapters_start_as_the_base_model(model):
  """Rank-r adapters on every target: the base weights are the plain model's (the adapters
  draw from a stream of their own) and the logits are the same (B = 0), to float32 rounding:
  on a CPU the frozen MLP multiplies [out, in] directly, the trained one through a transpose
  (layouts.dense)."""
  base_graph, base = nnx.split(LanguageModel(model, rngs=nnx.Rngs(3)))
  graph, params = nnx.split(LanguageModel(model, rngs=nnx.Rngs(3), lora=LORA))
  adapters, frozen = lora.split(params)
  assert len(jax.tree.leaves(adapters)) == 2 * len(lora.TARGETS) * model.n_layers
  for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(base)):
    np.testing.assert_array_equal(a, b)
  batch = _batch(model.vocab_size)
  # (Gemma's norms after each sublayer rescale its output, and the rounding difference with it)
  tol = 1e-5 if model.block.sandwich_norms else 1e-6
  np.testing.assert_allclose(_logits(graph, params, batch), _logits(base_graph, base, batch),
                             atol=tol, rtol=tol)
  moved = nnx.merge_state(_perturbed(adapters), frozen)
  assert np.abs(_logits(graph, moved, batch) - _logits(base_graph, base, batch)).max() > 1e-3


def test_targets_choose_the_projections():
  cfg = LoRAConfig(rank=2, targets="wq,w_down")
  _, params = nnx.split(LanguageModel(ModelConfig(), rngs=nnx.Rngs(0), lora=cfg))
  names = {str(p[-2]) for p, _ in nnx.to_flat_state(lora.split(params)[0])}
  assert names == {"wq_lora", "w_down_lora"}
  for bad, words in [(dict(rank=-1), "rank"), (dict(rank=2, targets="wq,q_proj"), "targets"),
                     (dict(rank=2, alpha=0.0), "alpha")]:
    with pytest.raises(ValueError, match=words):
      LoRAConfig(**bad)


def test_merged_weights_give_the_adapted_logits():
  """W + (alpha / r) B A in the plain model = the adapted model, to 1e-5."""
  model = ModelConfig(family="qwen2")
  base_graph, _ = nnx.split(LanguageModel(model, rngs=nnx.Rngs(0)))
  graph, params = nnx.split(LanguageModel(model, rngs=nnx.Rngs(0), lora=LORA))
  adapters, frozen = lora.split(params)
  params = nnx.merge_state(_perturbed(adapters), frozen)
  batch = _batch(model.vocab_size)
  merged = jax.jit(lambda p: lora.merged(graph, p))(params)
  want = _logits(graph, params, batch)
  np.testing.assert_allclose(_logits(base_graph, merged, batch), want, atol=1e-5, rtol=0)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def adapted(request, tmp_path_factory):
  """A saved torch model, and a jaxrl LoRA model on its weights with adapters moved off zero."""
  arch = request.param
  torch.manual_seed(0)
  base = transformers.AutoModelForCausalLM.from_config(ARCHS[arch](), attn_implementation="eager")
  base.eval()
  path = str(tmp_path_factory.mktemp(arch))
  base.save_pretrained(path)
  cfg = model_config_from_hf(path)
  mesh = make_mesh({}, devices=jax.devices()[:1])
  role = ModelRole("actor", lambda: LanguageModel(cfg, rngs=nnx.Rngs(0), lora=LORA), mesh,
                   trainable=lora.TRAINABLE)
  frozen = load_params(path, cfg, role.split(role.abstract())[1])
  adapters, frozen = role.split(role.with_fresh_trained(frozen))
  return dict(path=path, cfg=cfg, role=role, torch=base,
              params=nnx.merge_state(_perturbed(adapters), frozen))


def _torch_logits(model, batch):
  tokens_BT, valid_BT, positions_BT = batch
  with torch.no_grad():
    return model(torch.as_tensor(tokens_BT, dtype=torch.long),
                 attention_mask=torch.as_tensor(valid_BT, dtype=torch.long),
                 position_ids=torch.as_tensor(positions_BT, dtype=torch.long)).logits.numpy()


def test_merged_export_is_the_adapted_model(adapted, tmp_path):
  """The merged Hugging Face export, read back by transformers and by jaxrl, gives the adapted
  model's logits (jaxrl: 2e-5 plus 1e-6 of the logit, float32's rounding of W + BA over logits
  of ~10: 1.2e-5 seen on an AMD EPYC; torch: 1e-4, the parity tests' bound)."""
  graph, params, batch = adapted["role"].graphdef, adapted["params"], _batch()
  want_BTV = _logits(graph, params, batch)
  out = str(tmp_path / "merged")
  export(lora.merged(graph, params), adapted["cfg"], out)
  back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  valid = batch[1]
  np.testing.assert_allclose(_torch_logits(back, batch)[valid], want_BTV[valid], atol=1e-4, rtol=0)
  plain = ModelRole("p", lambda: LanguageModel(adapted["cfg"], rngs=nnx.Rngs(0)),
                    adapted["role"].mesh)
  again = load_params(out, model_config_from_hf(out), plain.abstract())
  np.testing.assert_allclose(_logits(plain.graphdef, again, batch), want_BTV, atol=2e-5,
                             rtol=1e-6)


def test_peft_directory_loads_in_peft(adapted, tmp_path):
  """`export_peft` -> `PeftModel.from_pretrained(base, dir)`: the adapted model's logits, and
  peft's own merge_and_unload gives them too."""
  graph, params, batch = adapted["role"].graphdef, adapted["params"], _batch()
  out = str(tmp_path / "adapter")
  export_peft(lora.peft_tensors(graph, params), LORA, out, base_model=adapted["path"])
  with open(os.path.join(out, "adapter_config.json")) as f:
    config = json.load(f)
  assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
  base = transformers.AutoModelForCausalLM.from_pretrained(adapted["path"],
                                                           attn_implementation="eager")
  valid, want_BTV = batch[1], _logits(graph, params, batch)
  assert np.abs(_torch_logits(base, batch)[valid] - want_BTV[valid]).max() > 1e-2  # not a no-op
  model = peft.PeftModel.from_pretrained(base, out)  # (injects its layers into `base`)
  model.eval()
  np.testing.assert_allclose(_torch_logits(model, batch)[valid], want_BTV[valid], atol=1e-4,
                             rtol=0)
  merged = model.merge_and_unload()
  np.testing.assert_allclose(_torch_logits(merged, batch)[valid], want_BTV[valid], atol=1e-4,
                             rtol=0)
  with pytest.raises(HFError, match="already exists"):
    export_peft({}, LORA, out)


def test_the_reference_is_the_base(adapted):
  """The plain model on the base alone (what RL's reference scores with) is the torch base."""
  role, batch = adapted["role"], _batch()
  plain = ModelRole("p", lambda: LanguageModel(adapted["cfg"], rngs=nnx.Rngs(0)), role.mesh)
  base = role.split(adapted["params"])[1]
  valid = batch[1]
  np.testing.assert_allclose(_logits(plain.graphdef, base, batch)[valid],
                             _torch_logits(adapted["torch"], batch)[valid], atol=1e-4, rtol=0)
  assert dataclasses.replace(LORA, rank=0).enabled is False


def _copies(mode: str, devices, mirror: bool = False):
  """A LoRA actor on `devices` (fsdp over them) and its SamplerWeights in `mode` (`mirror`: the
  trainer's of a generator apart)."""
  from jaxrl.config_files import shipped
  tiny = shipped("tiny")
  from jaxrl.config_files import resolve
  from train.roles.sampler_weights import SamplerWeights
  c = tiny.get_config()
  c.lora.update(rank=2, sampler=mode)
  cfg = resolve(c)
  mesh = make_mesh({"fsdp": len(devices)}, devices=devices)
  role = ModelRole("actor", lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(0), lora=cfg.lora),
                   mesh, trainable=lora.TRAINABLE).initialize()
  plain = nnx.split(nnx.eval_shape(lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(0))))[0]
  return role, SamplerWeights(cfg, role, mesh, plain, mirror=mirror)


def test_adapter_pushes_share_the_base_where_layouts_agree():
  """One device: the sampler reads the actor's own base arrays; a push after an update moves the
  adapters alone, and freeing the old copy leaves the base alive."""
  role, copy = _copies("adapters", jax.devices()[:1])
  assert copy.shares_base
  first = copy.fresh()
  adapters, base = role.split(role.params)
  assert all(a is b for a, b in zip(jax.tree.leaves(role.split(first)[1]), jax.tree.leaves(base)))
  role.set_trained(_perturbed(adapters))  # what an update does
  second = copy.fresh()
  assert all(x.is_deleted() for x in jax.tree.leaves(role.split(first)[0]))
  assert not any(x.is_deleted() for x in jax.tree.leaves(base))
  np.testing.assert_array_equal(jax.tree.leaves(role.split(second)[0])[0],
                                jax.tree.leaves(role.split(role.params)[0])[0])
  copy.drop()
  assert copy.params is None and not any(x.is_deleted() for x in jax.tree.leaves(role.params))


def test_merged_and_unshared_copies_hold_their_own():
  """Merged: the plain model's weights. Adapters over 2 devices, where the sampler's layout of
  the base differs from the trainer's fsdp: the base is copied once, not at every push."""
  role, merged = _copies("merged", jax.devices()[:2])
  assert not merged.shares_base and not jax.tree.leaves(lora.split(merged.fresh())[0])
  role, copy = _copies("adapters", jax.devices()[:2])
  assert not copy.shares_base
  base = role.split(copy.fresh())[1]
  role.set_trained(_perturbed(role.split(role.params)[0]))
  again = role.split(copy.fresh())[1]
  assert all(a is b for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(again)))


def test_the_trainers_mirror_is_dropped_once_sent_and_made_again_when_needed():
  """A generator apart: `release` drops the trainer's copy (its arrays, the base's copy too,
  freed once nothing else holds them: a crossing still pulling would), and the next `fresh`
  makes the same weights again; a copy that is the sampler's own is never released."""
  import gc
  import weakref
  role, copy = _copies("adapters", jax.devices()[:2], mirror=True)
  first = copy.fresh()
  values = [np.asarray(x) for x in jax.tree.leaves(first)]
  refs = [weakref.ref(x) for x in jax.tree.leaves(first)]
  del first
  copy.release()
  gc.collect()
  assert copy.params is None and not any(r() is not None for r in refs)
  for x, v in zip(jax.tree.leaves(copy.fresh()), values, strict=True):
    np.testing.assert_array_equal(x, v)
  role, own = _copies("merged", jax.devices()[:2])
  own.fresh()
  own.release()
  assert own.params is not None
