"""Pure update steps. Each is jitted in exactly one place (train/learner.py) with donated state."""
from __future__ import annotations

import functools
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl.algos import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES, bradley_terry_loss, dpo_loss
from jaxrl.algos.logprobs import chunked_logprobs
from jaxrl.algos.correction import mismatch, rollout_weights, tis_capped
from jaxrl.algos.losses import aggregation_weights, sequence_log_ratio, value_loss
from jaxrl.config import RLConfig
from jaxrl.models.dtypes import cast_to, compute_dtypes
from jaxrl.models.transformer import positions_from_segments, positions_from_valid


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: nnx.State
  opt_state: optax.OptState


class Frozen(NamedTuple):
  """A model's graph with the parameters an update leaves alone (LoRA's base: the learner
  trains the adapters only, train/learner.py); the update's `params` are the trained rest."""
  graphdef: nnx.GraphDef
  params: nnx.State


def model_of(graphdef, params):
  """The module of `graphdef` (or a `Frozen` graph with its frozen parameters) and `params`."""
  if isinstance(graphdef, Frozen):
    return nnx.merge(graphdef.graphdef, graphdef.params, params)
  return nnx.merge(graphdef, params)


NEVER_GIVE_UP = 2**30  # optax.apply_if_finite applies non-finite updates after this many


def make_optimizer(learning_rate: float, *, warmup_steps: int = 0, total_steps: int = 1,
                   weight_decay: float = 0.0, max_grad_norm: float = 1.0):
  """Clipped AdamW on a warm-up + cosine schedule. An update whose gradients hold a NaN or an
  Inf (from a NaN reward, advantage or loss too) is skipped: parameters, moments and schedule
  stay as they were, and the optimizer state counts it (`guard_metrics`); the run decides
  when too many in a row are too many (train/hooks.py, `NonFinite`)."""
  warmup_steps = max(warmup_steps, 1)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, learning_rate, warmup_steps, max(total_steps, warmup_steps + 1), learning_rate * 0.1)
  return optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(max_grad_norm),
                                           optax.adamw(schedule, b2=0.98,
                                                       weight_decay=weight_decay)),
                               max_consecutive_errors=NEVER_GIVE_UP)


def guard_metrics(opt_state, prefix: str = "") -> dict:
  """Whether the update just made was skipped for non-finite gradients (1.0) or applied (0.0),
  and how many in a row have been skipped (`..._max`: the most over a step's minibatches)."""
  if not isinstance(opt_state, optax.ApplyIfFiniteState):
    return {}
  return {f"{prefix}skipped_updates": 1.0 - opt_state.last_finite.astype(jnp.float32),
          f"{prefix}skipped_in_a_row_max": opt_state.notfinite_count}


def token_logprobs(graphdef, params, tokens_BT, valid_BT, segment_ids_BT=None, start: int = 0):
  """log pi(tokens[t+1] | tokens[:t+1]) and the entropy of that distribution for positions
  t = start .. T-2, shapes [B, T-1-start]. The LM head and softmax run only at those positions
  and in chunks (jaxrl/algos/logprobs.py): no [B, T, V] logits tensor, forward or backward.

  With `segment_ids_BT` (packed rows) positions restart and attention stays in each segment."""
  model = model_of(graphdef, params)
  if segment_ids_BT is None:
    h_BTD, _ = model.decoder(tokens_BT, positions_from_valid(valid_BT), valid_BT)
  else:
    h_BTD, _ = model.decoder(tokens_BT, positions_from_segments(segment_ids_BT), valid_BT,
                             segment_ids_BT=segment_ids_BT)
  return chunked_logprobs(h_BTD[:, start:-1], model.head_VD(), tokens_BT[:, start + 1:])


def completion_logprobs(graphdef, params, tokens_BT, valid_BT, prompt_len: int):
  """Log-probs and entropies of the completion slots (the last T - prompt_len tokens)."""
  return token_logprobs(graphdef, params, tokens_BT, valid_BT, start=prompt_len - 1)


def _apply(state: TrainState, grads, optimizer, metrics: dict, prefix: str = ""):
  """(the state after the update, `metrics` with the non-finite guard's)."""
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  state = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                     opt_state=opt_state)
  return state, {**metrics, **guard_metrics(opt_state, prefix)}


def sft_update(state: TrainState, batch, *, graphdef, optimizer):
  """Cross-entropy on the answer tokens only (`loss_mask` marks them); packed batches carry
  `segment_ids`."""

  def loss_fn(params):
    logp_BT, _ = token_logprobs(graphdef, params, batch["tokens"], batch["valid"],
                               batch.get("segment_ids"))
    mask_BT = batch["loss_mask"][:, 1:]
    return -(logp_BT * mask_BT).sum() / jnp.maximum(mask_BT.sum(), 1)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return _apply(state, grads, optimizer, {"loss": loss, "grad_norm": optax.tree.norm(grads)})


def advantages(rewards_B, mask_BN, kl_BN=None, values_BN=None, *, cfg: RLConfig):
  """Per-token advantages from sequence rewards: `(adv_BN, raw_BN)`, where `raw_BN` is before
  `cfg.whiten_advantages` (normalising over the batch's valid tokens); with a critic the value
  targets are `raw_BN + values_BN`. With `cfg.kl_mode == "reward"`, `kl_coef * kl_BN` is taken
  from the per-token rewards (reinforce_pp, PPO); `gae` needs the critic's `values_BN`."""
  mask_BN = mask_BN.astype(jnp.float32)
  kl_coef = cfg.kl_coef if cfg.kl_mode == "reward" else 0.0
  raw_BN = ADVANTAGES[cfg.advantage](rewards_B, mask_BN, group_size=cfg.group_size, kl_BN=kl_BN,
                                     kl_coef=kl_coef, values_BN=values_BN, gamma=cfg.gamma,
                                     lam=cfg.lam)
  adv_BN = raw_BN
  if cfg.whiten_advantages:
    count = jnp.maximum(mask_BN.sum(), 1.0)
    mean = (raw_BN * mask_BN).sum() / count
    std = jnp.sqrt((((raw_BN - mean) * mask_BN)**2).sum() / count)
    adv_BN = (raw_BN - mean) / (std + 1e-6) * mask_BN
  return adv_BN, raw_BN


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


def micro_batches(exp, cfg: RLConfig) -> int:
  """How many micro-batches one minibatch of `exp` splits into (`cfg.micro_batch_size` rows)."""
  rows = exp.tokens_BT.shape[0]
  return rows // cfg.micro_batch_size if cfg.micro_batch_size else 1


def policy_loss(params, micro, *, graphdef, cfg: RLConfig):
  """`cfg.policy_loss` (jaxrl/algos/losses.py) times the rollout correction
  (jaxrl/algos/correction.py) plus, with `kl_mode == "loss"`, `kl_coef` * KL(pi || ref), minus
  `entropy_coef` * entropy, summed over completion tokens with `weights_BN`
  (`cfg.loss_aggregation` over the whole minibatch's `policy_mask_BN`: `aggregation_weights`).

  `micro` = (exp, weights_BN, token_weights_BN). `exp` (train/experience.py) holds per-token
  [B, N] advantages, the trainer's log-probs before the update (`old`), the reference's, and the
  sampler's (mu, what it drew with). The metrics include the sampler/trainer mismatch
  (|log mu - log pi_old|, KL(mu || pi_old)) over every valid token (`token_weights_BN`: a token
  mean over the minibatch)."""
  exp, weights_BN, token_weights_BN = micro
  logp_BN, entropy_BN = completion_logprobs(graphdef, params, exp.tokens_BT, exp.valid_BT,
                                            exp.prompt_len)
  old_BN = exp.old_logprobs_BN
  if old_BN is None:  # one minibatch: these weights are the ones before the update
    old_BN = jax.lax.stop_gradient(logp_BN)
  mu_BN, mask_BN = exp.sampler_logprobs_BN, exp.policy_mask_BN  # the policy's own tokens
  pg_BN = POLICY_LOSSES[cfg.policy_loss](
      logp_BN, exp.advantages_BN, old_BN=old_BN, mu_BN=mu_BN, mask_BN=mask_BN,
      eps_low=cfg.clip_eps_low, eps_high=cfg.clip_eps_high, rho=cfg.aipo_rho)
  correction_BN, kept_BN = rollout_weights(old_BN, mu_BN, mask_BN, mask=cfg.rollout_mask,
                                           low=cfg.rollout_mask_low,
                                           high=cfg.rollout_mask_high, tis_cap=cfg.tis_cap)
  if cfg.tis_cap > 0 or cfg.rollout_mask != "none":
    pg_BN = pg_BN * correction_BN
  kl_BN = KL_ESTIMATORS[cfg.kl_estimator](logp_BN, exp.ref_logprobs_BN)
  loss_BN = pg_BN - cfg.entropy_coef * entropy_BN
  if cfg.kl_mode == "loss":
    loss_BN = loss_BN + cfg.kl_coef * kl_BN
  if cfg.policy_loss == "gspo":  # clipped per sequence
    ratio_BN = jnp.exp(sequence_log_ratio(logp_BN, old_BN, mask_BN))[:, None]
  else:
    ratio_BN = jnp.exp(logp_BN - old_BN)
  clipped_BN = (ratio_BN < 1 - cfg.clip_eps_low) | (ratio_BN > 1 + cfg.clip_eps_high)
  total = lambda x_BN: (x_BN * weights_BN).sum()
  per_token = lambda x_BN: (x_BN * token_weights_BN).sum()
  metrics = {"kl": total(kl_BN), "entropy": total(entropy_BN),
             "clip_frac": total(clipped_BN.astype(jnp.float32)),
             "rollout_masked_frac": per_token(1.0 - kept_BN),
             "tis_capped_frac": per_token(tis_capped(old_BN, mu_BN, cfg.tis_cap).astype(
                 jnp.float32)),
             **mismatch(old_BN, mu_BN, mask_BN, token_weights_BN)}
  return total(loss_BN), metrics


def rl_update(state: TrainState, exp, *, graphdef, optimizer, cfg: RLConfig):
  """`cfg.num_minibatches` policy updates on one Experience batch, each accumulating its
  gradient over `cfg.micro_batch_size`-row micro-batches."""

  def one(state, mb):
    weights_BN = aggregation_weights(cfg.loss_aggregation, mb.policy_mask_BN,
                                     horizon=cfg.max_new_tokens)
    token_weights_BN = aggregation_weights("token_mean", mb.policy_mask_BN)
    loss_fn = functools.partial(policy_loss, graphdef=graphdef, cfg=cfg)
    loss, metrics, grads = accumulate_grads(loss_fn, compute_copy(graphdef, state.params),
                                            (mb, weights_BN, token_weights_BN),
                                            micro_batches(mb, cfg))
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return _apply(state, grads, optimizer, metrics)

  return scan_minibatches(one, state, exp, cfg.num_minibatches)


# -- critic, reward model, DPO -------------------------------------------------------------------
def completion_values(graphdef, params, tokens_BT, valid_BT, prompt_len: int) -> jax.Array:
  """Critic values of the states before each completion token, [B, N] (aligned with the
  log-probs: value i is read where token i is predicted)."""
  model = model_of(graphdef, params)
  values_BT = model(tokens_BT, positions_from_valid(valid_BT), valid_BT)
  return values_BT[:, prompt_len - 1:-1]


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
                                      (mb, weights_BN), micro_batches(mb, cfg))
    return _apply(state, grads, optimizer, {"value_loss": loss,
                                            "critic_grad_norm": optax.tree.norm(grads)},
                  prefix="critic_")

  return scan_minibatches(one, state, exp, cfg.num_minibatches)


def sequence_scores(graphdef, params, tokens_BT, valid_BT) -> jax.Array:
  """Reward-model score of each whole sequence, [B]."""
  model = model_of(graphdef, params)
  return model(tokens_BT, positions_from_valid(valid_BT), valid_BT)


def reward_model_update(state: TrainState, batch, *, graphdef, optimizer):
  """Bradley-Terry on a pair batch (chosen rows, then rejected rows)."""

  def loss_fn(params):
    scores_B2 = sequence_scores(graphdef, params, batch["tokens"], batch["valid"])
    chosen_B, rejected_B = jnp.split(scores_B2, 2)
    return bradley_terry_loss(chosen_B, rejected_B).mean(), (chosen_B, rejected_B)

  (loss, (chosen_B, rejected_B)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  metrics = {"loss": loss, "accuracy": (chosen_B > rejected_B).mean(),
             "margin": (chosen_B - rejected_B).mean(), "grad_norm": optax.tree.norm(grads)}
  return _apply(state, grads, optimizer, metrics)


def sequence_logprobs(graphdef, params, tokens_BT, valid_BT, completion_mask_BN,
                      prompt_len: int) -> jax.Array:
  """Sum of the response tokens' log-probs per row, [B]."""
  logp_BN, _ = completion_logprobs(graphdef, params, tokens_BT, valid_BT, prompt_len)
  return (logp_BN * completion_mask_BN).sum(axis=1)


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
  return _apply(state, grads, optimizer, metrics)
