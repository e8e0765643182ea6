"""Hugging Face safetensors checkpoints <-> jaxrl parameters (the families of families.py).

Import reads each device's slice of each tensor straight from the safetensors files
(`jax.make_array_from_callback`), so parameters are born in the caller's layout and no host holds
a whole tensor. Export gathers one tensor at a time and streams it into its file, so a host holds
at most one tensor; the directory is written beside its destination and renamed, so it appears
whole or not at all.

Names: `decoder.embed` <-> `model.embed_tokens.weight`, `decoder.blocks.{i}.attn.wq` <->
`model.layers.{i}.self_attn.q_proj.weight`, ... Projections are stored [out, in] as in PyTorch,
and RoPE rotates pairs (i, i + head_dim / 2) as HF's rotate_half does, so the attention weights
map by reshape alone ([N * H, D] <-> [N, H, D]), with no permutation of rows.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx
from jax.experimental import multihost_utils
from safetensors import safe_open

from jaxrl.models.config import ModelConfig
from jaxrl.models.families import FAMILIES, TOP_TENSORS
from jaxrl.models.hf_config import (ARCH_FIELDS, HFError, check_config, default_max_positions,
                                    hf_config_dict, model_config_from_hf, tensor_prefix)

__all__ = ["HFError", "check_config", "export", "load_params", "model_config_from_hf"]

_READABLE = ("F32", "BF16", "F16")  # safetensors dtypes; read as float32
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json")


def _keys(path) -> tuple:
  """A parameter's keys (`('decoder', 'blocks', 0, 'attn', 'wq')`) from a tree path of an
  nnx.State (Variables add a `.value` attribute key, dropped here) or of a pure dict."""
  return tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path
               if not isinstance(k, jax.tree_util.GetAttrKey))


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


def _merged(shape: tuple, split: int | None) -> tuple:
  """The checkpoint's shape of a parameter of `shape`."""
  if split is None:
    return tuple(shape)
  return tuple(shape[:split]) + (shape[split] * shape[split + 1],) + tuple(shape[split + 2:])


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


def _read(handle, name: str, index: tuple, shape: tuple, split: int | None) -> np.ndarray:
  """The parameter block `index` (slices of the jaxrl `shape`) of tensor `name`, float32."""
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
  """(name, handle, split, name with the prefix) per leaf, with every tensor's file, shape and
  dtype checked before anything is read (`weights` named without the checkpoint's `prefix`)."""
  plan = []
  for path, leaf in leaves:
    keys = _keys(path)
    short, split = hf_tensor(keys, family)
    if short not in weights:
      raise HFError(f"{prefix}{short}: missing from {where} (parameter "
                    f"{'.'.join(map(str, keys))})")
    name, file = prefix + short, os.path.join(hf_dir, weights[short])
    if file not in handles:
      if not os.path.exists(file):
        raise HFError(f"{name}: its file {file} (named in {where}) is missing")
      handles[file] = _open(file)
    if name not in handles[file].keys():
      raise HFError(f"{name}: not in {file} (where {where} puts it)")
    info = handles[file].get_slice(name)
    if info.get_dtype() not in _READABLE:
      raise HFError(f"{name} in {file}: dtype {info.get_dtype()} is not one of {list(_READABLE)}")
    want = _merged(leaf.shape, split)
    if tuple(info.get_shape()) != want:
      raise HFError(f"{name} in {file}: shape {tuple(info.get_shape())} does not match the "
                    f"model's {want} (parameter {'.'.join(map(str, keys))})")
    plan.append((short, handles[file], split, name))
  return plan


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
  for name in ARCH_FIELDS:
    if getattr(cfg, name) != getattr(hf, name):
      raise HFError(f"{name}: the model has {getattr(cfg, name)!r} but {hf.hf_path}/config.json "
                    f"says {getattr(hf, name)!r} (build the model from check_config's result)")


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
  _check_unused(weights, {short for short, *_ in plan}, subtree, cfg.tie_embeddings, where)
  arrays = []
  for (_, leaf), (_, handle, split, name) in zip(leaves, plan):
    read = lambda index, name=name, handle=handle, split=split, shape=leaf.shape: _read(
        handle, name, index, shape, split)
    arrays.append(jax.make_array_from_callback(leaf.shape, leaf.sharding, read))
  return jax.tree_util.tree_unflatten(treedef, arrays)


# ---------------------------------------------------------------------------------------- export


def _hf_tensors(params: nnx.State, cfg: ModelConfig) -> tuple[list, bool]:
  """[(name, checkpoint shape, parameter, scale)] in write order, and whether the files tie the
  LM head to the embedding. jaxrl's own tied head (embed / sqrt(d_model)) has no HF equivalent,
  so it is written out as an explicit lm_head: the embedding again, scaled."""
  tensors = []
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    name, split = hf_tensor(_keys(path), cfg.family)
    tensors.append((name, _merged(x.shape, split), x, None))
  has_head = any(t[0] == "lm_head.weight" for t in tensors)
  if has_head == cfg.tie_embeddings:
    raise HFError(f"params {'have' if has_head else 'lack'} lm_head but tie_embeddings="
                  f"{cfg.tie_embeddings}")
  if cfg.tie_embeddings and cfg.scale_tied_head:
    _, shape, embed, _ = next(t for t in tensors if t[0] == "model.embed_tokens.weight")
    tensors.append(("lm_head.weight", shape, embed, cfg.d_model**-0.5))
    return tensors, False
  return tensors, cfg.tie_embeddings


def _to_host(x, shape: tuple, scale: float | None, dtype) -> np.ndarray:
  """The whole tensor on this host, in `dtype` and the checkpoint's `shape`. Scaled and cast
  here, not on the devices: no device holds a second copy and nothing is compiled per shape. A
  collective where the tensor spans processes: every process must call it."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = multihost_utils.process_allgather(x, tiled=True)
  host = np.asarray(x, np.float32)
  if scale is not None:
    host = host * np.float32(scale)
  return host.astype(dtype, copy=False).reshape(shape)


def _shards(sizes: list[int], max_bytes: int) -> list[list[int]]:
  """Tensor indices per file: consecutive tensors while they fit `max_bytes` (a larger tensor
  gets a file of its own)."""
  shards, used = [[]], 0
  for i, size in enumerate(sizes):
    if shards[-1] and used + size > max_bytes:
      shards, used = shards + [[]], 0
    shards[-1].append(i)
    used += size
  return shards


def _write_shard(path: str | None, tensors: list, st_dtype: str, dtype) -> None:
  """One safetensors file, header first (its offsets follow from the shapes), then each tensor
  as it is gathered. `path=None` (not the writing process): gathers only."""
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, shape, _, _ in tensors:
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    header[name] = {"dtype": st_dtype, "shape": list(shape),
                    "data_offsets": [offset, offset + size]}
    offset += size
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") if path else contextlib.nullcontext() as f:
    if f:
      f.write(struct.pack("<Q", len(blob)) + blob)
    for _, shape, x, scale in tensors:
      host = _to_host(x, shape, scale, dtype)
      if f:
        np.ascontiguousarray(host).tofile(f)


def _write_weights(tmp: str | None, tensors: list, dtype: str, max_shard_bytes: int) -> None:
  st_dtype, np_dtype = {"float32": ("F32", np.float32), "bfloat16": ("BF16", jnp.bfloat16)}[dtype]
  sizes = [int(np.prod(shape)) * np.dtype(np_dtype).itemsize for _, shape, _, _ in tensors]
  shards = _shards(sizes, max_shard_bytes)
  files = [SINGLE_FILE] if len(shards) == 1 else [
      f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  for file, shard in zip(files, shards):
    _write_shard(tmp and os.path.join(tmp, file), [tensors[i] for i in shard], st_dtype, np_dtype)
  if tmp and len(shards) > 1:
    weight_map = {tensors[i][0]: file for file, shard in zip(files, shards) for i in shard}
    _write_json(os.path.join(tmp, INDEX_FILE),
                {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map})


def _write_json(path: str, obj: dict) -> None:
  with open(path, "w") as f:
    json.dump(obj, f, indent=2)
    f.write("\n")


def _tokenizer_files(tokenizer_dir: str | None) -> list[str]:
  if tokenizer_dir is None:
    return []
  found = [os.path.join(tokenizer_dir, n) for n in TOKENIZER_FILES
           if os.path.exists(os.path.join(tokenizer_dir, n))]
  if not found:
    raise HFError(f"{tokenizer_dir}: none of the tokenizer files {list(TOKENIZER_FILES)}")
  return found


def export(params: nnx.State, cfg: ModelConfig, out_dir: str, *, dtype: str = "float32",
           max_shard_bytes: int = 4 << 30, tokenizer_dir: str | None = None,
           generation_config: dict | None = None, max_positions: int | None = None) -> None:
  """Writes a LanguageModel's `params` as a Hugging Face directory that transformers and vLLM
  load as is: config.json (the model family's architecture), safetensors
  files of at most `max_shard_bytes` each (plus model.safetensors.index.json when there are
  several), generation_config.json (`generation_config`, e.g. bos/eos/pad token ids, whose ids
  also go into config.json) and the tokenizer files of `tokenizer_dir`.

  Every process must call it (a tensor spanning processes is gathered collectively); process 0
  writes. `max_positions`: max_position_embeddings (default: the source checkpoint's, else the
  RoPE's context). `out_dir` must not exist; it appears complete or not at all.
  """
  if dtype not in ("float32", "bfloat16"):
    raise HFError(f"export dtype: expected float32 or bfloat16, got {dtype!r}")
  _refuse_existing(out_dir)
  # Everything that can be refused is, before any weight is gathered.
  tensors, tied = _hf_tensors(params, cfg)
  generation_config = dict(generation_config or {})
  config = hf_config_dict(
      cfg, tied=tied, dtype=dtype,
      token_ids={k: v for k, v in generation_config.items() if k.endswith("_token_id")},
      max_positions=max_positions or default_max_positions(cfg))
  tokenizer_files = _tokenizer_files(tokenizer_dir)
  with _new_dir(out_dir) as tmp:
    _write_weights(tmp, tensors, dtype, max_shard_bytes)
    if tmp is not None:
      _write_json(os.path.join(tmp, "config.json"), config)
      if generation_config:
        _write_json(os.path.join(tmp, "generation_config.json"), generation_config)
      for file in tokenizer_files:
        shutil.copy2(file, tmp)


def export_peft(tensors: dict, cfg, out_dir: str, *, base_model: str = "") -> None:
  """Writes LoRA adapters (`lora.peft_tensors`) as a PEFT adapter directory:
  adapter_config.json and adapter_model.safetensors (float32), which
  `peft.PeftModel.from_pretrained(base, out_dir)` loads onto the base model. As `export`: every
  process calls it, process 0 writes, `out_dir` must not exist and appears whole or not at
  all."""
  from jaxrl.models.lora import peft_config
  _refuse_existing(out_dir)
  with _new_dir(out_dir) as tmp:
    arrays = {name: _to_host(x, x.shape, None, np.float32) for name, x in tensors.items()}
    if tmp is not None:
      safetensors.numpy.save_file(arrays, os.path.join(tmp, "adapter_model.safetensors"),
                                  metadata={"format": "pt"})
      _write_json(os.path.join(tmp, "adapter_config.json"), peft_config(cfg, base_model))


def _refuse_existing(out_dir: str) -> None:
  """An HFError when `out_dir` exists (process 0 decides for all, so none waits in a gather
  alone)."""
  exists = os.path.exists(out_dir)
  if jax.process_count() > 1:
    exists = bool(multihost_utils.broadcast_one_to_all(np.asarray(exists)))
  if exists:
    raise HFError(f"{out_dir}: already exists (export never overwrites)")


@contextlib.contextmanager
def _new_dir(out_dir: str):
  """`out_dir.tmp` to write into on process 0 (None elsewhere), renamed to `out_dir` when the
  block ends well and removed when it fails; no process returns before the directory exists."""
  writer = jax.process_index() == 0
  tmp = out_dir.rstrip("/") + ".tmp"
  if writer:
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed export's leftovers
    os.makedirs(tmp)
  try:
    yield tmp if writer else None
    if writer:
      os.rename(tmp, out_dir)
  except BaseException:
    if writer:
      shutil.rmtree(tmp, ignore_errors=True)
    raise
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"jaxrl.hf.export:{out_dir}")
