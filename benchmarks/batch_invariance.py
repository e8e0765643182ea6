"""Whether an op's result for one row depends on how many rows it runs with (issue 66).

  python -m benchmarks.batch_invariance --json

A decode step multiplies B rows where the trainer's pass multiplies B x T, attends one query
over the cache where the trainer attends T queries, and normalizes one row of logits where the
trainer normalizes T. For each op at the default model shapes of `configs/tiny.py`'s family
(and a wide one), in float32 on this backend, the share of rows whose result is bitwise equal
to the same rows computed among `--rows` (the trainer's side):

  matmul K x N   rows [M, K] @ [K, N], for M in `--counts`
  scores         q [B, H, 1, D] . k [B, H, S, D] against one position of q [B, H, S, D]
  mix            p [B, H, 1, S] @ v [B, H, S, D] against one position of [B, H, S, S]
  log_softmax    one row [B, H, 1, S] against one of [B, H, S, S]

An exact mode (the sampler's log-probs the trainer's bit for bit) needs every op of both
passes in shapes whose rows come out alike: these say which do on this machine.
"""
from __future__ import annotations

import argparse

MATMULS = ((128, 512), (128, 384), (512, 128), (1024, 256), (64, 4096))
COUNTS = (1, 2, 8, 32, 48, 63, 64, 100, 256)


def _matmuls(rows: int, counts) -> dict:
  import jax
  import numpy as np
  f = jax.jit(lambda x, w: x @ w)
  out = {}
  for k, n in MATMULS:
    kx, kw = jax.random.split(jax.random.key(k + n))
    w, x = jax.random.normal(kw, (k, n)), jax.random.normal(kx, (rows, k))
    whole = np.asarray(f(x, w))
    out[f"{k}x{n}"] = {m: float(np.all(np.asarray(f(x[:m], w)) == whole[:m], axis=1).mean())
                       for m in counts}
  return out


def _attention(b: int = 4, h: int = 4, s: int = 64, d: int = 32) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  kq, kk, kv = jax.random.split(jax.random.key(1), 3)
  q, k, v = (jax.random.normal(key, (b, h, s, d)) for key in (kq, kk, kv))
  scores = jax.jit(lambda q, k: jnp.einsum("bhtd,bhsd->bhts", q, k))
  mix = jax.jit(lambda p, v: jnp.einsum("bhts,bhsd->bhtd", p, v))
  norm = jax.jit(lambda x: jax.nn.log_softmax(x, axis=-1))
  all_s = np.asarray(scores(q, k))
  p = jax.nn.softmax(jnp.asarray(all_s), axis=-1)
  all_m, all_n = np.asarray(mix(p, v)), np.asarray(norm(jnp.asarray(all_s)))
  equal = lambda one, t, full: bool(np.array_equal(np.asarray(one)[:, :, 0], full[:, :, t]))
  share = lambda fn: float(np.mean([fn(t) for t in range(s)]))
  return {"scores": share(lambda t: equal(scores(q[:, :, t:t + 1], k), t, all_s)),
          "mix": share(lambda t: equal(mix(p[:, :, t:t + 1], v), t, all_m)),
          "log_softmax": share(lambda t: equal(norm(jnp.asarray(all_s[:, :, t:t + 1])), t,
                                               all_n))}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rows", type=int, default=2048)
  parser.add_argument("--counts", type=int, nargs="+", default=list(COUNTS))
  parser.add_argument("--json", action="store_true")
  args = parser.parse_args(argv)
  import jax

  from benchmarks.common import emit
  result = {"device": jax.devices()[0].device_kind, "rows": args.rows,
            "matmul": _matmuls(args.rows, args.counts), **_attention()}
  emit(result, args.json)
  return result


if __name__ == "__main__":
  main()
