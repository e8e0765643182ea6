"""What the updates and the scoring passes compute of a model: log-probs and entropies of
tokens, critic values, reward-model scores, sequence log-probs."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.models.lm_head import chunked_logprobs
from jaxrl.models.moe import aux_losses
from jaxrl.models.rope import positions_from_segments, positions_from_valid
from train.updates.state import model_of


def token_logprobs(graphdef, params, tokens_BT, valid_BT, segment_ids_BT=None, start: int = 0):
  """log pi(tokens[t+1] | tokens[:t+1]) and the entropy of that distribution for positions
  t = start .. T-2, shapes [B, T-1-start]. The LM head and softmax run only at those positions
  and in chunks (jaxrl/models/lm_head.py): no [B, T, V] logits tensor, forward or backward.

  With `segment_ids_BT` (packed rows) positions restart and attention stays in each segment."""
  return routed_logprobs(graphdef, params, tokens_BT, valid_BT, segment_ids_BT, start)[:2]


def routed_logprobs(graphdef, params, tokens_BT, valid_BT, segment_ids_BT=None, start: int = 0,
                    routes_BTLK=None, temperature: float = 1.0):
  """`token_logprobs`, and a mixture of experts' router loss (its config's moe.aux_loss x
  the load-balancing loss + moe.z_loss x the z-loss; 0 for a dense model) with its
  metrics. `routes_BTLK`: the experts each token used when it was sampled (replayed under
  `model.moe.routing_replay="rollout"`, else compared: jaxrl/models/moe.py). `temperature`:
  of the distribution scored, RL's sampling temperature (`rl.rollout.temperature`) for the
  policy's and the reference's log-probs."""
  model = model_of(graphdef, params)
  if segment_ids_BT is None:
    positions_BT = positions_from_valid(valid_BT)
  else:
    positions_BT = positions_from_segments(segment_ids_BT)
  h_BTD, _, routing = model.decoder.forward(tokens_BT, positions_BT, valid_BT,
                                            segment_ids_BT=segment_ids_BT,
                                            routes_BTLK=routes_BTLK)
  logp, entropy = chunked_logprobs(h_BTD[:, start:-1], model.head_VD(), tokens_BT[:, start + 1:],
                                   softcap=model.cfg.logit_softcap, temperature=temperature)
  loss, metrics = router_loss(model.cfg, routing, compared=routes_BTLK is not None)
  return logp, entropy, loss, metrics


def router_loss(cfg, routing, compared: bool = False) -> tuple[jax.Array, dict]:
  """(the router's loss, its metrics) of an MoE forward's stacked `MoEStats`
  (jaxrl/models/moe.py): the balance and z losses and, where the sampler's routes were
  `compared`, the share of tokens (per layer, mean over layers) whose experts in the sampler
  are not the trainer's own; (0, {}) without one."""
  if routing is None:
    return jnp.zeros((), jnp.float32), {}
  balance, z = aux_losses(routing.load_E, routing.prob_E, routing.z)
  metrics = {"router_balance": balance, "router_z": z}
  if compared:
    metrics["routing_differs"] = routing.replay_differs.mean()
  return cfg.moe.aux_loss * balance + cfg.moe.z_loss * z, metrics


def completion_logprobs(graphdef, params, tokens_BT, valid_BT, prompt_len: int, routes_BTLK=None,
                        temperature: float = 1.0):
  """Log-probs and entropies of the completion slots (the last T - prompt_len tokens), at
  `temperature`."""
  return routed_logprobs(graphdef, params, tokens_BT, valid_BT, start=prompt_len - 1,
                         routes_BTLK=routes_BTLK, temperature=temperature)[:2]


def completion_values(graphdef, params, tokens_BT, valid_BT, prompt_len: int) -> jax.Array:
  """Critic values of the states before each completion token, [B, N] (aligned with the
  log-probs: value i is read where token i is predicted)."""
  model = model_of(graphdef, params)
  values_BT = model(tokens_BT, positions_from_valid(valid_BT), valid_BT)
  return values_BT[:, prompt_len - 1:-1]


def sequence_scores(graphdef, params, tokens_BT, valid_BT) -> jax.Array:
  """Reward-model score of each whole sequence, [B]."""
  model = model_of(graphdef, params)
  return model(tokens_BT, positions_from_valid(valid_BT), valid_BT)


def sequence_logprobs(graphdef, params, tokens_BT, valid_BT, completion_mask_BN,
                      prompt_len: int) -> jax.Array:
  """Sum of the response tokens' log-probs per row, [B]."""
  logp_BN, _ = completion_logprobs(graphdef, params, tokens_BT, valid_BT, prompt_len)
  return (logp_BN * completion_mask_BN).sum(axis=1)
