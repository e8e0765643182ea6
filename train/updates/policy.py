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
from jaxrl.config_rl import RLConfig
from train.updates.batching import accumulate_grads, compute_copy, micro_batches, scan_minibatches
from train.updates.packing import packed_logprobs
from train.updates.prefix import completion_pass, values_pass
from train.updates.replay import minibatch_values, ride
from train.updates.state import TrainState, apply_gradients


def policy_loss(params, micro, *, graphdef, cfg: RLConfig):
  """`cfg.loss.name` (jaxrl/algos/losses.py, reading its hyperparameters from `cfg.loss`) times
  the rollout correction (jaxrl/algos/correction.py, `cfg.correction`) plus, with `cfg.kl.mode`
  "loss", `kl.coef` * KL(pi || ref), minus `loss.entropy_coef` * entropy, summed over completion
  tokens with `weights_BN` (`loss.aggregation` over the whole minibatch's `policy_mask_BN`:
  `aggregation_weights`), plus a mixture of experts' router loss (`forward.router_loss`).

  `micro` = (exp, weights_BN, token_weights_BN). `exp` (train/loop/experience.py) holds per-token
  [B, N] advantages, the trainer's log-probs before the update (`old`; exact sync rollouts: the
  sampler's, the same numbers), the reference's, and the sampler's (mu, what it drew with). The
  metrics include the sampler/trainer mismatch (|log mu - log pi_old|, KL(mu || pi_old)) over
  every valid token (`token_weights_BN`: a token mean over the minibatch; exact sync steps
  keep it only where the old pass ran, `Controller.step`). Under `rl.rollout.exact="replay"`
  `micro` ends with the log-probs' values [B, N] (`policy_update`: the sampler's decode
  loop's, train/updates/replay.py)."""
  exp, weights_BN, token_weights_BN, *replayed = micro
  if exp.pack is not None:  # its rows packed to a token budget (train/updates/packing.py)
    logp_BN, entropy_BN, router, router_metrics = packed_logprobs(
        graphdef, params, exp.tokens_BT, exp.pack, exp.completion_mask_BN, exp.routes_BTLK,
        temperature=cfg.rollout.temperature, tree=cfg.shares_prefix)
  else:  # (`share_group` > 1: each prompt run once for its rows, train/updates/prefix.py)
    logp_BN, entropy_BN, router, router_metrics = completion_pass(
        graphdef, params, exp.tokens_BT, exp.valid_BT, exp.prompt_len, exp.routes_BTLK,
        temperature=cfg.rollout.temperature, group=cfg.share_group)
  if replayed:  # the values the sampler's decode loop's (train/updates/replay.py)
    logp_BN = ride(replayed[0], logp_BN)
  share = token_weights_BN.sum()  # this micro-batch's share of the minibatch's tokens
  old_BN = exp.old_logprobs_BN
  if old_BN is None:  # one minibatch: these weights are the ones before the update
    old_BN = jax.lax.stop_gradient(logp_BN)
  mu_BN, mask_BN = exp.sampler_logprobs_BN, exp.policy_mask_BN  # the policy's own tokens
  loss = POLICY_LOSSES[cfg.loss.name]
  pg_BN, loss_metrics = loss(logp_BN, exp.advantages_BN,
                             {**vars(cfg.loss), "old_BN": old_BN, "mu_BN": mu_BN,
                              "mask_BN": mask_BN})
  correction = cfg.correction
  correction_BN, kept_BN = rollout_weights(old_BN, mu_BN, mask_BN, **vars(correction),
                                           behaviour=loss.behaviour_weighted)
  if correction.active or loss.behaviour_weighted:
    pg_BN = pg_BN * correction_BN
  kl_BN = KL_ESTIMATORS[cfg.kl.estimator](logp_BN, exp.ref_logprobs_BN)
  loss_BN = pg_BN - cfg.loss.entropy_coef * entropy_BN
  if cfg.kl.mode == "loss":
    loss_BN = loss_BN + cfg.kl.coef * kl_BN
  total = lambda x_BN: (x_BN * weights_BN).sum()
  per_token = lambda x_BN: (x_BN * token_weights_BN).sum()
  metrics = {"kl": total(kl_BN), "entropy": total(entropy_BN),
             **{k: total(v_BN) for k, v_BN in loss_metrics.items()},
             "rollout_masked_frac": per_token(1.0 - kept_BN),
             "tis_capped_frac": per_token(tis_capped(old_BN, mu_BN, correction.tis_cap).astype(
                 jnp.float32)),
             **mismatch(old_BN, mu_BN, mask_BN, token_weights_BN),
             **{k: share * v for k, v in router_metrics.items()}}
  return total(loss_BN) + share * router, metrics


def policy_update(state: TrainState, exp, *, graphdef, optimizer, cfg: RLConfig):
  """`cfg.batching.num_minibatches` policy updates on one Experience batch, each accumulating
  its gradient over `cfg.batching.micro_batch_size`-row micro-batches."""
  batching = cfg.batching

  n = batching.num_minibatches  # (minibatch j holds index j)

  def one(state, mb_i):
    mb, i = mb_i
    weights_BN = aggregation_weights(cfg.loss.aggregation, mb.policy_mask_BN,
                                     horizon=cfg.rollout.max_new_tokens)
    token_weights_BN = aggregation_weights("token_mean", mb.policy_mask_BN)
    loss_fn = functools.partial(policy_loss, graphdef=graphdef, cfg=cfg)
    params, micro = compute_copy(graphdef, state.params), (mb, weights_BN, token_weights_BN)
    if cfg.rollout.exact == "replay":  # (before the first minibatch: the old log-probs)
      micro += (minibatch_values(graphdef, params, mb.tokens_BT, mb.valid_BT, mb.prompt_len,
                                 cfg.rollout.temperature, mb.old_logprobs_BN,
                                 i[0] == 0 if n > 1 else True, cfg.replay_group,
                                 mb.routes_BTLK),)
    loss, metrics, grads = accumulate_grads(
        loss_fn, params, micro, micro_batches(mb.tokens_BT.shape[0], batching.micro_batch_size))
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return apply_gradients(state, grads, optimizer, metrics)

  return scan_minibatches(one, state, (exp, jnp.arange(n)), n)


def critic_update(state: TrainState, exp, *, graphdef, optimizer, cfg: RLConfig):
  """Clipped value regression onto `returns` (= advantages before whitening + old values), in
  the same minibatches as the policy update."""

  def loss_fn(params, micro):
    mb, weights_BN = micro
    values_BN = values_pass(graphdef, params, mb.tokens_BT, mb.valid_BT, mb.prompt_len,
                            cfg.share_group)
    per_token = value_loss(values_BN, mb.old_values_BN, mb.returns_BN,
                           clip_eps=cfg.critic.clip_eps)
    return (per_token * weights_BN).sum(), {}

  def one(state, mb):
    weights_BN = aggregation_weights("token_mean", mb.completion_mask_BN)
    loss, _, grads = accumulate_grads(loss_fn, compute_copy(graphdef, state.params),
                                      (mb, weights_BN),
                                      micro_batches(mb.tokens_BT.shape[0],
                                                    cfg.batching.micro_batch_size))
    return apply_gradients(state, grads, optimizer,
                           {"value_loss": loss, "critic_grad_norm": optax.tree.norm(grads)},
                           prefix="critic_")

  return scan_minibatches(one, state, exp, cfg.batching.num_minibatches)
