"""Updates on preference pairs: the reward model's (Bradley-Terry) and DPO's."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxrl.algos import bradley_terry_loss, dpo_loss
from train.updates.forward import sequence_logprobs, sequence_scores
from train.updates.prefix import prefix_scores, prefix_sequence_logprobs
from train.updates.state import TrainState, apply_gradients


def _paired(x):
  """A pair batch's rows (the chosen, then the rejected) as chosen i, rejected i, ..."""
  b = x.shape[0] // 2
  return x[jnp.arange(2 * b).reshape(2, b).T.reshape(-1)]


def _unpaired(x_B):
  return x_B.reshape(-1, 2).T.reshape(-1)


def pair_scores(graphdef, params, tokens_BT, valid_BT, *, prompt_len: int = 0,
                share: bool = False):
  """`sequence_scores` of a pair batch (the chosen rows, then the rejected rows), [2B];
  `share` (`reward_model.share_prefix`): each pair's prompt (`prompt_len` slots) run once."""
  if not share:
    return sequence_scores(graphdef, params, tokens_BT, valid_BT)
  return _unpaired(prefix_scores(graphdef, params, _paired(tokens_BT), _paired(valid_BT),
                                 prompt_len, 2))


def reward_model_update(state: TrainState, batch, *, graphdef, optimizer, prompt_len: int = 0,
                        share: bool = False):
  """Bradley-Terry on a pair batch (chosen rows, then rejected rows; `share`: each pair's
  prompt run once, `pair_scores`)."""

  def loss_fn(params):
    scores_B2 = pair_scores(graphdef, params, batch["tokens"], batch["valid"],
                            prompt_len=prompt_len, share=share)
    chosen_B, rejected_B = jnp.split(scores_B2, 2)
    return bradley_terry_loss(chosen_B, rejected_B).mean(), (chosen_B, rejected_B)

  (loss, (chosen_B, rejected_B)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  metrics = {"loss": loss, "accuracy": (chosen_B > rejected_B).mean(),
             "margin": (chosen_B - rejected_B).mean(), "grad_norm": optax.tree.norm(grads)}
  return apply_gradients(state, grads, optimizer, metrics)


def pair_logprobs(graphdef, params, tokens_BT, valid_BT, completion_mask_BN, *, prompt_len: int,
                  share: bool = False):
  """`sequence_logprobs` of a pair batch (the chosen rows, then the rejected rows), [2B];
  `share` (`dpo.share_prefix`): each pair's prompt run once, its two responses continuing from
  its KV cache (train/updates/prefix.py)."""
  if not share:
    return sequence_logprobs(graphdef, params, tokens_BT, valid_BT, completion_mask_BN,
                             prompt_len)
  return _unpaired(prefix_sequence_logprobs(graphdef, params, _paired(tokens_BT),
                                            _paired(valid_BT), _paired(completion_mask_BN),
                                            prompt_len, 2))


def dpo_update(state: TrainState, batch, *, graphdef, optimizer, beta: float, prompt_len: int,
               share: bool = False):
  """DPO's sigmoid loss; `batch["ref_logprobs"]` [2B] was computed once, before training
  (`share`: each pair's prompt run once, `pair_logprobs`)."""

  def loss_fn(params):
    logp_B2 = pair_logprobs(graphdef, params, batch["tokens"], batch["valid"],
                            batch["completion_mask"], prompt_len=prompt_len, share=share)
    ref_c, ref_r = jnp.split(batch["ref_logprobs"], 2)
    loss_B, margin_B = dpo_loss(*jnp.split(logp_B2, 2), ref_c, ref_r, beta=beta)
    return loss_B.mean(), margin_B

  (loss, margin_B), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  metrics = {"loss": loss, "margin": margin_B.mean(), "accuracy": (margin_B > 0).mean(),
             "grad_norm": optax.tree.norm(grads)}
  return apply_gradients(state, grads, optimizer, metrics)
