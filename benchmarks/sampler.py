"""Sampler throughput against this machine's matmul peak, measured in the same process.

  python -m benchmarks.sampler --json              # batch 64 (the reference config)
  python -m benchmarks.sampler --json --batch 8

Reference config: vocab 256, d_model 256, 4 layers, 4 heads, 2 KV heads, MLP 1024, prompt 16,
64 new tokens, fp32, temperature 1, EOS ignored. FLOPs are counted as 2 x non-embedding
parameters per generated token. Runs on one device (the default one).
"""
from __future__ import annotations

import argparse
import functools

from benchmarks.common import add_host_flags, setup_host, best_seconds, emit, matmul_flops_per_s


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true", help="print only the JSON line")
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--prompt-len", type=int, default=16)
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  add_host_flags(parser)
  args = parser.parse_args()
  retained = setup_host(args)

  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jaxrl.models.llama import LanguageModel, ModelConfig
  from sampler.engine import generate
  from sampler.methods import SamplingConfig

  cfg = ModelConfig(vocab_size=256, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64,
                    d_ff=1024, tie_embeddings=True, dtype="float32")
  graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  sample_cfg = SamplingConfig(max_new_tokens=args.new_tokens, eos_id=0, pad_id=0,
                              method="temperature", temperature=1.0, ignore_eos=True)
  fn = jax.jit(functools.partial(generate, graphdef, cfg=sample_cfg))
  tokens_BP = jax.random.randint(jax.random.key(1), (args.batch, args.prompt_len), 1, 256)
  valid_BP = jnp.ones((args.batch, args.prompt_len), bool)
  seconds = best_seconds(
      lambda: jax.block_until_ready(fn(params, tokens_BP, valid_BP, jax.random.key(2))),
      repeats=args.repeats)
  non_embedding = sum(x.size for x in jax.tree.leaves(params)) - cfg.vocab_size * cfg.d_model
  tokens = args.batch * args.new_tokens
  flops_per_s = 2 * non_embedding * tokens / seconds
  peak = matmul_flops_per_s()
  emit({"tokens_per_s": round(tokens / seconds, 1), "batch": args.batch,
        "retain_freed_memory": retained,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "flops_per_s": round(flops_per_s), "matmul_flops_per_s": round(peak),
        "ratio_to_matmul_peak": round(flops_per_s / peak, 3), "seconds": round(seconds, 4),
        "device": jax.devices()[0].device_kind}, args.json)


if __name__ == "__main__":
  main()
