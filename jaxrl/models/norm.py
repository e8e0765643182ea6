"""RMSNorm in float32 (Gemma's offset form too), its intermediates recomputed by the backward
from its input: a scanned decoder (jaxrl/models/scan.py) would otherwise keep their float32
copies per layer, which an unrolled program's fusions never materialize."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
  """`offset` (Gemma): the stored weight w scales by (1 + w), so it starts at zero."""

  def __init__(self, dim: int, eps: float, axis_name: str = "embed", offset: bool = False):
    init = jnp.zeros if offset else jnp.ones
    self.scale = nnx.Param(init((dim,), jnp.float32), logical_axes=(axis_name,))
    self.eps, self.offset = eps, offset

  def __call__(self, x, axis: int = -1):
    """Normalised over `axis` (the layout's feature or head_dim axis)."""
    scale = self.scale[...] + 1.0 if self.offset else self.scale[...]
    if axis != -1:
      scale = scale.reshape(scale.shape + (1,) * (x.ndim - 1 - axis))
    return _rms_norm(x, scale, self.eps, axis)


@functools.partial(jax.checkpoint, static_argnums=(2, 3))
def _rms_norm(x, scale, eps: float, axis: int):
  """RMSNorm in float32, its intermediates recomputed by the backward from `x` (a scan over
  layers would otherwise keep their float32 copies per layer: XLA fuses them away only in an
  unrolled program)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axis, keepdims=True) + eps)
  return (x32 * scale).astype(x.dtype)
