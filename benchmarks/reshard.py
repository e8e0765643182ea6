"""Reshard throughput against memcpy of the same bytes, measured in the same process.

  python -m benchmarks.reshard --json

A model of >= 100 MB (float32 Llama-style parameters) goes from a 4-device fsdp layout (devices
0-3) to a disjoint 2 x 2 data/tensor layout (devices 4-7) on a fake 8-device CPU mesh.
"""
from __future__ import annotations

import argparse

from benchmarks.common import add_host_flags, best_seconds, emit, setup_host
from sharding.host import force_cpu_devices


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--bucket-mb", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  add_host_flags(parser)
  args = parser.parse_args()
  retained = setup_host(args)
  force_cpu_devices(8)

  import jax
  import numpy as np
  from flax import nnx

  from jaxrl.models.config import ModelConfig
  from jaxrl.models.transformer import LanguageModel
  from sharding.mesh import param_shardings
  from sharding.placement import make_placement
  from sharding.reshard import reshard
  from sharding.rules import SAMPLER_RULES, TRAIN_RULES
  from train.roles.role import ModelRole

  cfg = ModelConfig(vocab_size=32768, d_model=1024, n_layers=4, n_heads=16, n_kv_heads=8,
                    head_dim=64, d_ff=2816, tie_embeddings=False)
  placement = make_placement("separate", 8, train_devices=4, sampler_tensor=2)
  state = ModelRole("actor", lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)),
                    placement.mesh("actor"), TRAIN_RULES).initialize().params
  target = param_shardings(state, SAMPLER_RULES, placement.mesh("sampler"))
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  results = []

  def move():
    moved, stats = reshard(state, target, bucket_bytes=args.bucket_mb << 20)
    results.append(stats)
    jax.tree.map(lambda x: x.delete(), moved)

  seconds = best_seconds(move, repeats=args.repeats)
  # memcpy of the same bytes the devices receive: the sampler replicates over `data`, so the
  # destination gets `data` copies of the weights.
  copies = placement.mesh("sampler").shape["data"]
  src = np.ones(nbytes // 4, np.float32)
  dst = np.empty_like(src)
  memcpy_s = best_seconds(lambda: [np.copyto(dst, src) for _ in range(copies)], repeats=args.repeats)
  moved_bytes = nbytes * copies
  emit({"bytes": nbytes, "bytes_written": moved_bytes, "seconds": round(seconds, 4),
        "retain_freed_memory": retained,
        "gbps": round(moved_bytes / seconds / 1e9, 2),
        "memcpy_gbps": round(moved_bytes / memcpy_s / 1e9, 2),
        "ratio_to_memcpy": round(memcpy_s / seconds, 3), "buckets": results[-1].buckets,
        "bucket_mb": args.bucket_mb}, args.json)


if __name__ == "__main__":
  main()
