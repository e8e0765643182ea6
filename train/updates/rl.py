"""RL's updates: the policy loss with its rollout correction and KL, the policy update over
minibatches, and the critic's clipped value regression."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxrl.algos import KL_ESTIMATORS, POLICY_LOSSES
from jaxrl.algos.correction import mismatch, rollout_weights, tis_capped
from jaxrl.algos.losses import aggregation_weights, value_loss
from jaxrl.config import RLConfig
from train.updates.batching import accumulate_grads, compute_copy, micro_batches, scan_minibatches
from train.updates.forward import completion_values, routed_logprobs
from train.updates.packing import packed_logprobs
from train.updates.state import TrainState, apply_gradients


def hyperparameters(cfg: RLConfig) -> dict:
  """The estimators' and losses' hyperparameters, by the names they declare (jaxrl/algos)."""
  return {"group_size": cfg.group_size, "gamma": cfg.gamma, "lam": cfg.lam,
          "eps_low": cfg.clip_eps_low, "eps_high": cfg.clip_eps_high, "rho": cfg.aipo_rho}


def policy_loss(params, micro, *, graphdef, cfg: RLConfig):
  """`cfg.policy_loss` (jaxrl/algos/losses.py) times the rollout correction
  (jaxrl/algos/correction.py) plus, with `kl_mode == "loss"`, `kl_coef` * KL(pi || ref), minus
  `entropy_coef` * entropy, summed over completion tokens with `weights_BN`
  (`cfg.loss_aggregation` over the whole minibatch's `policy_mask_BN`: `aggregation_weights`),
  plus a mixture of experts' router loss (`forward.router_loss`).

  `micro` = (exp, weights_BN, token_weights_BN). `exp` (train/rl/experience.py) holds per-token
  [B, N] advantages, the trainer's log-probs before the update (`old`), the reference's, and the
  sampler's (mu, what it drew with). The metrics include the sampler/trainer mismatch
  (|log mu - log pi_old|, KL(mu || pi_old)) over every valid token (`token_weights_BN`: a token
  mean over the minibatch)."""
  exp, weights_BN, token_weights_BN = micro
  if exp.pack is not None:  # its rows packed to a token budget (train/updates/packing.py)
    logp_BN, entropy_BN, router, router_metrics = packed_logprobs(
        graphdef, params, exp.tokens_BT, exp.pack, exp.completion_mask_BN, exp.routes_BTLK)
  else:
    logp_BN, entropy_BN, router, router_metrics = routed_logprobs(
        graphdef, params, exp.tokens_BT, exp.valid_BT, start=exp.prompt_len - 1,
        routes_BTLK=exp.routes_BTLK)
  share = token_weights_BN.sum()  # this micro-batch's share of the minibatch's tokens
  old_BN = exp.old_logprobs_BN
  if old_BN is None:  # one minibatch: these weights are the ones before the update
    old_BN = jax.lax.stop_gradient(logp_BN)
  mu_BN, mask_BN = exp.sampler_logprobs_BN, exp.policy_mask_BN  # the policy's own tokens
  loss = POLICY_LOSSES[cfg.policy_loss]
  pg_BN = loss(logp_BN, exp.advantages_BN,
               {**hyperparameters(cfg), "old_BN": old_BN, "mu_BN": mu_BN, "mask_BN": mask_BN})
  correction_BN, kept_BN = rollout_weights(old_BN, mu_BN, mask_BN, mask=cfg.rollout_mask,
                                           low=cfg.rollout_mask_low,
                                           high=cfg.rollout_mask_high, tis_cap=cfg.tis_cap,
                                           in_loss=loss.behaviour_weighted)
  if cfg.tis_cap > 0 or cfg.rollout_mask != "none":
    pg_BN = pg_BN * correction_BN
  kl_BN = KL_ESTIMATORS[cfg.kl_estimator](logp_BN, exp.ref_logprobs_BN)
  loss_BN = pg_BN - cfg.entropy_coef * entropy_BN
  if cfg.kl_mode == "loss":
    loss_BN = loss_BN + cfg.kl_coef * kl_BN
  ratio_BN = loss.clip_ratio(logp_BN, old_BN, mask_BN)
  clipped_BN = (ratio_BN < 1 - cfg.clip_eps_low) | (ratio_BN > 1 + cfg.clip_eps_high)
  total = lambda x_BN: (x_BN * weights_BN).sum()
  per_token = lambda x_BN: (x_BN * token_weights_BN).sum()
  metrics = {"kl": total(kl_BN), "entropy": total(entropy_BN),
             "clip_frac": total(clipped_BN.astype(jnp.float32)),
             "rollout_masked_frac": per_token(1.0 - kept_BN),
             "tis_capped_frac": per_token(tis_capped(old_BN, mu_BN, cfg.tis_cap).astype(
                 jnp.float32)),
             **mismatch(old_BN, mu_BN, mask_BN, token_weights_BN),
             **{k: share * v for k, v in router_metrics.items()}}
  return total(loss_BN) + share * router, metrics


def rl_update(state: TrainState, exp, *, graphdef, optimizer, cfg: RLConfig):
  """`cfg.num_minibatches` policy updates on one Experience batch, each accumulating its
  gradient over `cfg.micro_batch_size`-row micro-batches."""

  def one(state, mb):
    weights_BN = aggregation_weights(cfg.loss_aggregation, mb.policy_mask_BN,
                                     horizon=cfg.max_new_tokens)
    token_weights_BN = aggregation_weights("token_mean", mb.policy_mask_BN)
    loss_fn = functools.partial(policy_loss, graphdef=graphdef, cfg=cfg)
    loss, metrics, grads = accumulate_grads(
        loss_fn, compute_copy(graphdef, state.params), (mb, weights_BN, token_weights_BN),
        micro_batches(mb.tokens_BT.shape[0], cfg.micro_batch_size))
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return apply_gradients(state, grads, optimizer, metrics)

  return scan_minibatches(one, state, exp, cfg.num_minibatches)


def critic_update(state: TrainState, exp, *, graphdef, optimizer, cfg: RLConfig):
  """Clipped value regression onto `returns` (= advantages before whitening + old values), in
  the same minibatches as the policy update."""

  def loss_fn(params, micro):
    mb, weights_BN = micro
    values_BN = completion_values(graphdef, params, mb.tokens_BT, mb.valid_BT, mb.prompt_len)
    per_token = value_loss(values_BN, mb.old_values_BN, mb.returns_BN, clip_eps=cfg.value_clip_eps)
    return (per_token * weights_BN).sum(), {}

  def one(state, mb):
    weights_BN = aggregation_weights("token_mean", mb.completion_mask_BN)
    loss, _, grads = accumulate_grads(loss_fn, compute_copy(graphdef, state.params),
                                      (mb, weights_BN),
                                      micro_batches(mb.tokens_BT.shape[0], cfg.micro_batch_size))
    return apply_gradients(state, grads, optimizer,
                           {"value_loss": loss, "critic_grad_norm": optax.tree.norm(grads)},
                           prefix="critic_")

  return scan_minibatches(one, state, exp, cfg.num_minibatches)
