"""SFT's update: cross-entropy on the answer tokens."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from train.updates.forward import routed_logprobs
from train.updates.state import TrainState, apply_gradients


def sft_update(state: TrainState, batch, *, graphdef, optimizer):
  """Cross-entropy on the answer tokens only (`loss_mask` marks them), plus a mixture of
  experts' router loss; packed batches carry `segment_ids`."""

  def loss_fn(params):
    logp_BT, _, router, metrics = routed_logprobs(graphdef, params, batch["tokens"],
                                                  batch["valid"], batch.get("segment_ids"))
    mask_BT = batch["loss_mask"][:, 1:]
    return -(logp_BT * mask_BT).sum() / jnp.maximum(mask_BT.sum(), 1) + router, metrics

  (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return apply_gradients(state, grads, optimizer,
                         {"loss": loss, "grad_norm": optax.tree.norm(grads), **metrics})
