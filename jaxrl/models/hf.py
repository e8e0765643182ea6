"""Hugging Face safetensors checkpoints <-> jaxrl parameters (the families of families.py).

Import reads each device's slice of each tensor straight from the safetensors files
(`jax.make_array_from_callback`), so parameters are born in the caller's layout and no host holds
a whole tensor. Export: jaxrl/models/hf_export.py.

Names: `decoder.embed` <-> `model.embed_tokens.weight`, `decoder.blocks.{i}.attn.wq` <->
`model.layers.{i}.self_attn.q_proj.weight`, ... Projections are stored [out, in] as in PyTorch,
and RoPE rotates pairs (i, i + head_dim / 2) as HF's rotate_half does, so the attention weights
map by reshape alone ([N * H, D] <-> [N, H, D]), with no permutation of rows. A mixture of
experts' stacked weights ([E, out, in]) are one tensor per expert in the files
(`mlp.experts.{e}.gate_proj.weight`), as Qwen3-MoE checkpoints store them.
"""
from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from jaxrl.models.config import ModelConfig, fields
from jaxrl.models.families import EXPERTS, FAMILIES, TOP_TENSORS
from jaxrl.models.hf_config import (ARCH_FIELDS, HFError, check_config, model_config_from_hf,
                                    tensor_prefix)
from jaxrl.models.scan import layer_keys, path_keys, stacked_keys

__all__ = ["HFError", "check_config", "load_params", "model_config_from_hf"]

_READABLE = ("F32", "BF16", "F16")  # safetensors dtypes; read as float32
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json")


def hf_tensor(keys: tuple, family: str) -> tuple[str, int | None]:
  """(Hugging Face tensor name, split axis) of the parameter at `keys` in a model of `family`
  (its `block_tensors`, jaxrl/models/families.py)."""
  if keys in TOP_TENSORS:
    return TOP_TENSORS[keys], None
  block = FAMILIES[family].block_tensors
  if keys[:2] == ("decoder", "blocks") and len(keys) > 3 and keys[3:] in block:
    name, split = block[keys[3:]]
    return f"model.layers.{keys[2]}.{name}", split
  raise HFError(f"parameter {'.'.join(map(str, keys))} has no Hugging Face tensor (only a "
                "LanguageModel's do; a value or reward model loads with subtree='decoder')")


def _merged(shape: tuple, split: int | str | None) -> tuple:
  """The checkpoint's shape of a parameter of `shape` (of each expert's tensor, for `EXPERTS`)."""
  if split is None:
    return tuple(shape)
  if split == EXPERTS:
    return tuple(shape[1:])
  return tuple(shape[:split]) + (shape[split] * shape[split + 1],) + tuple(shape[split + 2:])


def _names(name: str, split, shape: tuple) -> list[str]:
  """The checkpoint tensors of one parameter: one, or one per expert (`{e}` in the name)."""
  return [name.format(e=e) for e in range(shape[0])] if split == EXPERTS else [name]


# ---------------------------------------------------------------------------------------- import


def _weight_map(hf_dir: str) -> tuple[dict[str, str], str]:
  """{tensor name: file name}, and the file that says so."""
  index = os.path.join(hf_dir, INDEX_FILE)
  if os.path.exists(index):
    try:
      with open(index) as f:
        return dict(json.load(f)["weight_map"]), index
    except (ValueError, KeyError, TypeError) as e:
      raise HFError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
  single = os.path.join(hf_dir, SINGLE_FILE)
  if not os.path.exists(single):
    raise HFError(f"{hf_dir}: neither {SINGLE_FILE} nor {INDEX_FILE}")
  with _open(single) as f:
    return {name: SINGLE_FILE for name in f.keys()}, single


def _open(path: str):
  """safe_open, with an unreadable file (a corrupt or truncated header) an HFError."""
  try:
    return safe_open(path, framework="flax")
  except Exception as e:  # safetensors raises its own SafetensorError (an Exception)
    raise HFError(f"{path}: cannot read ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


@functools.cache
def _host_device():
  """The CPU device, where safetensors' jax arrays land while they are converted (a bfloat16
  tensor can only be read through jax or torch: numpy has no bfloat16); None: no CPU backend
  (JAX_PLATFORMS leaves it out), the default device."""
  try:
    return jax.local_devices(backend="cpu")[0]
  except RuntimeError:
    return None


def _read(handles, names: list, index: tuple, shape: tuple, split) -> np.ndarray:
  """The parameter block `index` (slices of the jaxrl `shape`) of tensors `names`, float32: the
  experts in the block read from their own tensors and stacked."""
  if split == EXPERTS:
    experts = range(*index[0].indices(shape[0])[:2])
    return np.stack([_read([handles[e]], [names[e]], index[1:], shape[1:], None)
                     for e in experts])
  handle, name = handles[0], names[0]
  idx = [slice(*s.indices(d)[:2]) for s, d in zip(index, shape)]
  if split is not None:  # read whole heads' rows, then keep the head_dim slice of each
    heads, part, inner = idx[split], idx[split + 1], shape[split + 1]
    idx = idx[:split] + [slice(heads.start * inner, heads.stop * inner)] + idx[split + 2:]
  with jax.default_device(_host_device()):
    x = np.asarray(handle.get_slice(name)[tuple(idx)].astype(jnp.float32))
  if split is not None:
    x = x.reshape(x.shape[:split] + (-1, inner) + x.shape[split + 1:])
    x = x[(slice(None),) * (split + 1) + (part,)]
  return x


def _plan(hf_dir: str, leaves, handles: dict, weights: dict, where: str, family: str,
          prefix: str = "") -> list:
  """(short names, handles, split, names with the prefix) per leaf, with every tensor's file,
  shape and dtype checked before anything is read (`weights` named without the checkpoint's
  `prefix`)."""
  plan = []
  for path, leaf in leaves:
    keys = path_keys(path)
    if stacked_keys(keys):  # a scanned decoder: one plan per layer, stacked on axis 0
      plan.append([_plan_one(hf_dir, layer_keys(keys, i), leaf.shape[1:], handles, weights,
                             where, family, prefix) for i in range(leaf.shape[0])])
    else:
      plan.append(_plan_one(hf_dir, keys, leaf.shape, handles, weights, where, family, prefix))
  return plan


def _plan_one(hf_dir: str, keys: tuple, shape: tuple, handles: dict, weights: dict, where: str,
              family: str, prefix: str) -> tuple:
  param = ".".join(map(str, keys))
  template, split = hf_tensor(keys, family)
  shorts = _names(template, split, shape)
  files = [_handle(hf_dir, short, prefix, handles, weights, where, param) for short in shorts]
  want = _merged(shape, split)
  for short, f in zip(shorts, files):
    info = f.get_slice(prefix + short)
    if info.get_dtype() not in _READABLE:
      raise HFError(f"{prefix}{short}: dtype {info.get_dtype()} is not one of "
                    f"{list(_READABLE)}")
    if tuple(info.get_shape()) != want:
      raise HFError(f"{prefix}{short}: shape {tuple(info.get_shape())} does not match the "
                    f"model's {want} (parameter {param})")
  return shorts, files, split, [prefix + short for short in shorts]


def _read_planned(plan, index: tuple, shape: tuple) -> np.ndarray:
  """The block `index` of a parameter of `shape` as `plan` reads it (a stacked block's: each
  layer in the block read from its own tensors, stacked)."""
  if isinstance(plan, list):
    layers = range(*index[0].indices(shape[0])[:2])
    return np.stack([_read_planned(plan[i], index[1:], shape[1:]) for i in layers])
  _, files, split, names = plan
  return _read(files, names, index, shape, split)


def _handle(hf_dir: str, short: str, prefix: str, handles: dict, weights: dict, where: str,
            param: str):
  """The open file holding tensor `prefix + short`, checked to hold it."""
  if short not in weights:
    raise HFError(f"{prefix}{short}: missing from {where} (parameter {param})")
  name, file = prefix + short, os.path.join(hf_dir, weights[short])
  if file not in handles:
    if not os.path.exists(file):
      raise HFError(f"{name}: its file {file} (named in {where}) is missing")
    handles[file] = _open(file)
  if name not in handles[file].keys():
    raise HFError(f"{name}: not in {file} (where {where} puts it)")
  return handles[file]


def _check_unused(weights: dict, used: set, subtree: str | None, tied: bool, where: str) -> None:
  """A checkpoint tensor the model has no parameter for means the config was misread (a bias,
  a norm): refuse rather than drop it. A tied model ignores a saved lm_head copy; a decoder
  load ignores the head."""
  ignored = {"lm_head.weight"} if subtree or tied else set()
  for name in weights:
    if name not in used and name not in ignored and not name.endswith("rotary_emb.inv_freq"):
      raise HFError(f"{name} in {where}: the model has no parameter for it")


def _check_same(cfg: ModelConfig, hf: ModelConfig) -> None:
  """The model must compute what the checkpoint's config says (check_config's result does)."""
  mine, theirs = fields(cfg), fields(hf)
  for name in ARCH_FIELDS:
    if mine[name] != theirs[name]:
      raise HFError(f"{name}: the model has {mine[name]!r} but {hf.hf_path}/config.json says "
                    f"{theirs[name]!r} (build the model from check_config's result)")


def load_params(hf_dir: str, cfg: ModelConfig, abstract: nnx.State, *,
                subtree: str | None = None) -> nnx.State:
  """The checkpoint's weights (float32) in exactly the shardings of `abstract` (ShapeDtypeStructs
  with `.sharding`, e.g. `ModelRole.abstract()`).

  `subtree=None`: `abstract` is a LanguageModel's tree; the result has the same structure.
  `subtree="decoder"`: `abstract` may be any model with a LanguageModel's `decoder` (a ValueModel
  or RewardModel); the result is `State({"decoder": ...})` alone and the caller keeps its own
  other leaves (its head and bias), e.g. `params["decoder"] = loaded["decoder"]`.
  Every device reads only its own block of each tensor. A missing tensor or shard file, a shape
  or dtype mismatch, or a checkpoint tensor the model lacks is an HFError naming the tensor.
  """
  _check_same(cfg, model_config_from_hf(hf_dir))
  if subtree is not None:
    abstract = nnx.State({subtree: abstract[subtree]})
  leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  weights, where = _weight_map(hf_dir)
  prefix = tensor_prefix(hf_dir)  # a multimodal checkpoint: its language model's tensors only
  weights = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
  handles: dict = {}
  plan = _plan(hf_dir, leaves, handles, weights, where, cfg.family, prefix)
  each = [p for entry in plan for p in (entry if isinstance(entry, list) else [entry])]
  _check_unused(weights, {short for shorts, *_ in each for short in shorts}, subtree,
                cfg.tie_embeddings, where)
  arrays = []
  for (_, leaf), entry in zip(leaves, plan):
    read = lambda index, entry=entry, shape=leaf.shape: _read_planned(entry, index, shape)
    arrays.append(jax.make_array_from_callback(leaf.shape, leaf.sharding, read))
  return jax.tree_util.tree_unflatten(treedef, arrays)
