"""A scanned decoder (`model.layers.scan`): the blocks' parameters stacked along a leading
`layers` axis, and the cacheless passes (training, scoring) as one `jax.lax.scan` over them, so
the block is traced and compiled once whatever the depth (MaxText's `scan_layers`).

The stacked block is built from the same per-layer blocks as the unrolled decoder (the same
random streams, so the same weights), each variable's value stacked and `layers` prepended to
its logical axes (no rule names it: the axis is never split). A layer pattern (Gemma 3's local
and global layers, every `global_every`-th global) repeats with a period: the scan runs over whole
periods, its body the period's layers in turn (each with its own kind of attention), and the
layers after the last whole period run unrolled. Passes with a KV cache (prefill, decode) scan
too: the cache is stacked per layer (rows first, then layers: attention.StackedLayer), carried
through the scan, each layer's new keys and values written at [rows, layer, ..., slot] in place.

Checkpoints and Hugging Face files name the weights per layer (`decoder/blocks/{i}/...`,
`layer_keys`); train/io/layer_forms.py converts checkpoint items between the two forms.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

LAYERS = "layers"  # the logical name of the stacked axis (in no rules table: never split)


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def stack_blocks(blocks: list[nnx.Module]) -> nnx.Module:
  """One module like `blocks[0]` whose every variable holds all the blocks' values, stacked."""
  graphdef, first = nnx.split(blocks[0])
  states = [first] + [nnx.state(b) for b in blocks[1:]]

  def stack(*vs):
    axes = vs[0].get_metadata().get("logical_axes")
    extra = {} if axes is None else {"logical_axes": (LAYERS, *axes)}
    return vs[0].replace(jnp.stack([v[...] for v in vs]), **extra)
  return nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=_is_variable))


def layer_view(stacked: nnx.Module, i) -> nnx.Module:
  """Layer `i` of a stacked block, as an unstacked block (its variables' slices)."""
  graphdef, state = nnx.split(stacked)
  return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))


def period(cfg) -> int:
  """Layers per repeat of the decoder's layer pattern: 1 unless local and global layers
  alternate (`global_every`)."""
  a = cfg.attention
  return a.global_every if a.sliding_window and a.global_every else 1


def scan_periods(stacked: nnx.Module, n_periods: int, size: int, carry, layer_fn,
                 routes_LBTK=None, indexed: bool = False):
  """`layer_fn(j, i, block, carry, routes_BTK) -> (carry, stats)` over the first `n_periods` x
  `size` layers of `stacked` (i: the layer, traced; j: its place in its period), one scan step
  per period: (carry, the layers' stats stacked on a leading axis, or None). The layers' weights
  are the scan's inputs, or with `indexed` (a pass never differentiated) read by index from the
  whole stack inside it: scanning fewer layers than the stack holds then slices no copy of it
  (a prefill's scan stops before the last layer, which runs for the last position alone)."""
  if n_periods == 0:  # (fewer layers than one period: all of them unrolled by the caller)
    return carry, None
  graphdef, state = nnx.split(stacked)
  cut = lambda a: a[:n_periods * size].reshape(n_periods, size, *a.shape[1:])
  weights = None if indexed else jax.tree.map(cut, state)
  xs = (jnp.arange(n_periods, dtype=jnp.int32), weights,
        None if routes_LBTK is None else cut(routes_LBTK))

  def body(carry, period_xs):
    p, period_state, routes = period_xs
    stats = []
    for j in range(size):
      i = p * size + j
      take = ((lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)) if indexed
              else (lambda a: a[j]))
      block = nnx.merge(graphdef, jax.tree.map(take, state if indexed else period_state))
      carry, st = layer_fn(j, i, block, carry, None if routes is None else routes[j])
      stats.append(st)
    return carry, None if stats[0] is None else jax.tree.map(lambda *s: jnp.stack(s), *stats)

  carry, stats = jax.lax.scan(body, carry, xs)
  merge = lambda a: a.reshape(n_periods * size, *a.shape[2:])
  return carry, None if stats is None else jax.tree.map(merge, stats)


def path_keys(path) -> tuple:
  """A parameter's keys (`('decoder', 'blocks', 0, 'attn', 'wq')`) from a tree path of an
  nnx.State (Variables add a `.value` attribute key, dropped here) or of a pure dict."""
  return tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path
               if not isinstance(k, jax.tree_util.GetAttrKey))


def stacked_keys(keys: tuple) -> bool:
  """Whether `keys` name a scanned decoder's stacked block parameter (`decoder.blocks.attn.wq`,
  every layer's on axis 0) rather than one layer's (`decoder.blocks.0.attn.wq`)."""
  return keys[:2] == ("decoder", "blocks") and len(keys) > 2 and _layer_key(keys[2]) is None


def layer_keys(keys: tuple, i) -> tuple:
  """The keys (or tree path) of layer `i`'s part of a stacked block parameter: the layer after
  `decoder, blocks`, as the unrolled model names it."""
  return tuple(keys[:2]) + (i,) + tuple(keys[2:])


def _layer_key(key) -> int | None:
  return key if isinstance(key, int) else int(key) if isinstance(key, str) and key.isdigit() \
      else None


# -- abstract leaves of one form as the other's (train/io/layer_forms.py) ----------------------
def abstract_take(x, i):
  """Layer i of an abstract stacked leaf: its shape and sharding less the layer axis."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding):
    sharding = jax.sharding.NamedSharding(sharding.mesh,
                                          jax.sharding.PartitionSpec(*sharding.spec[1:]))
  return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)


def abstract_stack(xs):
  """The abstract stacked leaf of abstract layers: a leading layer axis, never split."""
  x, sharding = xs[0], getattr(xs[0], "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding):
    sharding = jax.sharding.NamedSharding(sharding.mesh,
                                          jax.sharding.PartitionSpec(None, *sharding.spec))
  return jax.ShapeDtypeStruct((len(xs),) + tuple(x.shape), x.dtype, sharding=sharding)
