"""RMSNorm in float32 (Gemma's offset form too); in a scanned decoder's blocks
(jaxrl/models/scan.py) its intermediates recomputed by the backward from its input: the scan
would otherwise keep their float32 copies per layer, which an unrolled program's fusions never
materialize."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
  """`offset` (Gemma): the stored weight w scales by (1 + w), so it starts at zero.
  `recompute`: the backward recomputes the float32 intermediates (`_recomputed_norm`)."""

  def __init__(self, dim: int, eps: float, axis_name: str = "embed", offset: bool = False,
               recompute: bool = False):
    init = jnp.zeros if offset else jnp.ones
    self.scale = nnx.Param(init((dim,), jnp.float32), logical_axes=(axis_name,))
    self.eps, self.offset, self.recompute = eps, offset, recompute

  def __call__(self, x, axis: int = -1):
    """Normalised over `axis` (the layout's feature or head_dim axis)."""
    scale = self.scale[...] + 1.0 if self.offset else self.scale[...]
    if axis != -1:
      scale = scale.reshape(scale.shape + (1,) * (x.ndim - 1 - axis))
    return (_recomputed_norm if self.recompute else _rms_norm)(x, scale, self.eps, axis)


def _rms_norm(x, scale, eps: float, axis: int):
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axis, keepdims=True) + eps)
  return (x32 * scale).astype(x.dtype)


_recomputed_norm = jax.checkpoint(_rms_norm, static_argnums=(2, 3))
