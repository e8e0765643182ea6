"""Sampler throughput against this machine's matmul peak, measured in the same process.

  python -m benchmarks.sampler --json              # batch 64 (the reference config)
  python -m benchmarks.sampler --json --batch 8
  python -m benchmarks.sampler --json --devices 1  # one device only
  python -m benchmarks.sampler --json --model 2048,16,16,8,8192,32000 --dtype bfloat16  # on a GPU

Reference config: vocab 256, d_model 256, 4 layers, 4 heads, 2 KV heads, MLP 1024, prompt 16,
64 new tokens, fp32, temperature 1, EOS ignored. FLOPs are counted as 2 x non-embedding
parameters per generated token. Decode runs as the sampler role does, data parallel over a mesh
of `--devices` devices (default on a CPU host: one device per core while each keeps >= 32 rows,
since below that a core spends its step streaming weights for too few rows; elsewhere 1). The
matmul peak is measured over the whole host (all cores) either way.
"""
from __future__ import annotations

import argparse
import os

from benchmarks.common import add_host_flags, setup_host, best_seconds, emit, matmul_flops_per_s
from sharding.host import force_cpu_devices


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true", help="print only the JSON line")
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--prompt-len", type=int, default=16)
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--tensor", type=int, default=1, help="tensor-parallel degree")
  parser.add_argument("--devices", type=int, default=0,
                      help="decode devices (0: one per CPU core with >= 32 rows each on a CPU host)")
  parser.add_argument("--model", default="256,4,4,2,1024,256",
                      help="d_model,layers,heads,kv_heads,mlp,vocab (default: the reference config)")
  parser.add_argument("--dtype", default="float32", help="compute dtype: float32 or bfloat16")
  parser.add_argument("--layout", default="auto", help="decode activation layout: auto, "
                      "features or rows (SamplingConfig.decode_layout)")
  add_host_flags(parser)
  args = parser.parse_args()
  retained = setup_host(args)
  cpu_devices = args.devices or max(1, min(len(os.sched_getaffinity(0)), args.batch // 32))
  force_cpu_devices(cpu_devices)  # only affects the CPU backend

  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jaxrl.models.llama import LanguageModel, ModelConfig
  from sampler.methods import SamplingConfig
  from sampler.sampler import jit_generate
  from sharding.mesh import make_mesh, param_shardings
  from sharding.rules import SAMPLER_RULES

  try:
    d, layers, heads, kv_heads, mlp, vocab = (int(x) for x in args.model.split(","))
    cfg = ModelConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads,
                      n_kv_heads=kv_heads, head_dim=d // heads, d_ff=mlp, tie_embeddings=True,
                      dtype=args.dtype)
  except ValueError as e:
    parser.error(f"--model {args.model!r} / --dtype {args.dtype!r}: {e}")
  graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  sample_cfg = SamplingConfig(max_new_tokens=args.new_tokens, eos_id=0, pad_id=0,
                              method="temperature", temperature=1.0, ignore_eos=True,
                              decode_layout=args.layout)
  devices = args.devices or (cpu_devices if jax.default_backend() == "cpu" else 1)
  if args.batch % devices or devices % args.tensor:
    parser.error(f"--devices {devices}: must divide --batch {args.batch} and be a multiple of "
                 f"--tensor {args.tensor}")
  mesh = make_mesh({"data": devices // args.tensor, "tensor": args.tensor}, jax.devices()[:devices])
  shardings = param_shardings(params, SAMPLER_RULES, mesh)
  params = jax.device_put(params, shardings)
  fn = jit_generate(graphdef, sample_cfg, mesh=mesh, param_shardings=shardings)
  tokens_BP = jax.random.randint(jax.random.key(1), (args.batch, args.prompt_len), 1, vocab)
  valid_BP = jnp.ones((args.batch, args.prompt_len), bool)
  seconds = best_seconds(
      lambda: jax.block_until_ready(fn(params, tokens_BP, valid_BP, jax.random.key(2))),
      repeats=args.repeats)
  non_embedding = sum(x.size for x in jax.tree.leaves(params)) - cfg.vocab_size * cfg.d_model
  tokens = args.batch * args.new_tokens
  flops_per_s = 2 * non_embedding * tokens / seconds
  peak = matmul_flops_per_s(dtype=args.dtype)
  emit({"tokens_per_s": round(tokens / seconds, 1), "batch": args.batch, "devices": devices,
        "retain_freed_memory": retained, "layout": args.layout, "model": args.model,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "flops_per_s": round(flops_per_s), "matmul_flops_per_s": round(peak),
        "ratio_to_matmul_peak": round(flops_per_s / peak, 3), "seconds": round(seconds, 4),
        "device": jax.devices()[0].device_kind}, args.json)


if __name__ == "__main__":
  main()
