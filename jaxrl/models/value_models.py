"""Critic and reward-model variants: the same decoder trunk with a scalar head."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Decoder


class ValueModel(nnx.Module):
  """Critic: one value per token, `values_BT`."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.decoder = Decoder(cfg, rngs)
    self.head = nnx.Param(jnp.zeros((cfg.d_model,), jnp.float32), logical_axes=("embed",))
    self.bias = nnx.Param(jnp.zeros((), jnp.float32), logical_axes=())

  def __call__(self, tokens_BT, positions_BT, key_valid_BS):
    h_BTD, _ = self.decoder(tokens_BT, positions_BT, key_valid_BS)
    return self.values(h_BTD)

  def values(self, h_BTD):
    """The value head on the decoder's hidden states: [B, T, D] -> [B, T]."""
    return jnp.einsum("btd,d->bt", h_BTD.astype(jnp.float32), self.head[...]) + self.bias[...]


class RewardModel(ValueModel):
  """Reward model: a scalar score per sequence, the value head read at the last valid token.

  Same parameter tree as ValueModel (decoder, head, bias), so a critic can start from it and
  both can start from an actor's `decoder`.
  """

  def __call__(self, tokens_BT, positions_BT, key_valid_BS) -> jax.Array:
    values_BT = super().__call__(tokens_BT, positions_BT, key_valid_BS)
    t = tokens_BT.shape[1]
    last_B = t - 1 - jnp.argmax(key_valid_BS[:, ::-1], axis=1)
    return jnp.take_along_axis(values_BT, last_B[:, None], axis=1)[:, 0]
