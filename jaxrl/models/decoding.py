"""`LMDecoding`: a `LanguageModel` as the sampler decodes it (the `DecodeModel` protocol of
sampler/engine.py): its weights cast to the compute dtype and its LM head computed once per call,
a prefill, and a one-token step through the model's own forward pass (transformer.py) in the
activation layout the sampler picks (jaxrl/models/layouts.py)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.attention import KVCache, grow_kv_cache, init_kv_cache
from jaxrl.models.layouts import LAYOUTS
from jaxrl.models.rope import rope_table
from jaxrl.models.scan import path_keys, stacked_keys
from jaxrl.models.transformer import LanguageModel
from jaxrl.models.rope import positions_from_valid

ROUTE_DTYPE = jnp.int16  # recorded expert ids (-1: none), up to 32767 experts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LMDecoding:
  model: LanguageModel
  head_VD: jax.Array

  @classmethod
  def of(cls, model: LanguageModel) -> LMDecoding:
    dt = model.cfg.compute_dtype
    # The head from the float32 embedding, as the trainer's forward computes it; then every
    # matrix in the compute dtype (norm scales stay float32, as the model uses them).
    head_VD = model.head_VD().astype(dt)
    graphdef, params = nnx.split(model)
    cast = jax.tree.map_with_path(
        lambda path, x: x.astype(dt) if x.ndim > 1 + stacked_keys(path_keys(path)) else x, params)
    return cls(nnx.merge(graphdef, cast), head_VD)

  def init_cache(self, batch: int, slots: int) -> KVCache:
    return init_kv_cache(self.model.cfg, batch, slots)

  def grow_cache(self, kv_cache: KVCache, slots: int) -> KVCache:
    """The cache with its slot axis zero-padded to `slots`."""
    return grow_kv_cache(self.model.cfg, kv_cache, slots)

  @property
  def stacked_cache(self) -> bool:
    """Whether the cache is one stacked pair (a scanned decoder's: attention.StackedLayer)."""
    return self.model.cfg.scanned

  def rope(self, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) [B, T, head_dim / 2] for any positions (a decode loop computes them ahead)."""
    return rope_table(positions_BT, self.model.cfg)

  def prefill(self, tokens_BP, valid_BP) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """Next-token logits [B, V], the prompt's KV cache (exactly its P slots) and, for a mixture
    of experts, each prompt token's experts per layer [B, P, L, k] (-1 where not routed: the
    last layer's MLP runs for the last position alone). Only the last position is sampled
    from, so the final block's queries, attention and MLP (and the LM head) run for it alone."""
    b, p = tokens_BP.shape
    h_B1D, kv_cache, routing = self.model.decoder.forward(
        tokens_BP, positions_from_valid(valid_BP), valid_BP, self.init_cache(b, p),
        last_only=True)
    routes = None if routing is None else routing.ids.astype(ROUTE_DTYPE)
    return self.model.logits(h_B1D, self.head_VD)[:, 0], kv_cache, routes

  def extend(self, tokens_KW, valid_KW, offset_K, kv_cache: KVCache, key_valid_KS):
    """A prefill of W new tokens (left-padded) after a kept cache of S slots (`key_valid_KS`:
    which hold keys, `offset_K` of them, in any slot order): the next-token logits [K, V] and
    the cache grown to S + W slots, the new keys and values in the last W."""
    s = key_valid_KS.shape[1]
    grown = self.grow_cache(kv_cache, s + tokens_KW.shape[1])
    positions_KW = offset_K[:, None] + positions_from_valid(valid_KW)
    h_K1D, kv_cache, _ = self.model.decoder.forward(
        tokens_KW, positions_KW, jnp.concatenate([key_valid_KS, valid_KW], axis=1), grown,
        cache_index=s, last_only=True)
    return self.model.logits(h_K1D, self.head_VD)[:, 0], kv_cache

  def decode_fn(self, layout: str):
    """`step(tok_B, (sin_BH, cos_BH), key_valid_BS, kv_cache, slot) -> (logits_BV, kv_cache,
    routes_BLK or None)`: one new token per row, the model's forward in `layout` ("rows" |
    "features"), and for a mixture of experts the token's experts per layer."""
    lay, decoder = LAYOUTS[layout], self.model.decoder

    def step(tok_B, rope_BH, key_valid_BS, kv_cache, slot):
      tokens, rope = lay.step_inputs(tok_B, rope_BH)
      h, kv_cache, routing = decoder.forward(tokens, rope, key_valid_BS, kv_cache, slot,
                                             layout=lay)
      routes = None if routing is None else routing.ids[:, 0].astype(ROUTE_DTYPE)
      return lay.next_logits(h, self.head_VD, self.model.cfg.logit_softcap), kv_cache, routes
    return step
