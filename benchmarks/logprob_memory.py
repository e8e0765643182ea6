"""Peak memory of a train step with a large vocabulary: chunked log-probs against full logits.

  python -m benchmarks.logprob_memory --json          # 152k vocabulary, 2 layers, 8 x 1024 tokens

One process builds a Qwen-vocabulary model (151,936 tokens, tied HF-style head; d_model 256,
2 layers) and a train step on `--rows` x `--tokens` tokens whose loss uses every position's
log-prob and entropy (as SFT plus an entropy bonus does), twice: with
`train.updates.forward.token_logprobs` (jaxrl/algos/logprobs.py: the LM head and softmax in
chunks, no [B, T, V] tensor forward or backward) and with the full-logits version (the model's [B, T, V] logits, log-softmax, entropy).
For each, the step's peak memory: the rise of the process's peak resident memory while the
compiled step runs, the peak reset before each (XLA:CPU's `memory_analysis` reports no
temporaries, so the host's own count it is; on an accelerator read the device's peak instead).
The log-probs of both are compared on the same batch (`max_abs_diff`, fp32), and
`memory_ratio` = chunked / full.
"""
from __future__ import annotations

import argparse

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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--vocab", type=int, default=151_936)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--d-model", type=int, default=256)
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--tokens", type=int, default=1024)
  args = parser.parse_args()

  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jaxrl.algos.logprobs import dense_logprobs
  from jaxrl.models.config import ModelConfig
  from jaxrl.models.transformer import LanguageModel, positions_from_valid
  from train.updates.forward import token_logprobs

  cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
                    n_heads=4, n_kv_heads=2, head_dim=args.d_model // 4, d_ff=4 * args.d_model,
                    tie_embeddings=True, scale_tied_head=False)
  graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  tokens_BT = jax.random.randint(jax.random.key(1), (args.rows, args.tokens), 0, args.vocab)
  valid_BT = jnp.ones(tokens_BT.shape, bool)

  def chunked(params):
    return token_logprobs(graphdef, params, tokens_BT, valid_BT)

  def full(params):
    model = nnx.merge(graphdef, params)
    h_BTD, _ = model.decoder(tokens_BT, positions_from_valid(valid_BT), valid_BT)
    return dense_logprobs(h_BTD[:, :-1], model.head_VD(), tokens_BT[:, 1:])

  def train_step(logprobs):
    def loss(params):
      logp_BT, entropy_BT = logprobs(params)
      return -logp_BT.mean() - 0.01 * entropy_BT.mean()
    return jax.jit(lambda params: jax.tree.map(lambda p, g: p - 1e-3 * g, params,
                                               jax.grad(loss)(params)))

  logp = {name: jax.block_until_ready(jax.jit(fn)(params)[0])
          for name, fn in (("chunked", chunked), ("full", full))}
  max_abs_diff = float(jnp.abs(logp["chunked"] - logp["full"]).max())
  del logp
  peaks = {}
  for name, fn in (("chunked", chunked), ("full", full)):
    step = train_step(fn).lower(params).compile()
    base = reset_peak_rss()
    jax.block_until_ready(step(params))
    peaks[name] = peak_rss() - base
  emit({"vocab": args.vocab, "rows": args.rows, "tokens": args.tokens, "layers": args.layers,
        "d_model": args.d_model, "chunked_peak_bytes": peaks["chunked"],
        "full_peak_bytes": peaks["full"], "memory_ratio": round(peaks["chunked"] / peaks["full"], 4),
        "max_abs_diff": max_abs_diff, "device": jax.devices()[0].device_kind}, args.json)


if __name__ == "__main__":
  main()
