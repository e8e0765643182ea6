"""Updates on preference pairs: the reward model's (Bradley-Terry) and DPO's."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxrl.algos import bradley_terry_loss, dpo_loss
from train.updates.forward import sequence_logprobs, sequence_scores
from train.updates.state import TrainState, apply_gradients


def reward_model_update(state: TrainState, batch, *, graphdef, optimizer):
  """Bradley-Terry on a pair batch (chosen rows, then rejected rows)."""

  def loss_fn(params):
    scores_B2 = sequence_scores(graphdef, params, batch["tokens"], batch["valid"])
    chosen_B, rejected_B = jnp.split(scores_B2, 2)
    return bradley_terry_loss(chosen_B, rejected_B).mean(), (chosen_B, rejected_B)

  (loss, (chosen_B, rejected_B)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  metrics = {"loss": loss, "accuracy": (chosen_B > rejected_B).mean(),
             "margin": (chosen_B - rejected_B).mean(), "grad_norm": optax.tree.norm(grads)}
  return apply_gradients(state, grads, optimizer, metrics)


def dpo_update(state: TrainState, batch, *, graphdef, optimizer, beta: float, prompt_len: int):
  """DPO's sigmoid loss; `batch["ref_logprobs"]` [2B] was computed once, before training."""

  def loss_fn(params):
    logp_B2 = sequence_logprobs(graphdef, params, batch["tokens"], batch["valid"],
                                batch["completion_mask"], prompt_len)
    ref_c, ref_r = jnp.split(batch["ref_logprobs"], 2)
    loss_B, margin_B = dpo_loss(*jnp.split(logp_B2, 2), ref_c, ref_r, beta=beta)
    return loss_B.mean(), margin_B

  (loss, margin_B), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  metrics = {"loss": loss, "margin": margin_B.mean(), "accuracy": (margin_B > 0).mean(),
             "grad_norm": optax.tree.norm(grads)}
  return apply_gradients(state, grads, optimizer, metrics)
