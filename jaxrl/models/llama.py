"""A Llama-style decoder in Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Every parameter carries `logical_axes` metadata and every large activation is constrained with
logical names (see sharding/rules.py); no mesh axis is named here. Projection weights are stored
[out, in] (PyTorch's order), the layout the sampler's feature-major decode step (decode.py)
multiplies by directly.

Attention works on a fixed slot layout: a batch row occupies cache slots [0, S), with left padding
marked invalid in `key_valid_BS`. Training passes the whole sequence (S == T); the sampler passes
a KV cache of S slots and the slot index of the first new token.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.lora import LoRA, LoRAConfig, adapted
from jaxrl.models.rope import rope, rope_table
from jaxrl.partitioning import constrain

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ROPE_SCALINGS = ("none", "linear", "llama3")
ATTENTIONS = ("auto", "einsum", "xla", "cudnn")
# What a decoder block saves for the backward under `model.remat` (the rest is recomputed):
# "dots" keeps the projections' and MLP's matrix products (`dense` multiplies flat 2-D rows, no
# batch dimension) and recomputes attention's batched [T, S] products, norms and activations;
# "full" keeps only each block's input.
REMAT_POLICIES = {"dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  "full": jax.checkpoint_policies.nothing_saveable}
REMATS = ("none", *REMAT_POLICIES)

# One (k_BKHS, v_BKSH) pair per layer: kv heads first; keys transposed (head_dim before slots).
KVCache = tuple[tuple[jax.Array, jax.Array], ...]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 264
  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 32
  d_ff: int = 512
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  # jaxrl's own init draws N(0, 1) embeddings and reads the tied LM head as embed / sqrt(d_model);
  # Hugging Face models (Llama 3.2, Qwen2.5) use the embedding itself: False.
  scale_tied_head: bool = True
  qkv_bias: bool = False  # Qwen2 / Qwen2.5
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on queries and keys before RoPE
  rope_scaling: str = "none"  # none | linear | llama3 (Llama 3.1+)
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  dtype: str = "float32"  # compute dtype; trained parameters are always stored in float32
  # The frozen reference (and, always, the sampler's copy) holds its matrices in the compute
  # dtype, which scores exactly as float32 weights would (models/dtypes.py); True keeps float32.
  frozen_float32: bool = False
  # none | dots | full: recompute the decoder blocks' activations in the backward instead of
  # keeping them (REMAT_POLICIES); training only: the sampler's cached passes never remat.
  remat: str = "none"
  # Training, scoring and prefill attention (decode steps always use the einsum form over the
  # cache): auto | einsum (explicit products, float32 softmax) | xla | cudnn, the last two
  # through `jax.nn.dot_product_attention` (cudnn: fused flash attention, GPU, bf16/fp16 only).
  attention: str = "auto"
  # A local Hugging Face model directory to start from (config.json, *.safetensors, tokenizer);
  # its config.json sets the fields above (jaxrl/models/hf.py). Not read by the model itself.
  hf_path: str = ""

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                 "rope_theta", "norm_eps"):
      if not getattr(self, name) > 0:
        raise ValueError(f"{name}: expected > 0, got {getattr(self, name)!r}")
    if self.dtype not in DTYPES:
      raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {self.dtype!r}")
    if self.rope_scaling not in ROPE_SCALINGS:
      raise ValueError(f"rope_scaling: expected one of {list(ROPE_SCALINGS)}, "
                       f"got {self.rope_scaling!r}")
    if self.attention not in ATTENTIONS:
      raise ValueError(f"attention: expected one of {list(ATTENTIONS)}, got {self.attention!r}")
    if self.remat not in REMATS:
      raise ValueError(f"remat: expected one of {list(REMATS)}, got {self.remat!r}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim: RoPE rotates pairs, expected an even number, got {self.head_dim}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"n_heads: {self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]


def dense(x_BTD: jax.Array, w_OD: jax.Array, *, trained: bool = True) -> jax.Array:
  """x @ w.T over the last axis, [B, T, O], as one 2-D matrix product over the flattened rows:
  XLA:CPU runs the backward's weight gradient (a contraction over rows) ~1.6x faster that way
  than as a contraction over both B and T. On a CPU a `trained` weight with more outputs than
  inputs (the MLP's gate and up) is multiplied as an explicit [in, out] transpose, kept by a
  barrier: its gradient is then computed [in, out] too, which XLA:CPU runs at ~0.88 of its
  matmul peak instead of ~0.62 for [out, in] (the update: -5%; docs/benchmarks.md). Where no
  gradient reaches `w` (the LM head of `LanguageModel.logits`: sampling, evaluation) the
  transpose would be a copy for nothing: `trained=False`."""
  b, t, d = x_BTD.shape
  x_RD, w_OD = x_BTD.reshape(b * t, d), w_OD.astype(x_BTD.dtype)
  if trained and w_OD.shape[0] > w_OD.shape[1] and jax.default_backend() == "cpu":
    out = x_RD @ jax.lax.optimization_barrier(w_OD.T)
  else:
    out = jax.lax.dot_general(x_RD, w_OD, (((1,), (1,)), ((), ())))
  return out.reshape(b, t, w_OD.shape[0])


def _param(rngs: nnx.Rngs, shape, axes, scale: float) -> nnx.Param:
  return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * scale, logical_axes=axes)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, axis_name: str = "embed"):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), logical_axes=(axis_name,))
    self.eps = eps

  def __call__(self, x_BTD):
    x32 = x_BTD.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * self.scale[...]).astype(x_BTD.dtype)


def _adapters(module: nnx.Module, lora: LoRAConfig | None, rngs: nnx.Rngs, **weights) -> None:
  """A LoRA adapter `NAME_lora` beside each weight NAME=(out dims, in dims) that `lora`
  targets (jaxrl/models/lora.py), shaped and sharded like the weight it adapts."""
  for name, out_dims in weights.items():
    if lora is None or not lora.on(name):
      continue
    w = getattr(module, name)
    axes = w.get_metadata()["logical_axes"]
    setattr(module, name + "_lora", LoRA(w.shape[:out_dims], axes[:out_dims], w.shape[out_dims:],
                                         axes[out_dims:], lora, rngs))


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, lora: LoRAConfig | None = None,
               lora_rngs: nnx.Rngs | None = None):
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    self.cfg = cfg
    self.wq = _param(rngs, (n, h, d), ("heads", "head_dim", "embed"), d**-0.5)
    self.wk = _param(rngs, (k, h, d), ("kv_heads", "head_dim", "embed"), d**-0.5)
    self.wv = _param(rngs, (k, h, d), ("kv_heads", "head_dim", "embed"), d**-0.5)
    self.wo = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), (n * h)**-0.5 / cfg.n_layers)
    _adapters(self, lora, lora_rngs, wq=2, wk=2, wv=2, wo=1)
    if cfg.qkv_bias:
      zeros = lambda heads, axis: nnx.Param(jnp.zeros((heads, h), jnp.float32),
                                            logical_axes=(axis, "head_dim"))
      self.bq, self.bk, self.bv = zeros(n, "heads"), zeros(k, "kv_heads"), zeros(k, "kv_heads")
    if cfg.qk_norm:
      self.q_norm = RMSNorm(h, cfg.norm_eps, "head_dim")
      self.k_norm = RMSNorm(h, cfg.norm_eps, "head_dim")

  def project(self, x_BTD, name: str, bias_name: str, norm_name: str):
    """Queries, keys or values [B, T, N, H]: the projection `name` (with its adapter), its bias
    (Qwen2) and its per-head RMSNorm (Qwen3 queries and keys), before RoPE."""
    w_NHD = getattr(self, name)
    n, h, d = w_NHD.shape
    out_BTF = adapted(self, name, x_BTD, dense(x_BTD, w_NHD[...].reshape(n * h, d)))
    out_BTNH = out_BTF.reshape(*x_BTD.shape[:2], n, h)
    if self.cfg.qkv_bias:
      out_BTNH = out_BTNH + getattr(self, bias_name)[...].astype(x_BTD.dtype)
    if self.cfg.qk_norm and norm_name:
      out_BTNH = getattr(self, norm_name)(out_BTNH)
    return out_BTNH

  def __call__(self, x_BTD, rope_BTH, mask_BTS, layer_cache, cache_index, last_only=False):
    """`last_only`: queries (and so the output) for the last position only; keys and values
    for every position still go to the cache."""
    cfg, dt = self.cfg, x_BTD.dtype
    x_BQD, rope_BQH, mask_BQS = x_BTD, rope_BTH, mask_BTS
    if last_only:
      x_BQD, mask_BQS = x_BTD[:, -1:], mask_BTS[:, -1:]
      rope_BQH = tuple(a[:, -1:] for a in rope_BTH)
    # Queries carry the 1/sqrt(head_dim) of the attention logits from here on.
    q_BTNH = rope(self.project(x_BQD, "wq", "bq", "q_norm"), rope_BQH, cfg.head_dim**-0.5)
    k_BTKH = rope(self.project(x_BTD, "wk", "bk", "k_norm"), rope_BTH)
    v_BTKH = self.project(x_BTD, "wv", "bv", "")
    q_BTNH = constrain(q_BTNH, ("batch", None, "act_heads", None))
    # Keys are stored transposed (head_dim before slots) so that both attention products are
    # plain matrix products over a contiguous cache (no per-step transpose of the keys).
    k_BKHT, v_BKTH = k_BTKH.transpose(0, 2, 3, 1), v_BTKH.transpose(0, 2, 1, 3)
    if layer_cache is None:
      k_BKHS, v_BKSH = k_BKHT, v_BKTH
    else:
      k_BKHS = jax.lax.dynamic_update_slice_in_dim(layer_cache[0], k_BKHT.astype(layer_cache[0].dtype),
                                                   cache_index, axis=3)
      v_BKSH = jax.lax.dynamic_update_slice_in_dim(layer_cache[1], v_BKTH.astype(layer_cache[1].dtype),
                                                   cache_index, axis=2)
      layer_cache = (k_BKHS, v_BKSH)
    b, t, n, h = q_BTNH.shape
    impl = attention_impl(cfg)
    if impl != "einsum" and k_BKHS.shape[-1] == k_BTKH.shape[1]:  # no earlier cache slots
      out_BTKGH = jax.nn.dot_product_attention(  # queries carry the scale already
          q_BTNH, k_BTKH.astype(dt), v_BTKH.astype(dt), mask=mask_BQS[:, None], scale=1.0,
          implementation=impl).reshape(b, t, cfg.n_kv_heads, n // cfg.n_kv_heads, h)
    else:
      q_BTKGH = q_BTNH.reshape(b, t, cfg.n_kv_heads, n // cfg.n_kv_heads, h)
      attend = _attend_one if t == 1 else _attend
      out_BTKGH = attend(q_BTKGH, k_BKHS.astype(dt), v_BKSH.astype(dt), mask_BQS)
    # One (n * h) contraction on flat views: XLA:CPU would otherwise transpose wo every call.
    out_BTF = out_BTKGH.reshape(b, t, n * h)
    out_BTD = adapted(self, "wo", out_BTF, dense(out_BTF, self.wo[...].reshape(cfg.d_model, n * h)))
    return out_BTD, layer_cache


def attention_impl(cfg: ModelConfig) -> str:
  """`cfg.attention`, with "auto" resolved for this backend: cuDNN's fused flash attention on a
  GPU in bf16 (no [B, heads, T, S] scores in memory, forward or backward); elsewhere
  XLA's form of `jax.nn.dot_product_attention` (on the CPU its forward and backward took 9.2 ms
  against 11.4 ms for the einsum form at 4 x 128 tokens, 9 heads: docs/models.md)."""
  if cfg.attention != "auto":
    return cfg.attention
  return "cudnn" if jax.default_backend() == "gpu" and cfg.dtype == "bfloat16" else "xla"


def _attend(q_BTKGH, k_BKHS, v_BKSH, mask_BTS):
  logits_BKGTS = jnp.einsum("btkgh,bkhs->bkgts", q_BTKGH, k_BKHS).astype(jnp.float32)
  logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, jnp.finfo(jnp.float32).min)
  probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(q_BTKGH.dtype)
  return jnp.einsum("bkgts,bksh->btkgh", probs_BKGTS, v_BKSH)


def _attend_one(q_B1KGH, k_BKHS, v_BKSH, mask_B1S):
  """Decode (one query per row): a small matrix product per kv head over its cache slots."""
  logits_BKGS = jnp.einsum("bkgh,bkhs->bkgs", q_B1KGH[:, 0], k_BKHS).astype(jnp.float32)
  logits_BKGS = jnp.where(mask_B1S[:, 0, None, None, :], logits_BKGS, jnp.finfo(jnp.float32).min)
  probs_BKGS = jax.nn.softmax(logits_BKGS, axis=-1).astype(q_B1KGH.dtype)
  return jnp.einsum("bkgs,bksh->bkgh", probs_BKGS, v_BKSH)[:, None]


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, lora: LoRAConfig | None = None,
               lora_rngs: nnx.Rngs | None = None):
    d, f = cfg.d_model, cfg.d_ff
    self.w_gate = _param(rngs, (f, d), ("mlp", "embed"), d**-0.5)
    self.w_up = _param(rngs, (f, d), ("mlp", "embed"), d**-0.5)
    self.w_down = _param(rngs, (d, f), ("embed", "mlp"), f**-0.5 / cfg.n_layers)
    _adapters(self, lora, lora_rngs, w_gate=1, w_up=1, w_down=1)
    self.frozen = lora is not None and lora.enabled  # LoRA: no gradient reaches the base

  def __call__(self, x_BTD):
    linear = lambda name, x: adapted(self, name, x, dense(x, getattr(self, name)[...],
                                                          trained=not self.frozen))
    gate_BTF, up_BTF = linear("w_gate", x_BTD), linear("w_up", x_BTD)
    h_BTF = constrain(jax.nn.silu(gate_BTF) * up_BTF, ("batch", None, "act_mlp"))
    return linear("w_down", h_BTF)


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, lora: LoRAConfig | None = None,
               lora_rngs: nnx.Rngs | None = None):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.attn = Attention(cfg, rngs, lora, lora_rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.mlp = MLP(cfg, rngs, lora, lora_rngs)

  def __call__(self, x_BTD, rope_BTH, mask_BTS, layer_cache, cache_index, last_only=False):
    attn_BTD, layer_cache = self.attn(self.attn_norm(x_BTD), rope_BTH, mask_BTS, layer_cache,
                                      cache_index, last_only)
    if last_only:
      x_BTD = x_BTD[:, -1:]
    x_BTD = x_BTD + attn_BTD
    x_BTD = x_BTD + self.mlp(self.mlp_norm(x_BTD))
    return constrain(x_BTD, ("batch", None, None)), layer_cache


def attention_mask(key_valid_BS: jax.Array, t: int, cache_index,
                   segment_ids_BS: jax.Array | None = None) -> jax.Array:
  """Query i (slot cache_index + i) sees valid keys at slots <= its own (and, for packed rows,
  only keys of its own segment)."""
  s = key_valid_BS.shape[1]
  query_slot_T = cache_index + jnp.arange(t)
  causal_TS = jnp.arange(s)[None, :] <= query_slot_T[:, None]
  mask_BTS = causal_TS[None] & key_valid_BS[:, None, :]
  if segment_ids_BS is not None:
    mask_BTS &= segment_ids_BS[:, -t:, None] == segment_ids_BS[:, None, :]
  return mask_BTS


class Decoder(nnx.Module):
  """Embedding + blocks + final norm; returns hidden states (heads are separate modules)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, lora: LoRAConfig | None = None):
    self.cfg = cfg
    # An untied or scaled head reads N(0, 1) embeddings; a head that IS the embedding (HF style)
    # needs them at 1 / sqrt(d_model) for unit-scale initial logits.
    hf_tied = cfg.tie_embeddings and not cfg.scale_tied_head
    self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                        cfg.d_model**-0.5 if hf_tied else 1.0)
    # The adapters draw from a stream of their own: the base weights are the same with or without.
    lora_rngs = None if lora is None else nnx.Rngs(jax.random.fold_in(rngs.default.key[...],
                                                                       0x10A))
    self.blocks = nnx.List([Block(cfg, rngs, lora, lora_rngs) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

  def __call__(self, tokens_BT, positions_BT, key_valid_BS, kv_cache: KVCache | None = None,
               cache_index=0, segment_ids_BT=None, last_only=False):
    """Hidden states [B, T, D], and the updated cache. `last_only` (a prefill that samples from
    the last position): the final block's queries, attention and MLP run for the last position
    alone, and the states come back as [B, 1, D]."""
    x_BTD = jnp.take(self.embed[...], tokens_BT, axis=0).astype(self.cfg.compute_dtype)
    x_BTD = constrain(x_BTD, ("batch", None, None))
    mask_BTS = attention_mask(key_valid_BS, tokens_BT.shape[1], cache_index, segment_ids_BT)
    if isinstance(positions_BT, tuple):  # a rope_table the caller computed ahead (decode loops)
      rope_BTH = positions_BT
    else:
      rope_BTH = rope_table(positions_BT, self.cfg)
    new_cache = []
    for i, block in enumerate(self.blocks):
      last = last_only and i == len(self.blocks) - 1
      if kv_cache is None and self.cfg.remat != "none":  # a cached pass is never differentiated
        x_BTD, layer_cache = self.remat_block(block, x_BTD, rope_BTH, mask_BTS, last), None
      else:
        x_BTD, layer_cache = block(x_BTD, rope_BTH, mask_BTS,
                                   None if kv_cache is None else kv_cache[i], cache_index, last)
      new_cache.append(layer_cache)
    h_BTD = self.final_norm(x_BTD)
    return h_BTD, (None if kv_cache is None else tuple(new_cache))

  def remat_block(self, block: Block, x_BTD, rope_BTH, mask_BTS, last_only: bool):
    """`block` on a cacheless pass under `jax.checkpoint`: its backward recomputes what the
    `model.remat` policy does not save. The block is split into its pure state, so the
    checkpointed function closes over no traced module."""
    graphdef, state = nnx.split(block)

    def run(state, x_BTD, rope_BTH, mask_BTS):
      return nnx.merge(graphdef, state)(x_BTD, rope_BTH, mask_BTS, None, 0, last_only)[0]
    policy = REMAT_POLICIES[self.cfg.remat]
    return jax.checkpoint(run, policy=policy)(state, x_BTD, rope_BTH, mask_BTS)


class LanguageModel(nnx.Module):
  """Decoder with an LM head (tied to the embedding unless `tie_embeddings=False`); with `lora`
  (rank > 0), LoRA adapters on its targets (jaxrl/models/lora.py)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoRAConfig | None = None):
    self.cfg = cfg
    self.decoder = Decoder(cfg, rngs, lora)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                            cfg.d_model**-0.5)

  def __call__(self, tokens_BT, positions_BT, key_valid_BS, kv_cache=None, cache_index=0,
               segment_ids_BT=None):
    """`positions_BT`: RoPE positions, or their `rope_table` computed ahead (a decode loop does,
    so that no step recomputes sines). `segment_ids_BT` (training only): packed rows, attention
    stays inside a segment."""
    h_BTD, kv_cache = self.decoder(tokens_BT, positions_BT, key_valid_BS, kv_cache, cache_index,
                                   segment_ids_BT)
    return self.logits(h_BTD), kv_cache

  def logits(self, h_BTD, head_VD: jax.Array | None = None):
    """The LM head over decoder states (float32 logits); `head_VD`: `self.head_VD()` computed
    ahead (a decode loop does, once per call)."""
    head_VD = self.head_VD() if head_VD is None else head_VD
    logits_BTV = dense(h_BTD, head_VD, trained=False)
    return constrain(logits_BTV.astype(jnp.float32), ("batch", None, "act_vocab"))

  def head_VD(self) -> jax.Array:
    """The LM head's weight, [vocab, d_model]."""
    if not self.cfg.tie_embeddings:
      return self.lm_head[...]
    if self.cfg.scale_tied_head:
      return self.decoder.embed[...] * self.cfg.d_model**-0.5
    return self.decoder.embed[...]


def init_kv_cache(cfg: ModelConfig, batch: int, slots: int) -> KVCache:
  k_shape = (batch, cfg.n_kv_heads, cfg.head_dim, slots)
  v_shape = (batch, cfg.n_kv_heads, slots, cfg.head_dim)
  return tuple((jnp.zeros(k_shape, cfg.compute_dtype), jnp.zeros(v_shape, cfg.compute_dtype))
               for _ in range(cfg.n_layers))


def positions_from_segments(segment_ids_BT: jax.Array) -> jax.Array:
  """Positions restarting at 0 where a packed row's segment id changes."""
  t = segment_ids_BT.shape[1]
  idx_BT = jnp.broadcast_to(jnp.arange(t), segment_ids_BT.shape)
  starts_BT = jnp.concatenate([jnp.ones_like(segment_ids_BT[:, :1], bool),
                               segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
  return idx_BT - jax.lax.cummax(jnp.where(starts_BT, idx_BT, 0), axis=1)


def positions_from_valid(valid_BT: jax.Array) -> jax.Array:
  """RoPE positions counting only valid tokens, so left padding does not shift a row."""
  return jnp.maximum(jnp.cumsum(valid_BT.astype(jnp.int32), axis=1) - 1, 0)
