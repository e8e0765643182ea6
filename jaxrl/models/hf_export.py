"""Export: jaxrl parameters -> a Hugging Face directory (safetensors, config.json, tokenizer) that
transformers and vLLM load as is, and LoRA adapters -> a PEFT adapter directory.

Export gathers one tensor at a time and streams it into its file, so a host holds at most one
tensor (a stacked expert weight: all its experts' tensors at once); the directory is written
beside its destination and renamed, so it appears whole or not at all.
"""
from __future__ import annotations

import contextlib
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

from jaxrl.models.config import ModelConfig
from jaxrl.models.families import EXPERTS
from jaxrl.models.hf import (INDEX_FILE, SINGLE_FILE, TOKENIZER_FILES, HFError, _merged,
                             _names, hf_tensor)
from jaxrl.models.scan import layer_keys, path_keys, stacked_keys
from jaxrl.models.hf_config import default_max_positions, hf_config_dict

__all__ = ["export", "export_peft"]


def _hf_tensors(params: nnx.State, cfg: ModelConfig) -> tuple[list, bool]:
  """[(name, checkpoint shape, parameter, scale, expert or None)] in write order, and whether
  the files tie the LM head to the embedding. jaxrl's own tied head (embed / sqrt(d_model)) has
  no HF equivalent, so it is written out as an explicit lm_head: the embedding again, scaled."""
  tensors = []
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    keys = path_keys(path)
    # a scanned decoder's stacked block: each layer's tensors (part: (layer, expert or None))
    layers = [(layer_keys(keys, i), i) for i in range(x.shape[0])] if stacked_keys(keys) else [
        (keys, None)]
    for one, layer in layers:
      template, split = hf_tensor(one, cfg.family)
      shape = x.shape if layer is None else x.shape[1:]
      names = _names(template, split, shape)
      experts = range(len(names)) if split == EXPERTS else [None]
      tensors += [(one, (name, _merged(shape, split), x, None,
                         None if (layer, e) == (None, None) else (layer, e)))
                  for name, e in zip(names, experts)]
  # the unrolled model's order (its tree's: sorted keys), whichever form the blocks are in
  tensors = [t for _, t in sorted(tensors, key=lambda t: _order(t[0]))]
  has_head = any(t[0] == "lm_head.weight" for t in tensors)
  if has_head == cfg.tie_embeddings:
    raise HFError(f"params {'have' if has_head else 'lack'} lm_head but tie_embeddings="
                  f"{cfg.tie_embeddings}")
  if cfg.tie_embeddings and cfg.scale_tied_head:
    _, shape, embed, _, _ = next(t for t in tensors if t[0] == "model.embed_tokens.weight")
    tensors.append(("lm_head.weight", shape, embed, cfg.d_model**-0.5, None))
    return tensors, False
  return tensors, cfg.tie_embeddings


def _order(keys: tuple) -> tuple:
  return tuple((0, k, "") if isinstance(k, int) else (1, 0, str(k)) for k in keys)


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
  for name, shape, *_ in tensors:
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    header[name] = {"dtype": st_dtype, "shape": list(shape),
                    "data_offsets": [offset, offset + size]}
    offset += size
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") if path else contextlib.nullcontext() as f:
    if f:
      f.write(struct.pack("<Q", len(blob)) + blob)
    last = (None, None)  # an expert weight is gathered once for all its experts' tensors
    for _, shape, x, scale, part in tensors:
      if part is None:
        host = _to_host(x, shape, scale, dtype)
      else:  # (layer of a stacked block, expert): a layer is sliced on the devices first
        layer, expert = part
        if last[0] is None or last[0][0] is not x or last[0][1] != layer:
          one = x if layer is None else x[layer]
          last = ((x, layer), _to_host(one, one.shape, scale, dtype))
        host = last[1] if expert is None else last[1][expert]
      if f:
        np.ascontiguousarray(host).tofile(f)


def _write_weights(tmp: str | None, tensors: list, dtype: str, max_shard_bytes: int) -> None:
  st_dtype, np_dtype = {"float32": ("F32", np.float32), "bfloat16": ("BF16", jnp.bfloat16)}[dtype]
  sizes = [int(np.prod(shape)) * np.dtype(np_dtype).itemsize for _, shape, *_ in tensors]
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


def generation_config(tok, source_dir: str = "") -> dict:
  """generation_config.json for an export: `source_dir`'s (its sampling defaults) when it has
  one, with the tokenizer's ids; every stop id is an `eos_token_id` (e.g. Llama 3.1's <|eot_id|>
  and <|end_of_text|>)."""
  out = {}
  path = os.path.join(source_dir, "generation_config.json")
  if source_dir and os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      out = json.load(f)
  stops = list(tok.stop_ids)
  out.update(eos_token_id=stops[0] if len(stops) == 1 else stops, pad_token_id=tok.pad_id)
  if tok.bos_id is not None:
    out["bos_token_id"] = tok.bos_id
  return out
