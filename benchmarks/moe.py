"""The mixture of experts' grouped matrix products against the dense one-hot form, measured
alternately in one process (jaxrl/models/moe.py: `grouped_experts`, the assignments sorted by
expert and multiplied by `jax.lax.ragged_dot_general`; `blocked_experts`, the same in blocks of
8 to 64 rows as a batched product; `dense_experts`, every expert over every token, weighted by a
one-hot combine matrix).

  python -m benchmarks.moe --json

One MoE layer shaped as Qwen3-30B-A3B's at a quarter of its width (d_model 512, 32 experts of
width 192, 8 per token; float32 on a CPU), over `--tokens` tokens (a training micro-batch) and
over 16 (a decode step): the forward, and the forward + backward (gradients for the router's
output weights, the experts and the input). Each measurement is the best of `--repeats` calls,
the forms taking turns `--rounds` times; `active_flops_per_s` counts the products a token's k
experts need, divided by the faster grouped form's forward seconds (against the matmul peak
measured here).
"""
from __future__ import annotations

import argparse

from benchmarks.common import best_seconds, emit, matmul_flops_per_s


def _inputs(tokens: int, d: int, experts: int, width: int, k: int, dtype: str):
  import jax
  import jax.numpy as jnp
  keys = jax.random.split(jax.random.key(0), 6)
  x_RD = jax.random.normal(keys[0], (tokens, d), jnp.float32).astype(dtype)
  logits_RE = jax.random.normal(keys[1], (tokens, experts), jnp.float32)
  weights_RK, ids_RK = jax.lax.top_k(jax.nn.softmax(logits_RE), k)
  w = lambda key, shape, fan: jax.random.normal(key, shape, jnp.float32) * fan**-0.5
  return (x_RD, ids_RK, weights_RK, w(keys[2], (experts, width, d), d),
          w(keys[3], (experts, width, d), d), w(keys[4], (experts, d, width), width))


def _programs(impl: str):
  """(forward, forward + backward) of one form, jitted."""
  import jax
  from jaxrl.models.moe import EXPERTS
  fn = lambda x, ids, wk, g, u, dn: EXPERTS[impl](x, ids, wk, g, u, dn, jax.nn.silu)
  loss = lambda x, wk, g, u, dn, ids: (fn(x, ids, wk, g, u, dn) ** 2).sum()
  grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
  return jax.jit(fn), jax.jit(lambda x, ids, wk, g, u, dn: grad(x, wk, g, u, dn, ids))


def measure(tokens: int, args) -> dict:
  import jax
  import numpy as np
  inputs = _inputs(tokens, args.d_model, args.experts, args.width, args.k, args.dtype)
  programs = {impl: _programs(impl) for impl in ("ragged", "blocked", "dense")}
  out = {impl: np.asarray(programs[impl][0](*inputs), np.float32) for impl in programs}
  best = {f"{impl}_{p}": float("inf") for impl in programs for p in ("forward", "train")}
  for _ in range(args.rounds):  # alternate, so that drift on a shared machine hits both
    for impl, (fwd, train) in programs.items():
      for name, fn in (("forward", fwd), ("train", train)):
        s = best_seconds(lambda: jax.block_until_ready(fn(*inputs)), repeats=args.repeats)
        best[f"{impl}_{name}"] = min(best[f"{impl}_{name}"], s)
  active = 2.0 * 3 * args.d_model * args.width * args.k * tokens
  fastest = min(("ragged", "blocked"), key=lambda i: best[f"{i}_train"])
  return {**{f"{k}_s": round(v, 6) for k, v in best.items()},
          **{f"dense_over_{i}_{p}": round(best[f"dense_{p}"] / best[f"{i}_{p}"], 2)
             for i in ("ragged", "blocked") for p in ("forward", "train")},
          "max_abs_difference": max(float(np.abs(out[i] - out["dense"]).max())
                                    for i in ("ragged", "blocked")),
          "fastest_grouped": fastest,
          "active_flops_per_s": round(active / best[f"{fastest}_forward"])}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--tokens", type=int, default=1024)
  parser.add_argument("--d_model", type=int, default=512)
  parser.add_argument("--experts", type=int, default=32)
  parser.add_argument("--width", type=int, default=192)
  parser.add_argument("--k", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--dtype", default="float32", help="the activations' (float32 weights)")
  args = parser.parse_args()
  import jax
  peak = matmul_flops_per_s(dtype=args.dtype)
  result = {f"tokens_{n}": measure(n, args) for n in (args.tokens, 16)}
  for r in result.values():
    r["active_of_matmul_peak"] = round(r["active_flops_per_s"] / peak, 3)
  emit({**result, "matmul_flops_per_s": round(peak), "d_model": args.d_model,
        "experts": args.experts, "width": args.width, "k": args.k, "dtype": args.dtype,
        "device": jax.devices()[0].device_kind}, args.json)


if __name__ == "__main__":
  main()
