"""What the updates and the scoring passes compute of a model: log-probs and entropies of
tokens, critic values, reward-model scores, sequence log-probs."""
from __future__ import annotations

import jax

from jaxrl.algos.logprobs import chunked_logprobs
from jaxrl.models.transformer import positions_from_segments, positions_from_valid
from train.updates.state import model_of


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
