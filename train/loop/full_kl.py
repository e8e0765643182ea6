"""The full-distribution check: KL(sampler || trainer) over the whole vocabulary at a sample of
positions, not only at the drawn tokens (whose log-probs the mismatch metrics compare every
step: jaxrl/algos/correction.py).

At each held-out evaluation of RL (`eval.every`), the first `eval.sampler_kl_rows` rows of the
last step's batch are scored both ways at the policy's current weights: the sampler's
distributions by its own prefill and decode step, fed the rows' tokens (sampler/forced.py, on the
sampler's copy in its layout), and the trainer's by its forward and LM head, at
`eval.sampler_kl_positions` steps of each row spread over the tokens the policy drew (in multi-turn
rows, not the environment's), both at RL's sampling temperature. Logged as `sampler_kl_full`
(the mean over those positions) and `sampler_kl_full_max`. The sampler's side runs its decode
over every token of the row, environment tokens included, where a conversation's sampler
prefilled those: a kept-cache turn's numbers may differ in the last bits.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special

from jaxrl.models.lm_head import chunk_product, lm_head
from jaxrl.models.rope import positions_from_valid
from sharding.rules import SAMPLER_RULES, batch_ways
from train.updates.state import model_of


def check_rows(cfg, cluster) -> int:
  """How many rows of each batch the check reads: `eval.sampler_kl_rows` rounded up to what
  splits over the trainer's and the sampler's batch axes, at most the batch's (0: off)."""
  rows, rl = cfg.eval.sampler_kl_rows, cfg.rl
  if not rows or rl.rollout.exact:  # (exact: the trainer's pass drew them; the engine did not)
    return 0
  ways = math.lcm(batch_ways(cluster.meshes["actor"], cluster.actor.rules),
                  batch_ways(cluster.meshes["sampler"], SAMPLER_RULES))
  return min(rl.rollouts, -(-rows // ways) * ways)


def rows_of(exp, rows: int) -> dict:
  """What the check needs of a step's experience, its first `rows` rows (small: kept until
  the next evaluation)."""
  first = lambda x: jax.lax.slice_in_dim(x, 0, rows)  # (static bounds: nothing from the host)
  return {"tokens_BT": first(exp.tokens_BT), "valid_BT": first(exp.valid_BT),
          "policy_BN": first(exp.policy_mask_BN)}


def spread_steps(policy_BN: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
  """(steps [B, k], weights [B, k]): `k` completion steps of each row, spread evenly over the
  steps its policy drew (repeated where it drew fewer than k), each weighed 1 / (k x rows that
  drew any); a row that drew none weighs 0."""
  b = policy_BN.shape[0]
  steps_BK, weights_BK = np.zeros((b, k), np.int32), np.zeros((b, k), np.float32)
  drawn = [np.flatnonzero(row) for row in policy_BN]
  live = sum(len(d) > 0 for d in drawn)
  for r, d in enumerate(drawn):
    if len(d):
      steps_BK[r] = d[np.linspace(0, len(d) - 1, k).round().astype(int)]
      weights_BK[r] = 1.0 / (k * live)
  return steps_BK, weights_BK


def trainer_logprobs(graphdef, params, tokens_BT, valid_BT, steps_BK, *, prompt_len: int,
                     temperature: float):
  """[B, K, V] float32: the trainer's log p(. | tokens before completion step k) at `steps_BK`,
  its forward's hidden states there through the LM head, at `temperature`."""
  model = model_of(graphdef, params)
  h_BTD, _, _ = model.decoder.forward(tokens_BT, positions_from_valid(valid_BT), valid_BT)
  h_BKD = jnp.take_along_axis(h_BTD, (prompt_len - 1 + steps_BK)[..., None], axis=1)
  logits_BKV = lm_head(h_BKD, model.head_VD(), softcap=model.cfg.logit_softcap,
                       product=chunk_product)
  return jax.nn.log_softmax(logits_BKV / temperature, axis=-1)


def kl_stats(sampler_BKV, trainer_BKV, weights_BK) -> tuple[float, float]:
  """(weighted mean, max over the weighed positions) of KL(sampler || trainer) per position, in
  float64 with each side normalized again (a float32 log-softmax's own normalization error,
  ~1e-7, would otherwise add to the sum)."""
  norm = lambda x: x - scipy.special.logsumexp(x, axis=-1, keepdims=True)
  sampler_BKV, trainer_BKV = (norm(np.asarray(x, np.float64)) for x in (sampler_BKV, trainer_BKV))
  kl_BK = (np.exp(sampler_BKV) * (sampler_BKV - trainer_BKV)).sum(-1)
  kl_BK = np.maximum(kl_BK, 0.0)  # (>= 0 in exact arithmetic; rounding may dip below)
  weighed = weights_BK > 0
  return float((kl_BK * weights_BK).sum()), float(kl_BK[weighed].max(initial=0.0))


class FullKL:
  """The check's two programs, compiled on first use: the trainer's on the actor's mesh, the
  sampler's the generator's (`Generator.forced_logprobs`)."""

  def __init__(self, actor_role, generator, transfers, *, positions: int, temperature: float):
    self.actor, self.generator, self.transfers = actor_role, generator, transfers
    self.positions, self.temperature = positions, temperature
    self._trainer = {}  # prompt length -> the trainer's program

  def __call__(self, rows: dict, params, sampler_params) -> dict:
    """{"sampler_kl_full", "sampler_kl_full_max"} of `rows` (`rows_of`) at the actor's
    `params` and the sampler's copy `sampler_params`."""
    tokens_BT, valid_BT = rows["tokens_BT"], rows["valid_BT"]
    policy_BN = self.transfers.to_host(rows["policy_BN"], "full KL positions")
    p = tokens_BT.shape[1] - policy_BN.shape[1]
    steps_BK, weights_BK = spread_steps(np.asarray(policy_BN, bool), self.positions)
    if p not in self._trainer:
      self._trainer[p] = self.actor.jit(lambda q, t, v, s: trainer_logprobs(
          self.actor.graphdef, q, t, v, s, prompt_len=p, temperature=self.temperature))
    steps = self.transfers.to_device(steps_BK, self.actor.batch_shardings(steps_BK),
                                     "full KL positions")
    trainer_BKV = self._trainer[p](params, tokens_BT, valid_BT, steps)
    sampler_BKV = self.generator.forced_logprobs(sampler_params, tokens_BT, valid_BT, steps,
                                                 prompt_len=p)
    got = self.transfers.to_host((sampler_BKV, trainer_BKV), "full KL distributions")
    mean, peak = kl_stats(*map(np.asarray, got), weights_BK)
    return {"sampler_kl_full": mean, "sampler_kl_full_max": peak}
