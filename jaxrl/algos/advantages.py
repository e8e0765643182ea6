"""Advantage estimators over flat batches laid out group-major: rows [g*n, (g+1)*n) share a prompt."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def grpo_advantages(rewards_B: jax.Array, group_size: int, eps: float = 1e-6) -> jax.Array:
  """(r - group mean) / (group std + eps), std unbiased; groups of one get advantage 0."""
  r_GN = rewards_B.reshape(-1, group_size).astype(jnp.float32)
  centred_GN = r_GN - r_GN.mean(axis=1, keepdims=True)
  if group_size == 1:
    return jnp.zeros_like(rewards_B, jnp.float32)
  std_G1 = jnp.sqrt((centred_GN**2).sum(axis=1, keepdims=True) / (group_size - 1))
  return (centred_GN / (std_G1 + eps)).reshape(-1)


ADVANTAGES = {"grpo": grpo_advantages}
