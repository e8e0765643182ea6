"""The update's peak as the TPU compiler lays it out (libtpu 0.0.42.1, read from its buffer
assignments of jaxrl's RL update: benchmarks/target_sweep.py, benchmarks/live_peak.py). Its
habits differ from XLA:CPU's, to which planner/footprint.py's counts are fitted:

  - a block keeps its projections' outputs in the compute dtype, no float32 copies of them:
    without remat gate, up and their product, queries, keys, values and attention's output and
    about 3.25 d_model-sized states; under `dots` the same less the product and all but 0.3 of
    the states; under `full` about 3.5 d_model-sized states;
  - the splash kernel keeps no [T, T] scores but its softmax statistics in float32, padded to
    128 lanes: 512 bytes per token, head and layer;
  - a log-prob chunk's float32 logits (about 0.8 of a copy at the peak), the head's float32
    gradient whole and its compute-dtype copy; about 0.9 compute-dtype copies of each weight
    shard and, under fsdp, half a layer's gathered weights;
  - the temporaries are packed into one preallocated buffer about 1.2x their live peak
    ("buffer packing"), and loops carry buffers outside it: two float32 head gradients (the
    log-prob chunks' loop) and, with micro-batches, the gradient accumulator.

Fitted to the `temp_size_in_bytes` of 12 small updates on a v5e-4 (within 12% at each) and,
held out, within 4% of the Qwen2.5-0.5B update's on a v5p-8 (docs/benchmarks.md)."""
from __future__ import annotations

from jaxrl.models import flops

SAVED_D_MODEL = {"none": 3.25, "dots": 0.3, "full": 3.5}  # d_model-sized states a block keeps
SPLASH_STATS = 4 * 128  # float32 bytes per token and head of the splash kernel's statistics
WORK_D_MODEL = 4.0  # d_model-sized states of a block's backward beyond what it saved
LOGIT_COPIES, WEIGHT_COPIES, GATHERED_LAYERS, PACKING = 0.8, 0.9, 0.5, 1.2
HEAD_GRADIENT_CARRIES = 2  # float32 head gradients the log-prob chunks' loop carries


def _saved(m, remat: str, tensor: int, lora: bool, cb: int) -> float:
  """Bytes per token one block keeps from its forward to its backward."""
  states = cb * SAVED_D_MODEL[remat] * m.d_model
  if remat == "full":
    return states
  attn = (2 * m.n_heads + 2 * m.n_kv_heads) * m.head_dim  # queries, keys, values, output
  ff = 2 if remat == "dots" else 3  # gate, up (and their product)
  out = states + (cb * (ff * m.d_ff + attn) + SPLASH_STATS * m.n_heads) / tensor
  return out + (cb * m.d_ff / tensor if lora else 0.0)  # the state w_down's adapter reads


def update_peak(m, *, rows: float, seq_len: float, logit_chunk: int, param_bytes: float,
                params: int, fsdp: int, tensor: int, remat: str, accumulate: bool, lora: bool,
                cb: int) -> dict[str, float]:
  """footprint.update_peak for a TPU target: `params` in the whole model, `fsdp` and `tensor`
  its trainer mesh's degrees, `lora`: only adapters train (the head gets no gradient)."""
  tokens, n = rows * seq_len, m.n_layers
  saved = tokens * _saved(m, remat, tensor, lora, cb)
  work = saved + tokens * cb * WORK_D_MODEL * m.d_model
  layer = flops.layer_params(m)
  head = m.vocab_size * m.d_model / tensor
  head_grad = 0.0 if lora else 4 * head
  layer_grad = 0.0 if lora else 4 * layer / (fsdp * tensor)
  copies = WEIGHT_COPIES * cb * params / (fsdp * tensor)
  gathered = copies + (GATHERED_LAYERS * cb * layer / tensor if fsdp > 1 else 0.0)
  grads = param_bytes if accumulate else 0.0  # the accumulator
  logits = LOGIT_COPIES * rows * logit_chunk * m.vocab_size * 4 / tensor + cb * head
  phases = [
      {"activations": n * saved, "logits": logits, "gradients": grads + head_grad,
       "gathered weights": copies},
      {"activations": (n - 1) * saved + work, "gathered weights": gathered,
       "gradients": grads + head_grad + layer_grad},
      {"activations": work, "gathered weights": gathered, "gradients": grads + param_bytes},
      {"gradients": param_bytes},
  ]
  peak = max(phases, key=lambda p: sum(p.values()))
  out = {k: peak.get(k, 0.0) for k in ("gradients", "activations", "logits", "gathered weights")}
  out["buffer packing"] = (PACKING - 1) * sum(out.values())
  out["gradients"] += HEAD_GRADIENT_CARRIES * head_grad + grads
  return out
