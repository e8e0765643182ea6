"""Checkpoint items across the decoder's two forms (`model.layers.scan`, jaxrl/models/scan.py):
blocks per layer (`decoder/blocks/3/attn/wq`) or stacked (`decoder/blocks/attn/wq`, the layer on
axis 0), wherever an item holds a decoder (a model, its optimizer's moments).

Matched by path, not by pytree type: an optimizer's state mixes optax's named tuples, lists and
nnx's variables, which orbax writes as nested dicts and lists. The saved item is read in its own
structure (its metadata's), each array into the sharding of the model's leaf it belongs to (a
layer's: the stacked leaf's less the layer axis), and then stacked or sliced on the devices.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.models import scan

Path = tuple[str, ...]


def _norm(path) -> Path:
  """A tree path as strings: dict keys, named-tuple fields and sequence indices alike (orbax
  writes named tuples as dicts)."""
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _blocks_at(path: Path) -> int | None:
  """The index of `blocks` right after a `decoder` in `path` (None: no decoder block)."""
  for i in range(1, len(path) - 1):
    if path[i - 1] == "decoder" and path[i] == "blocks":
      return i
  return None


def form(tree) -> str:
  """"layers" or "stacked" where `tree` (arrays, abstract arrays or orbax metadata) holds
  decoder blocks, else ""."""
  for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
    key = _norm(path)
    if (b := _blocks_at(key)) is not None:
      return "layers" if key[b + 1].isdigit() else "stacked"
  return ""


def _flat(tree) -> dict[Path, object]:
  return {_norm(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def disk_target(abstract, metadata):
  """The restore target of an item saved in the other form: the saved structure (`metadata`,
  orbax's), each leaf the abstract array it is read into; a ValueError names a saved array the
  model has no place for."""
  ours = _flat(abstract)

  def leaf(path, meta):
    key = _norm(path)
    if key in ours:
      return ours[key]
    b = _blocks_at(key)
    if b is not None and key[b + 1].isdigit():  # saved per layer, held stacked
      stacked = key[:b + 1] + key[b + 2:]
      if stacked in ours:
        return scan.abstract_take(ours[stacked], int(key[b + 1]))
    elif b is not None:  # saved stacked, held per layer
      layers = [key[:b + 1] + (str(i),) + key[b + 1:] for i in range(meta.shape[0])]
      if all(k in ours for k in layers):
        return scan.abstract_stack([ours[k] for k in layers])
    raise ValueError(f"{'/'.join(key)}: saved, and this model has no place for it")
  return jax.tree_util.tree_map_with_path(leaf, metadata)


def from_disk(restored, abstract):
  """`restored` (the saved structure, read by `disk_target`) in `abstract`'s structure and form:
  layers stacked, or a stack sliced, on the devices."""
  disk = _flat(restored)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  out = []
  for path, x in leaves:
    key = _norm(path)
    b = _blocks_at(key)
    if key in disk:
      out.append(disk[key])
    elif b is not None and key[b + 1].isdigit():  # held per layer: its slice of the stack
      stack = disk[key[:b + 1] + key[b + 2:]]
      out.append(jax.jit(lambda s, i=int(key[b + 1]): s[i], out_shardings=x.sharding)(stack))
    else:  # held stacked: its layers
      layers = [disk[key[:b + 1] + (str(i),) + key[b + 1:]] for i in range(x.shape[0])]
      out.append(jax.jit(lambda *a: jnp.stack(a), out_shardings=x.sharding)(*layers))
  return jax.tree_util.tree_unflatten(treedef, out)
