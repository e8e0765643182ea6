"""Hugging Face import and export against transformers itself (float32 torch as the reference).

One tiny random model per architecture, saved in several files (an index): Llama with llama3 RoPE
scaling and tied embeddings, Qwen2 with q/k/v biases and an untied head, Qwen3 with q/k norms and
an explicit head_dim; single files come from exports and from transformers' bfloat16 save. Norm
scales and biases are randomised so that a dropped or misplaced one changes the logits. Imports
go into the training layout of an 8-device mesh.
"""
import copy
import dataclasses
import json
import os
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.torch import load_file, save_file

from jaxrl.models import hf_export as hf_module
from jaxrl.models.config import ModelConfig, RopeConfig, from_fields
from jaxrl.models.value_models import ValueModel
from jaxrl.models.hf import HFError, load_params, model_config_from_hf
from jaxrl.models.hf_export import export
from jaxrl.models.attention import init_kv_cache
from jaxrl.models.transformer import LanguageModel
from sampler.methods import SamplingConfig
from sampler.sampler import Sampler
from train.roles.role import ModelRole

from hf_models import (ARCHS, LENGTHS, T, batch, jax_logits, one_line, randomise, sized_mesh,
                       torch_logits)
from model_checks import per_layer

GENERATION = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


@pytest.fixture(scope="module")
def mesh():
  return sized_mesh()


def _role(cfg: ModelConfig, mesh, make=LanguageModel) -> ModelRole:
  return ModelRole("actor", lambda: make(cfg, rngs=nnx.Rngs(0)), mesh)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def hf(request, tmp_path_factory, mesh):
  """A saved torch model, its import and the role it was imported for."""
  arch = request.param
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(ARCHS[arch](), attn_implementation="eager")
  randomise(model, seed=1)
  model.eval()
  path = str(tmp_path_factory.mktemp(arch))
  model.save_pretrained(path, max_shard_size="100KB")  # several files: the index is read
  cfg = model_config_from_hf(path)
  role = _role(cfg, mesh)
  return types.SimpleNamespace(arch=arch, torch=model, path=path, cfg=cfg, role=role,
                               params=load_params(path, cfg, role.abstract()))


def test_config_fields(hf):
  cfg = hf.cfg
  assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff) == (64, 2, 4, 2, 128)
  assert cfg.head_dim == (32 if hf.arch == "qwen3" else 16) and cfg.norm_eps == 1e-5
  assert cfg.scale_tied_head is False
  assert cfg.tie_embeddings == (hf.arch not in ("qwen2", "qwen3_moe"))
  assert cfg.family == hf.arch
  assert cfg.rope.theta == (1e6 if hf.arch == "qwen2" else 1e4)
  if hf.arch == "llama":
    rope = (cfg.rope.scaling, cfg.rope.factor, cfg.rope.original_max_positions)
    assert rope == ("llama3", 8.0, 64)
  elif hf.arch == "gemma3":
    assert (cfg.rope.scaling, cfg.rope.factor, cfg.rope.local_theta) == ("linear", 2.0, 1e3)
    assert (cfg.attention.sliding_window, cfg.attention.global_every, cfg.attention.query_scale) == (4, 2, 24.0)
    assert cfg.layer_types() == ["sliding_attention", "full_attention"]
  elif hf.arch == "qwen3_moe":
    moe = (cfg.moe.experts, cfg.moe.per_token, cfg.moe.d_ff, cfg.moe.norm_topk)
    assert moe == (8, 2, 32, True) and cfg.rope.scaling == "none"
  else:
    assert cfg.rope.scaling == "none"


def test_import_is_born_sharded(hf):
  """Every array lands in the abstract's sharding, and large ones are really split."""
  want = jax.tree.leaves(hf.role.shardings)
  got = jax.tree.leaves(hf.params)
  assert [a.sharding for a in got] == want
  embed = hf.params["decoder"]["embed"][...]
  assert len({str(s.index) for s in embed.addressable_shards}) == 4  # vocab, embed: tensor, fsdp
  assert all(s.data.shape == (128, 32) for s in embed.addressable_shards)
  torch_embed = hf.torch.model.embed_tokens.weight.detach().numpy()
  np.testing.assert_array_equal(np.asarray(embed), torch_embed)


@pytest.mark.accelerator
def test_logits_match_torch(hf):
  tokens_BT, valid_BT, positions_BT = batch()
  want_BTV = torch_logits(hf.torch, tokens_BT, valid_BT, positions_BT)
  got_BTV = jax_logits(hf.role, hf.params, tokens_BT, valid_BT, positions_BT)
  np.testing.assert_allclose(got_BTV[valid_BT], want_BTV[valid_BT], atol=1e-4, rtol=0)


@pytest.mark.accelerator
def test_kv_cache_decode_matches_torch(hf):
  """Prefill 4 positions, then one token per call at cache slots 4..T-1."""
  tokens_BT, valid_BT, positions_BT = batch()
  want_BTV = torch_logits(hf.torch, tokens_BT, valid_BT, positions_BT)
  graphdef, cfg, p = hf.role.graphdef, hf.cfg, 4

  def call(params, tok, pos, cache, index):
    return nnx.merge(graphdef, params)(tok, pos, valid_BT, cache, index)

  call = hf.role.jit(call)
  logits_BTV, cache = call(hf.params, tokens_BT[:, :p], positions_BT[:, :p],
                           init_kv_cache(cfg, len(LENGTHS), T), jnp.int32(0))
  got = [np.asarray(logits_BTV)]
  for t in range(p, T):
    logits_B1V, cache = call(hf.params, tokens_BT[:, t:t + 1], positions_BT[:, t:t + 1], cache,
                             jnp.int32(t))
    got.append(np.asarray(logits_B1V))
  got_BTV = np.concatenate(got, axis=1)
  np.testing.assert_allclose(got_BTV[valid_BT], want_BTV[valid_BT], atol=1e-4, rtol=0)


@pytest.mark.accelerator
def test_greedy_generation_matches_torch(hf):
  """32 greedy tokens from the sampler (its own prefill and decode loop) equal
  `generate(do_sample=False)`, and the sampler's log-probs equal torch's."""
  tokens_BT, valid_BT, _ = batch()
  prompts = [row[v].tolist() for row, v in zip(tokens_BT, valid_BT)]
  sampling = SamplingConfig(max_new_tokens=32, eos_id=2, pad_id=0, method="greedy",
                            ignore_eos=True, decode_segments=1)  # one loop to compile
  sampler = Sampler(hf.role.graphdef, sampling, length_buckets=(16,), batch_buckets=(4,))
  out = sampler.complete(hf.params, prompts, jax.random.key(0))
  model = copy.copy(hf.torch)
  model.generation_config = transformers.GenerationConfig(eos_token_id=None, pad_token_id=0)
  with torch.no_grad():
    ref = model.generate(torch.as_tensor(tokens_BT, dtype=torch.long),
                         attention_mask=torch.as_tensor(valid_BT, dtype=torch.long),
                         do_sample=False, max_new_tokens=32, output_logits=True,
                         return_dict_in_generate=True)
  want_BN = ref.sequences[:, T:].numpy()
  np.testing.assert_array_equal(out.tokens_BT[:, 16:], want_BN)
  logp_BNV = torch.log_softmax(torch.stack(ref.logits, 1), -1).numpy()
  want_logp_BN = np.take_along_axis(logp_BNV, want_BN[..., None], -1)[..., 0]
  np.testing.assert_allclose(out.logprobs_BN, want_logp_BN, atol=1e-4, rtol=0)
  assert len(set(want_BN.ravel().tolist())) > 8  # not a degenerate repetition of one token


def _state_dict(model) -> dict:
  return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.accelerator
def test_export_reloads_exactly(hf, tmp_path):
  """Export -> from_pretrained: the same tensors and the same logits as the original."""
  out = str(tmp_path / "out")
  shard = 40_000 if hf.arch == "qwen3" else 1 << 30
  export(hf.params, hf.cfg, out, max_shard_bytes=shard, generation_config=GENERATION)
  files = sorted(os.listdir(out))
  if hf.arch == "qwen3":
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 2
  else:
    assert "model.safetensors" in files and "model.safetensors.index.json" not in files
  assert not os.path.exists(out + ".tmp")
  back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  assert type(back) is type(hf.torch)
  want, got = _state_dict(hf.torch), _state_dict(back)
  assert sorted(got) == sorted(want)
  for name in want:
    assert torch.equal(got[name], want[name]), name
  tokens_BT, valid_BT, positions_BT = batch()
  np.testing.assert_array_equal(torch_logits(back, tokens_BT, valid_BT, positions_BT),
                                torch_logits(hf.torch, tokens_BT, valid_BT, positions_BT))
  assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == 2
  # And back into jaxrl: the same parameters.
  again = load_params(out, model_config_from_hf(out), hf.role.abstract())
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(hf.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_value_model_loads_the_decoder(hf, mesh):
  role = _role(hf.cfg, mesh, ValueModel)
  loaded = load_params(hf.path, hf.cfg, role.abstract(), subtree="decoder")
  assert set(loaded.keys()) == {"decoder"}
  for got, want, sharding in zip(jax.tree.leaves(loaded), jax.tree.leaves(hf.params["decoder"]),
                                 jax.tree.leaves(role.shardings["decoder"])):
    assert got.sharding == sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _tiny_tokenizer(path: str) -> None:
  import tokenizers  # only here: a WordLevel tokenizer.json transformers can load
  vocab = {f"t{i}": i for i in range(256)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  os.makedirs(path)
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t2"}, f)


def test_export_jaxrl_init_with_scaled_tied_head(tmp_path, mesh):
  """jaxrl's own tied head (embed / sqrt(d)) goes out as an explicit lm_head; with q/k/v biases
  and linear RoPE scaling it is a Qwen2 model whose logits are jaxrl's, in float32 and (files
  cast) in bfloat16."""
  cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                    d_ff=128, family="qwen2", rope=RopeConfig(scaling="linear", factor=2.0))
  role = _role(cfg, mesh)
  leaves, tree = jax.tree.flatten(role.abstract())

  def draw():  # norm scales near 1, every other weight (biases too) near 0
    keys = jax.random.split(jax.random.key(0), len(leaves))
    return jax.tree.unflatten(tree, [(x.ndim == 1) + 0.2 * jax.random.normal(k, x.shape)
                                     for x, k in zip(leaves, keys)])

  params = jax.jit(draw, out_shardings=role.shardings)()
  _tiny_tokenizer(str(tmp_path / "tok"))
  out = str(tmp_path / "out")
  export(params, cfg, out, tokenizer_dir=str(tmp_path / "tok"), generation_config=GENERATION)
  config = json.load(open(os.path.join(out, "config.json")))
  assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is False
  back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  tokens_BT, valid_BT, positions_BT = batch()
  want_BTV = jax_logits(role, params, tokens_BT, valid_BT, positions_BT)
  got_BTV = torch_logits(back, tokens_BT, valid_BT, positions_BT)
  np.testing.assert_allclose(got_BTV[valid_BT], want_BTV[valid_BT], atol=1e-4, rtol=0)
  assert transformers.PreTrainedTokenizerFast.from_pretrained(out).encode("t5 t7") == [5, 7]
  for name in ("tokenizer.json", "tokenizer_config.json"):
    assert open(os.path.join(out, name)).read() == open(tmp_path / "tok" / name).read()
  out16 = str(tmp_path / "out16")
  export(params, cfg, out16, dtype="bfloat16", max_shard_bytes=50_000)
  back16 = transformers.AutoModelForCausalLM.from_pretrained(out16, dtype=torch.bfloat16)
  assert json.load(open(os.path.join(out16, "config.json")))["torch_dtype"] == "bfloat16"
  got16 = _state_dict(back16)
  for name, p in _state_dict(back).items():
    assert torch.equal(got16[name], p.bfloat16()), name


def test_bf16_checkpoint_loads(hf, tmp_path):
  """A checkpoint transformers saved in bfloat16 loads as its exact values, in float32."""
  path = str(tmp_path / "bf16")
  copy.deepcopy(hf.torch).to(torch.bfloat16).save_pretrained(path)
  params = load_params(path, model_config_from_hf(path), hf.role.abstract())
  mlp = hf.torch.model.layers[1].mlp
  down = mlp.experts.down_proj if hf.cfg.moe.experts else mlp.down_proj.weight  # [E, D, F] | [D, F]
  want = down.detach().bfloat16().float().numpy()
  got = params["decoder"]["blocks"][1]["mlp"]["w_down"][...]
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), want)
  wq = hf.torch.model.layers[0].self_attn.q_proj.weight.detach().bfloat16().float().numpy()
  np.testing.assert_array_equal(np.asarray(params["decoder"]["blocks"][0]["attn"]["wq"][...]),
                                wq.reshape(hf.cfg.n_heads, hf.cfg.head_dim, -1))


# ------------------------------------------------------------------------------------ errors


INDEX = "model.safetensors.index.json"
NAME, EXTRA = "model.layers.1.mlp.up_proj.weight", "model.layers.1.self_attn.o_proj.bias"
EXPERT_NAME = "model.layers.1.mlp.experts.3.up_proj.weight"  # one expert's tensor (qwen3_moe)


def _broken_copy(hf, tmp_path, case: str) -> tuple[str, str]:
  """A copy of the checkpoint with tensor NAME (an expert's, for an MoE) or its file broken as
  `case` says; returns the copy and the file that holds it."""
  name = EXPERT_NAME if hf.cfg.moe.experts else NAME
  path = str(tmp_path / "ckpt")
  shutil.copytree(hf.path, path)
  with open(os.path.join(path, INDEX)) as f:
    index = json.load(f)
  weight_map = index["weight_map"]
  file = os.path.join(path, weight_map[name])
  tensors = load_file(file)
  if case == "tensor":
    del tensors[name]
  elif case == "index":
    del weight_map[name]
  elif case == "shape":
    tensors[name] = tensors[name][:, :-1].contiguous()
  elif case == "dtype":
    tensors[name] = tensors[name].to(torch.int32)
  elif case == "extra":  # an o_proj bias: a config misread, never to be dropped silently
    tensors[EXTRA], weight_map[EXTRA] = torch.zeros(64), weight_map[name]
  save_file(tensors, file, metadata={"format": "pt"})
  with open(os.path.join(path, INDEX), "w") as f:
    json.dump(index, f)
  if case == "shard":
    os.remove(file)
  return path, file


@pytest.mark.parametrize("case, words", [
    ("tensor", ["{name}", "not in"]),
    ("index", ["{name}", "missing from", INDEX]),
    ("shape", ["{name}", "shape ({rows}, 63)"]),
    ("dtype", ["{name}", "dtype I32"]),
    ("extra", [EXTRA, "no parameter"]),
    ("shard", ["missing", INDEX]),
])
def test_broken_checkpoints_are_refused(hf, tmp_path, case, words):
  path, file = _broken_copy(hf, tmp_path, case)
  with pytest.raises(HFError) as e:
    load_params(path, hf.cfg, hf.role.abstract())
  moe = bool(hf.cfg.moe.experts)
  fill = dict(name=EXPERT_NAME if moe else NAME, rows=32 if moe else 128)
  msg = one_line(e, *(w.format(**fill) for w in words))
  assert case != "shard" or file in msg


def test_model_must_match_the_checkpoint(hf, mesh):
  cfg = dataclasses.replace(hf.cfg, d_ff=256)
  with pytest.raises(HFError) as e:
    load_params(hf.path, cfg, _role(cfg, mesh).abstract())
  one_line(e, "d_ff", "256", "128")


def test_failed_export_leaves_nothing(hf, tmp_path, monkeypatch):
  out = str(tmp_path / "out")
  os.makedirs(tmp_path / "empty")
  with pytest.raises(HFError) as e:  # refused before any weight is gathered
    export(hf.params, hf.cfg, out, tokenizer_dir=str(tmp_path / "empty"))
  one_line(e, "tokenizer", str(tmp_path / "empty"))

  def disk_full(path, obj):  # config.json is written after every weight
    raise OSError(f"{path}: no space left on device")

  monkeypatch.setattr(hf_module, "_write_json", disk_full)
  with pytest.raises(OSError, match="config.json: no space"):
    export(hf.params, hf.cfg, out)
  assert not os.path.exists(out) and not os.path.exists(out + ".tmp")
  monkeypatch.undo()
  export(hf.params, hf.cfg, out)
  with pytest.raises(HFError) as e:
    export(hf.params, hf.cfg, out)
  one_line(e, out, "exists")



def test_a_scanned_model_reads_and_writes_the_same_files(hf, tmp_path, mesh):
  """`model.layers.scan` (jaxrl/models/scan.py): the checkpoint loads into the stacked blocks,
  each device reading its block of every layer's tensors, to the unrolled import's values and
  logits; and exported, the files are the unrolled model's byte for byte."""
  cfg = from_fields({"layers.scan": True}, base=hf.cfg)
  role = _role(cfg, mesh)
  params = load_params(hf.path, cfg, role.abstract())
  flat = lambda state: {tuple(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(state)}
  unrolled = flat(hf.params)
  for path, value in per_layer(flat(params), cfg.n_layers).items():
    np.testing.assert_array_equal(value, unrolled[path], err_msg=str(path))
  tokens_BT, valid_BT, positions_BT = batch()
  np.testing.assert_allclose(jax_logits(role, params, tokens_BT, valid_BT, positions_BT),
                             jax_logits(hf.role, hf.params, tokens_BT, valid_BT, positions_BT),
                             atol=1e-5, rtol=1e-5)
  export(params, cfg, str(tmp_path / "scanned"), max_shard_bytes=100_000)
  export(hf.params, hf.cfg, str(tmp_path / "unrolled"), max_shard_bytes=100_000)
  names = sorted(os.listdir(tmp_path / "unrolled"))
  assert sorted(os.listdir(tmp_path / "scanned")) == names and len(names) > 2
  for name in names:
    assert (tmp_path / "scanned" / name).read_bytes() == (tmp_path / "unrolled" / name).read_bytes()
