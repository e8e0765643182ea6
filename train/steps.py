"""Pure update steps. Each is jitted in exactly one place (train/trainer.py) with donated state."""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl.algos import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from jaxrl.config import RLConfig
from jaxrl.models.llama import positions_from_valid


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: nnx.State
  opt_state: optax.OptState


def make_optimizer(learning_rate: float, *, warmup_steps: int = 0, total_steps: int = 1,
                   weight_decay: float = 0.0, max_grad_norm: float = 1.0):
  warmup_steps = max(warmup_steps, 1)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, learning_rate, warmup_steps, max(total_steps, warmup_steps + 1), learning_rate * 0.1)
  return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                     optax.adamw(schedule, b2=0.98, weight_decay=weight_decay))


def token_logprobs(graphdef, params, tokens_BT, valid_BT):
  """log pi(tokens[t+1] | tokens[:t+1]) and the entropy of that distribution, shapes [B, T-1]."""
  model = nnx.merge(graphdef, params)
  logits_BTV, _ = model(tokens_BT, positions_from_valid(valid_BT), valid_BT)
  logp_all_BTV = jax.nn.log_softmax(logits_BTV[:, :-1], axis=-1)
  logp_BT = jnp.take_along_axis(logp_all_BTV, tokens_BT[:, 1:, None], axis=-1)[..., 0]
  entropy_BT = -(jnp.exp(logp_all_BTV) * logp_all_BTV).sum(-1)
  return logp_BT, entropy_BT


def completion_logprobs(graphdef, params, tokens_BT, valid_BT, prompt_len: int):
  """Log-probs and entropies of the completion slots (the last T - prompt_len tokens)."""
  logp_BT, entropy_BT = token_logprobs(graphdef, params, tokens_BT, valid_BT)
  return logp_BT[:, prompt_len - 1:], entropy_BT[:, prompt_len - 1:]


def _apply(state: TrainState, grads, optimizer) -> TrainState:
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  return TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                    opt_state=opt_state)


def sft_update(state: TrainState, batch, *, graphdef, optimizer):
  """Cross-entropy on the answer tokens only (`loss_mask` marks them)."""

  def loss_fn(params):
    logp_BT, _ = token_logprobs(graphdef, params, batch["tokens"], batch["valid"])
    mask_BT = batch["loss_mask"][:, 1:]
    return -(logp_BT * mask_BT).sum() / jnp.maximum(mask_BT.sum(), 1)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return _apply(state, grads, optimizer), {"loss": loss, "grad_norm": optax.global_norm(grads)}


def advantages(rewards_B: jax.Array, mask_BN: jax.Array, *, cfg: RLConfig) -> jax.Array:
  """Per-token advantages `adv_BN` from sequence rewards (critic-free estimators)."""
  return ADVANTAGES[cfg.advantage](rewards_B, mask_BN.astype(jnp.float32), group_size=cfg.group_size)


def policy_loss(params, batch, *, graphdef, cfg: RLConfig, prompt_len: int):
  """Clipped policy loss plus `kl_coef` * KL(pi || ref), aggregated over completion tokens;
  `batch["advantages"]` is per token [B, N]."""
  logp_BN, entropy_BN = completion_logprobs(graphdef, params, batch["tokens"], batch["valid"],
                                            prompt_len)
  mask_BN = batch["completion_mask"].astype(jnp.float32)
  pg_BN = POLICY_LOSSES["ppo_clip"](logp_BN, batch["old_logprobs"], batch["advantages"],
                                    eps_low=cfg.clip_eps_low, eps_high=cfg.clip_eps_high)
  kl_BN = KL_ESTIMATORS[cfg.kl_estimator](logp_BN, batch["ref_logprobs"])
  aggregate = AGGREGATIONS[cfg.loss_aggregation]
  loss = aggregate(pg_BN + cfg.kl_coef * kl_BN, mask_BN)
  ratio_BN = jnp.exp(logp_BN - batch["old_logprobs"])
  clipped_BN = (ratio_BN < 1 - cfg.clip_eps_low) | (ratio_BN > 1 + cfg.clip_eps_high)
  metrics = {"kl": aggregate(kl_BN, mask_BN), "entropy": aggregate(entropy_BN, mask_BN),
             "clip_frac": aggregate(clipped_BN.astype(jnp.float32), mask_BN)}
  return loss, metrics


def rl_update(state: TrainState, batch, *, graphdef, optimizer, cfg: RLConfig, prompt_len: int):
  grad_fn = jax.value_and_grad(policy_loss, has_aux=True)
  (loss, metrics), grads = grad_fn(state.params, batch, graphdef=graphdef, cfg=cfg,
                                   prompt_len=prompt_len)
  metrics = dict(metrics, loss=loss, grad_norm=optax.global_norm(grads))
  return _apply(state, grads, optimizer), metrics
