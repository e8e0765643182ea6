"""How an update walks its batch: minibatches (one optimizer step each), micro-batches (one
gradient each, accumulated), and the compute-dtype copy of the weights they multiply."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.models.dtypes import cast_to, compute_dtypes
from train.updates.state import TrainState, model_of


def split_minibatches(tree, n: int):
  """Every leaf [B, ...] -> [n, B / n, ...]; minibatch j takes rows j, j + n, j + 2n, ... so each
  device's block of rows feeds every minibatch equally and the split moves no data."""
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1),
                      tree)


def map_minibatches(fn, batch, n: int):
  """`fn(minibatch) -> [B / n, ...]` over `n` strided minibatches of `batch`, one after another
  (a scoring pass then holds one minibatch's [B / n, T, V] logits at a time, not the batch's),
  the results back in row order."""
  out = jax.lax.map(fn, split_minibatches(batch, n))
  return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:]), out)


def scan_minibatches(update_one, state: TrainState, batch, n: int):
  """`update_one(state, minibatch) -> (state, metrics)` over `n` minibatches of `batch`, in
  one program; metrics are averaged over the minibatches."""
  state, metrics = jax.lax.scan(update_one, state, split_minibatches(batch, n))
  return state, {k: (jnp.max if k.endswith("_max") else jnp.mean)(v) for k, v in metrics.items()}


def add_metrics(a: dict, b: dict) -> dict:
  """Two micro-batches' metrics together: sums, except the maxima (keys ending in `_max`)."""
  return {k: (jnp.maximum if k.endswith("_max") else jnp.add)(a[k], b[k]) for k in a}


def compute_copy(graphdef, params):
  """The trained weights as the forward multiplies them: the decoder layers' matrices cast to the
  model's compute dtype once per minibatch, not once per micro-batch and layer call (a no-op for
  a float32 model). Their gradients are those of the bf16 products, as before (the model casts
  where it multiplies); the embedding and an untied head stay float32, so the gradients the
  log-prob head and the token lookup give them add up in float32."""
  cfg = model_of(graphdef, params).decoder.cfg  # traced: merging copies nothing
  edges = ("embed", "lm_head")
  dtypes = jax.tree_util.tree_map_with_path(
      lambda path, d: None if any(getattr(k, "key", None) in edges for k in path) else d,
      compute_dtypes(cfg, params))
  return cast_to(params, dtypes)


def accumulate_grads(loss_fn, params, batch, n: int):
  """`loss_fn(params, micro) -> (loss, metrics)` over `n` strided micro-batches of `batch`, one
  after another in one program: (loss, metrics, grads), each summed over the micro-batches, the
  gradients in float32 whatever `params`' dtypes (a compute-dtype copy: `compute_copy`).
  `loss_fn` must return sums over its rows with minibatch-wide weights (`aggregation_weights`),
  so the sum is exactly the minibatch's. Smaller products that stay in cache run faster on the
  CPU (docs/benchmarks.md) and hold 1/n of the activations; the FLOPs are the same."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  as_f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  if n == 1:
    (loss, metrics), grads = grad_fn(params, batch)
    return loss, metrics, as_f32(grads)
  micro = split_minibatches(batch, n)
  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32),
                       jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro)))
  def body(acc, mb):
    (loss, metrics), grads = grad_fn(params, mb)
    ((acc_loss, acc_metrics), acc_grads) = acc
    return ((acc_loss + loss, add_metrics(acc_metrics, metrics)),
            jax.tree.map(jnp.add, acc_grads, grads)), None

  ((loss, metrics), grads), _ = jax.lax.scan(body, zeros, micro)
  return loss, metrics, grads


def micro_batches(rows: int, micro_batch_size: int) -> int:
  """How many micro-batches a minibatch of `rows` rows splits into (0: one)."""
  return rows // micro_batch_size if micro_batch_size else 1
