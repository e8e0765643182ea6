"""The one memory model of jaxrl's passes: bytes one device holds beyond its resident state during
an update, a scoring pass, and generation. The planner (memory.py) and the dry run
(train/preflight/dry_run.py) both call it; tests/test_memory_model.py checks it against XLA's own count
(`memory_analysis().temp_size_in_bytes`) of compiled RL updates. It reads a model config's
dimensions (ModelConfig's fields) and the models' own tables (the remat policies, the FLOPs per
layer) from jaxrl/models, never their code.

An update's backward runs in phases, and its peak is the largest of them:
  head       every layer's saved activations, the log-prob chunk's logits at their largest
             (logits, probabilities and their gradient: jaxrl/models/lm_head.py) and the head's
             gradient
  top layer  the layers below's saved activations and the top layer's working set (with remat,
             recomputed) beside the head's and one layer's gradients
  bottom     one layer's working set beside every gradient
  optimizer  the gradients and the optimizer's update, both float32
Gradients are float32; with micro-batches an accumulator of the whole gradient stays as well.
Activations are in the compute dtype, except attention's float32 scores: without a flash kernel
the [T, T] logits, their exponent and the probabilities. Tensor parallelism splits heads and the
MLP; the residual stream [T, d_model] stays whole on each device. Under fsdp without remat, XLA
merges the backward's all-gather of each layer's weights with the forward's: the gathered
weights stay from the forward to the backward.

The per-token counts are elements of one block's activations that XLA keeps (the coefficients
below, fitted to XLA:CPU's buffer assignment of float32 updates); "dots" saves the projections'
outputs (queries, keys, values, gate, up) and recomputes the rest, "full" saves each block's
input only.
"""
from __future__ import annotations

from jaxrl.models import flops
from jaxrl.models.config import REMATS
from planner import footprint_tpu

# Elements per token of one block that the backward needs, per d_model, per d_ff and per
# query/key/value head dimension; and float32 [T, T] score copies per attention head.
PER_D_MODEL, PER_D_FF, PER_QKV, SCORE_COPIES = 8.5, 5.0, 1.0, 3.0
LOGIT_COPIES = 4  # one chunk's logits: forward logits and probabilities, backward's and dz
UPDATE_ITEMS = ("gradients", "activations", "logits", "gathered weights", "buffer packing")


def compute_bytes(model) -> int:
  return 2 if model.dtype == "bfloat16" else 4


def layer_fraction(model) -> float:
  """The share of a model's parameters in its decoder blocks (the rest: embedding, head)."""
  layers = model.n_layers * flops.layer_params(model)
  heads = 1 if model.tie_embeddings else 2
  return layers / (layers + heads * model.vocab_size * model.d_model + model.d_model)


def block_bytes(model, seq_len: float, tensor: int = 1, flash_attention: bool = False) -> float:
  """Bytes per token of one block's activations that its backward needs (its working set)."""
  m = model
  qkv = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim / tensor
  out = compute_bytes(m) * (PER_D_MODEL * m.d_model + PER_D_FF * flops.token_ff(m) / tensor
                            + PER_QKV * qkv)
  if not flash_attention:
    out += 4 * SCORE_COPIES * m.n_heads / tensor * seq_len
  return out


def expert_block_bytes(model, tokens: float, tensor: int = 1) -> float:
  """The expert weights one MoE layer's blocked products gather, one copy per block of rows
  (jaxrl/models/moe.blocked_experts: gate, up and down for each of at most
  assignments / block + n_experts blocks), on one device of a `tensor` group splitting the
  experts' width (sharding/rules.py); 0 for a dense model or another form of the products."""
  from jaxrl.models import moe
  m = model
  if not m.moe.experts:
    return 0.0
  assignments = int(tokens) * m.moe.per_token
  if moe.experts_impl(m.moe.impl, assignments, m.moe.experts) != "blocked":
    return 0.0
  blocks = assignments / moe.block_rows(assignments, m.moe.experts) + m.moe.experts
  return 3 * blocks * m.moe.d_ff * m.d_model * compute_bytes(m) / tensor


def saved_bytes(model, remat: str, seq_len: float, tensor: int = 1,
                flash_attention: bool = False) -> float:
  """Bytes per token one block keeps from its forward to its backward under `remat`."""
  m = model
  if remat == "none":
    return block_bytes(m, seq_len, tensor, flash_attention)
  if remat == "dots":
    qkv = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim
    return compute_bytes(m) * (2 * flops.token_ff(m) + qkv) / tensor
  if remat == "full":
    return compute_bytes(m) * m.d_model
  raise ValueError(f"remat: expected one of {list(REMATS)}, got {remat!r}")


def logits_bytes(model, rows: float, logit_chunk: int, copies: int = LOGIT_COPIES,
                 tensor: int = 1) -> float:
  """One log-prob chunk's float32 [rows, chunk, vocab] arrays, `copies` of them at once."""
  return copies * rows * logit_chunk * model.vocab_size / tensor * 4


def update_peak(model, *, rows: float, seq_len: float, logit_chunk: int, param_bytes: float,
                gathered_bytes: float = 0.0, tensor: int = 1, remat: str = "none",
                flash_attention: bool = False, accumulate: bool = False,
                tpu: dict | None = None) -> dict[str, float]:
  """What one device holds beyond its resident state at an update's peak, by kind (sum: the
  peak). `rows`: rows of one micro-batch (or minibatch) on this device; `logit_chunk`: positions
  per log-prob chunk (jaxrl/models/lm_head.chunk_length); `param_bytes`: this device's shard of
  the trained parameters in float32; `gathered_bytes`: the compute-dtype weights an fsdp
  all-gather assembles on it (0 without fsdp); `accumulate`: micro-batches. `tpu` (params,
  fsdp, lora): the TPU compiler's layout instead (planner/footprint_tpu.py)."""
  if tpu is not None:
    return footprint_tpu.update_peak(model, rows=rows, seq_len=seq_len, logit_chunk=logit_chunk,
                                     param_bytes=param_bytes, tensor=tensor, remat=remat,
                                     accumulate=accumulate, cb=compute_bytes(model), **tpu)
  tokens, n = rows * seq_len, model.n_layers
  # An MoE layer's blocked products gather expert weights per block: kept for the backward
  # without remat, and in a layer's backward their gradient as large again.
  experts = expert_block_bytes(model, tokens, tensor)
  work = tokens * block_bytes(model, seq_len, tensor, flash_attention) + 2 * experts
  saved = (tokens * saved_bytes(model, remat, seq_len, tensor, flash_attention)
           + (experts if remat == "none" else 0.0))
  layer_grads = param_bytes * layer_fraction(model) / n
  head_grads = param_bytes - n * layer_grads
  base = {"gradients": param_bytes if accumulate else 0.0,
          "gathered weights": gathered_bytes if remat == "none" else 0.0}
  phases = [
      {"activations": n * saved, "logits": logits_bytes(model, rows, logit_chunk, tensor=tensor),
       "gradients": head_grads},
      {"activations": (n - 1) * saved + work, "gradients": head_grads + layer_grads},
      {"activations": work, "gradients": param_bytes},
  ]
  phases = [{k: base.get(k, 0.0) + p.get(k, 0.0) for k in UPDATE_ITEMS} for p in phases]
  optimizer = {**dict.fromkeys(UPDATE_ITEMS, 0.0), "gradients": 2 * param_bytes}
  return max(phases + [optimizer], key=lambda p: sum(p.values()))


def scoring_peak(model, *, rows: float, seq_len: float, logit_chunk: int, tensor: int = 1,
                 flash_attention: bool = False) -> dict[str, float]:
  """A forward-only pass (old or reference log-probs) on `rows` rows of this device: one block's
  activations at a time, or, at the end, one chunk's logits and their exponent."""
  block = (rows * seq_len * block_bytes(model, seq_len, tensor, flash_attention)
           + expert_block_bytes(model, rows * seq_len, tensor))
  logits = logits_bytes(model, rows, logit_chunk, copies=2, tensor=tensor)
  return {"activations": block if block >= logits else 0.0,
          "logits": logits if logits > block else 0.0}


def kv_cache_bytes(model, rows: float, slots: float, tensor: int = 1) -> float:
  """The sampler's KV cache of `rows` rows of `slots` slots on one device of its tensor group
  (KV heads split over at most their count; replicated beyond)."""
  m = model
  heads = m.n_kv_heads / min(tensor, m.n_kv_heads)
  return rows * slots * m.n_layers * 2 * heads * m.head_dim * compute_bytes(m)
