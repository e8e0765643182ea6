"""The update's peak as the TPU compiler lays it out (libtpu 0.0.42.1, read from its buffer
assignments of jaxrl's RL update: benchmarks/target_sweep.py, benchmarks/live_peak.py). Its
habits differ from XLA:CPU's, to which planner/footprint.py's counts are fitted:

  - a block keeps its projections' outputs in the compute dtype, no float32 copies of them:
    without remat gate, up and their product, queries, keys, values and attention's output and
    about 3.25 d_model-sized states; under `dots` the same less the product and all but 0.3 of
    the states; under `full` about 3.5 d_model-sized states;
  - the splash kernel keeps no [T, T] scores but its softmax statistics in float32, padded to
    128 lanes: 512 bytes per token, head and layer without remat; under `dots` (they are no
    matrix product's output) one layer's at a time, recomputed in its backward;
  - a log-prob chunk's float32 logits (about 0.8 of a copy at the peak), the head's float32
    gradient whole and its compute-dtype copy; about 0.9 compute-dtype copies of each weight
    shard and, under fsdp, half a layer's gathered weights;
  - the temporaries are packed into one preallocated buffer about 1.2x their live peak
    ("buffer packing"), and loops carry buffers outside it: two float32 head gradients (the
    log-prob chunks' loop), at most 32 MiB of them, and, with several micro-batches per
    minibatch, the gradient accumulator (one micro-batch accumulates nothing). Under fsdp over
    8 chips or more the compiler multiplies by the head shard by shard (a "windowed einsum"):
    the head is never gathered whole, and the loop carries about a tenth of its float32
    gradient (the 70B's update on a v5p-64: 0.33 GiB beside the 3.91 GiB gradient, whole at
    the peak with the blocks' saved gate and up outputs); through the blocks' backward only
    this device's shard of it stays (Qwen2.5-3B's shape on a v5e-16: 74 MiB of 1.16 GiB). A tied
    head of 16 to 512 MiB is not windowed (GATHERED_TIED_HEAD_BYTES).

A scanned decoder (`model.layers.scan`, a TPU's default) keeps the same per-layer activations
(its norms and gated activation recompute their float32 intermediates in the backward, as the
unrolled program's fusions do) but its loops' bodies hold their temporaries apart: about
SCAN_WORK = 1.5 layers' working sets more (fitted to the first 14 points of
benchmarks/target_sweep.py scanned: 0.86x to 1.19x at each of its 22 since issue 64). Its
scoring passes gather about 1.25 layers at a time, read a compute-dtype copy of a float32
stack made ahead of the scan, and reserve 2.5 MiB beside (0.91x to 1.22x at the points but
LoRA's, 0.76x to 0.80x, and the 4-way data-parallel reference, 1.33x).

Fitted to the `temp_size_in_bytes` of 12 small updates on a v5e-4 (0.84x to 1.12x at each,
0.90x to 1.12x before LoRA's frozen base lost its copy) and, held out, within 9% of the
real-size updates under fsdp 4 (docs/benchmarks.md's target table). At a 32768-word
vocabulary under fsdp 4 it was 1.38x the compiler's (the loop carried 27 MiB there, not two 64
MiB gradients): the carried gradients are capped at CARRIED_MAX, which takes the sweep's
large-vocabulary points to 0.93x to 1.03x and the real-size updates to 0.91x to 1.06x, but
Gemma-3-12B's (0.67x: its 256-wide heads and 262208-word vocabulary were never fitted).

A scoring pass (old or reference log-probs; `scoring_peak`) holds, at its peak, either the head's
weights gathered whole beside one log-prob chunk's float32 logits (a tied table also keeps two
relaid copies of its own shard), or a block's gate and up outputs beside the weights fsdp
gathers for it and the next (about two layers; under fsdp over 8 or more chips the compiler
multiplies by each shard in turn, a "windowed einsum", and gathers no layer whole). A pass in
several pieces (`rl.pass_rows`) loops over them, and ahead of that loop the compiler makes what
every piece reads: float32 weights' compute-dtype copy, and under a windowed einsum each layer's
shard buffers (about 1.15 of a layer's shard). Read from the buffers live at the peak of the
compiled passes (benchmarks/live_peak.py `at_peak`) of 14 small points on a v5e-4 and the real
configs of docs/benchmarks.md's target table."""
from __future__ import annotations

from jaxrl.models import flops

WINDOWED_FSDP = 8  # fsdp degree from which the compiler multiplies by weights shard by shard
# ... but a tied head whose compute-dtype table is in this range (a 32768 x 512 one over 16
# chips: 32 MiB) is gathered whole and its float32 gradient all-reduced whole, as under fsdp 4,
# where at 4 MiB (4096 x 512 over 8 chips), at Qwen2.5-3B's 594 MiB and for untied heads it is
# not (read from the compiled updates' buffers at their live peaks; the compiler's own rule,
# a memory-pressure heuristic, is not documented)
GATHERED_TIED_HEAD_BYTES = (16 * 2**20, 512 * 2**20)
SAVED_D_MODEL = {"none": 3.25, "dots": 0.3, "full": 3.5}  # d_model-sized states a block keeps
SPLASH_STATS = 4 * 128  # float32 bytes per token and head of the splash kernel's statistics
WORK_D_MODEL = 4.0  # d_model-sized states of a block's backward beyond what it saved
SCAN_WORK = 1.5  # layers' working sets a scanned decoder's loop bodies hold beside the rest
LOGIT_COPIES, WEIGHT_COPIES, GATHERED_LAYERS, PACKING = 0.8, 0.9, 0.5, 1.2
# float32 head gradients the log-prob chunks' loop carries: whole, or (fsdp over
# WINDOWED_FSDP chips or more, the head's product shard by shard) a tenth of one
HEAD_GRADIENT_CARRIES, WINDOWED_HEAD_CARRIES = 2, 0.1
CARRIED_MAX = 32 * 2**20  # and at most this many bytes of them (a head of 32768 x 512 up)


def scanned(m) -> bool:
  """Whether `m` (a model config) runs scanned on a TPU: `layers.scan` true, or auto (the
  platform's default there), whatever platform plans it."""
  return m.layers.scan != "false"


def _saved(m, remat: str, tensor: int, lora: bool, cb: int) -> float:
  """Bytes per token one block keeps from its forward to its backward."""
  states = cb * SAVED_D_MODEL[remat] * m.d_model
  if remat == "full":
    return states
  attn = (2 * m.n_heads + 2 * m.n_kv_heads) * m.head_dim  # queries, keys, values, output
  ff = 2 if remat == "dots" else 3  # gate, up (and their product)
  # the splash kernel's statistics are no matrix product's output: `dots` recomputes them in
  # each layer's backward (`_recomputed`)
  stats = SPLASH_STATS * m.n_heads if remat == "none" else 0
  out = states + (cb * (ff * flops.token_ff(m) + attn) + stats) / tensor
  return out + (cb * m.d_ff / tensor if lora else 0.0)  # the state w_down's adapter reads


def _windowed_head(m, fsdp: int, cb: int) -> bool:
  """Whether the compiler multiplies by the LM head shard by shard in the update."""
  low, high = GATHERED_TIED_HEAD_BYTES
  return fsdp >= WINDOWED_FSDP and not (
      m.tie_embeddings and low <= cb * m.vocab_size * m.d_model < high)


def _recomputed(m, remat: str, tensor: int) -> float:
  """Bytes per token a layer's backward recomputes beyond its working set: under `dots` the
  splash kernel's statistics (one layer's at a time; fitted with the sweep's dots points, the
  longest 2048 tokens: 0.94x to 1.00x with them, 0.82x to 0.89x without)."""
  return SPLASH_STATS * m.n_heads / tensor if remat == "dots" else 0.0


def update_peak(m, *, rows: float, seq_len: float, logit_chunk: int, param_bytes: float,
                params: int, fsdp: int, tensor: int, remat: str, accumulate: bool, lora: bool,
                cb: int) -> dict[str, float]:
  """footprint.update_peak for a TPU target: `params` in the whole model, `fsdp` and `tensor`
  its trainer mesh's degrees, `lora`: only adapters train (the head gets no gradient)."""
  tokens, n = rows * seq_len, m.n_layers
  saved = tokens * _saved(m, remat, tensor, lora, cb)
  work = saved + tokens * (cb * WORK_D_MODEL * m.d_model + _recomputed(m, remat, tensor))
  layer = flops.layer_params(m)
  head = m.vocab_size * m.d_model / tensor
  head_grad = 0.0 if lora else 4 * head
  windowed = _windowed_head(m, fsdp, cb)  # (the head multiplied shard by shard, never gathered)
  layer_grad = 0.0 if lora else 4 * layer / (fsdp * tensor)
  # compute-dtype copies of the float32 weights (LoRA's frozen base is stored in the dtype)
  copies = 0.0 if lora else WEIGHT_COPIES * cb * params / (fsdp * tensor)
  gathered = copies + (GATHERED_LAYERS * cb * layer / tensor if fsdp > 1 else 0.0)
  grads = param_bytes if accumulate else 0.0  # the accumulator
  logits = LOGIT_COPIES * rows * logit_chunk * m.vocab_size * 4 / tensor + (
      0.0 if windowed else cb * head)
  # A scanned decoder's loops (the forward's, the backward's) keep their bodies' temporaries
  # apart from the rest: about SCAN_WORK layers' working sets more, whatever the phase.
  scan = SCAN_WORK * work if scanned(m) else 0.0
  # After the head's moment its gradient is reduced to this device's shard when the product is
  # windowed (Qwen2.5-3B's shape on a v5e-16: 74 MiB of its 1.16 GiB through the blocks')
  kept_head_grad = head_grad / fsdp if windowed else head_grad
  phases = [
      {"activations": n * saved + scan, "logits": logits, "gradients": grads + head_grad,
       "gathered weights": copies},
      {"activations": (n - 1) * saved + work + scan, "gathered weights": gathered,
       "gradients": grads + kept_head_grad + layer_grad},
      {"activations": work + scan, "gathered weights": gathered,
       "gradients": grads + param_bytes},
      {"gradients": param_bytes},
  ]
  peak = max(phases, key=lambda p: sum(p.values()))
  out = {k: peak.get(k, 0.0) for k in ("gradients", "activations", "logits", "gathered weights")}
  out["buffer packing"] = (PACKING - 1) * sum(out.values())
  carried = (WINDOWED_HEAD_CARRIES * head_grad if windowed
             else min(HEAD_GRADIENT_CARRIES * head_grad, CARRIED_MAX))
  out["gradients"] += carried + grads
  return out


SCORING_FF = 2  # d_ff-sized states at a block's peak in a scoring pass (gate, up)
SCORING_D_MODEL = 4  # d_model-sized states beside them (residual, norm, attention's output)
SCORING_GATHERED_LAYERS = 2.0  # layers fsdp gathers around a block (this one, the next)
WINDOW_BUFFERS = 1.15  # of a layer's shard, kept per layer across a windowed pass's loop
SCORING_PACKING = 1.03
SCORING_FIXED = 12 * 2**20, 4 * 2**20  # bytes the compiler reserves beside (with, without fsdp)
# A scanned decoder's pass: about 1.25 layers gathered at once (no next layer's ahead of its
# turn), and 2.5 MiB reserved beside
SCAN_GATHERED_LAYERS, SCAN_SCORING_FIXED = 1.25, 2.5 * 2**20


def scoring_peak(m, *, rows: float, seq_len: float, logit_chunk: int, fsdp: int, tensor: int,
                 pieces: int, cast_bytes: float, cb: int) -> dict[str, float]:
  """footprint.scoring_peak for a TPU target: `pieces`: calls of the pass's loop,
  `cast_bytes`: this device's float32 weights in the compute dtype (0 when stored in it),
  `logit_chunk` 0 for a value or reward head (no vocabulary)."""
  tokens, layer, head_params = rows * seq_len, flops.layer_params(m), m.vocab_size * m.d_model
  windowed = fsdp >= WINDOWED_FSDP
  head = {"logits": rows * logit_chunk * m.vocab_size * 4 / tensor,
          "gathered weights": (head_params * cb / tensor if fsdp > 1 and logit_chunk else 0.0)
          + (2 * head_params * cb / (fsdp * tensor) if m.tie_embeddings else 0.0)}
  scan = scanned(m)
  gathered = SCAN_GATHERED_LAYERS if scan else SCORING_GATHERED_LAYERS
  block = {"activations": tokens * cb * (SCORING_FF * flops.token_ff(m) + SCORING_D_MODEL * m.d_model)
           / tensor, "gathered weights": (gathered * layer * cb / tensor
                                          if 1 < fsdp and not windowed else 0.0)}
  peak = max((head, block), key=lambda p: sum(p.values()))
  out = {k: peak.get(k, 0.0) for k in ("activations", "logits", "gathered weights")}
  if pieces > 1 or scan:  # (a scan reads the stacked weights' copy, made ahead of it;
    # unrolled, a windowed pass in pieces keeps every layer's shard buffers across its loop)
    windows = windowed and pieces > 1 and not scan
    out["weight copies"] = cast_bytes + (WINDOW_BUFFERS * m.n_layers * layer * cb
                                         / (fsdp * tensor) if windows else 0.0)
  fixed = SCAN_SCORING_FIXED if scan else SCORING_FIXED[0] if fsdp > 1 else SCORING_FIXED[1]
  out["buffer packing"] = (SCORING_PACKING - 1) * sum(out.values()) + fixed
  return out
