"""Peak memory and time of a train step with a large vocabulary: chunked log-probs against full
logits.

  python -m benchmarks.logprob_memory --json          # 152k vocabulary, 2 layers, 8 x 1024 tokens
  python -m benchmarks.logprob_memory --json --dtype bfloat16 --tokens 256 --variants chunked

One process builds a Qwen-vocabulary model (151,936 tokens, tied HF-style head; d_model 256,
2 layers; `--dtype` its compute dtype) and a train step on `--rows` x `--tokens` tokens whose loss
uses every position's log-prob and entropy (as SFT plus an entropy bonus does), once per
`--variants`: `chunked`, `train.updates.forward.token_logprobs` (jaxrl/models/lm_head.py: the LM
head and softmax in chunks, each chunk's logits recomputed in its backward, no
[B, T, V] tensor forward or backward), and `full`, the model's [B, T, V] logits, log-softmax and
entropy at once (`head.dense_logprobs`).
For each, the step's peak memory: the rise of the process's peak resident memory while the
compiled step runs, the peak reset before each (XLA:CPU's `memory_analysis` reports no
temporaries, so the host's own count it is; on an accelerator read the device's peak instead),
and its best time over `--repeats` runs (`*_step_s`; `*_step_cpu_s`: process CPU seconds, all
threads). With both, the log-probs are compared on the same batch (`max_abs_diff`) and
`memory_ratio` = chunked / full.
"""
from __future__ import annotations

import argparse
import time

from benchmarks.common import emit


def peak_rss() -> int:
  """The process's peak resident memory since the last reset (Linux: VmHWM)."""
  with open("/proc/self/status", encoding="ascii") as f:
    line = next(line for line in f if line.startswith("VmHWM:"))
  return int(line.split()[1]) * 1024


def reset_peak_rss() -> int:
  """Resets the peak to the current resident memory (Linux >= 4.0) and returns it."""
  with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
    f.write("5")
  return peak_rss()


def _best_times(fn, repeats: int) -> tuple[float, float]:
  """The best wall and process CPU seconds (all threads) of `fn()` over `repeats` runs: on a
  shared machine the CPU seconds move less with the other processes' load."""
  best_wall = best_cpu = float("inf")
  for _ in range(repeats):
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    best_wall = min(best_wall, time.perf_counter() - wall)
    best_cpu = min(best_cpu, time.process_time() - cpu)
  return best_wall, best_cpu


def _parse():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--vocab", type=int, default=151_936)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--d-model", type=int, default=256)
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--tokens", type=int, default=1024)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--variants", default="chunked,full",
                      help="comma-separated: chunked, full")
  parser.add_argument("--repeats", type=int, default=2)
  return parser.parse_args()


def main() -> None:
  args = _parse()
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jaxrl.models.config import ModelConfig
  from jaxrl.models.lm_head import dense_logprobs
  from jaxrl.models.transformer import LanguageModel
  from jaxrl.models.rope import positions_from_valid
  from train.updates.forward import token_logprobs

  cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
                    n_heads=4, n_kv_heads=2, head_dim=args.d_model // 4, d_ff=4 * args.d_model,
                    tie_embeddings=True, scale_tied_head=False, dtype=args.dtype)
  graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  tokens_BT = jax.random.randint(jax.random.key(1), (args.rows, args.tokens), 0, args.vocab)
  valid_BT = jnp.ones(tokens_BT.shape, bool)

  def chunked(params):
    return token_logprobs(graphdef, params, tokens_BT, valid_BT)

  def full(params):
    model = nnx.merge(graphdef, params)
    h_BTD, _ = model.decoder(tokens_BT, positions_from_valid(valid_BT), valid_BT)
    return dense_logprobs(h_BTD[:, :-1], model.head_VD(), tokens_BT[:, 1:],
                          softcap=cfg.logit_softcap)

  def train_step(logprobs):
    def loss(params):
      logp_BT, entropy_BT = logprobs(params)
      return -logp_BT.mean() - 0.01 * entropy_BT.mean()
    return jax.jit(lambda params: jax.tree.map(lambda p, g: p - 1e-3 * g, params,
                                               jax.grad(loss)(params)))

  variants = {name: {"chunked": chunked, "full": full}[name]
              for name in args.variants.split(",")}
  result = {"vocab": args.vocab, "rows": args.rows, "tokens": args.tokens,
            "layers": args.layers, "d_model": args.d_model, "dtype": args.dtype}
  if len(variants) == 2:
    logp = {name: jax.block_until_ready(jax.jit(fn)(params)[0]) for name, fn in variants.items()}
    result["max_abs_diff"] = float(jnp.abs(logp["chunked"] - logp["full"]).max())
    del logp
  for name, fn in variants.items():
    step = train_step(fn).lower(params).compile()
    base = reset_peak_rss()
    jax.block_until_ready(step(params))
    result[f"{name}_peak_bytes"] = peak_rss() - base
    wall, cpu = _best_times(lambda: jax.block_until_ready(step(params)), args.repeats)
    result[f"{name}_step_s"], result[f"{name}_step_cpu_s"] = round(wall, 3), round(cpu, 3)
  if len(variants) == 2:
    result["memory_ratio"] = round(result["chunked_peak_bytes"] / result["full_peak_bytes"], 4)
  emit({**result, "device": jax.devices()[0].device_kind}, args.json)


if __name__ == "__main__":
  main()
