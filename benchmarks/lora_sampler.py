"""LoRA's two sampler modes, measured alternately in one process: `merged` (the push folds the
adapters into a copy of the base; decoding is the plain model's) against `adapters` (the push
moves the adapters alone and the sampler reads the actor's base; each decode step adds the
low-rank products).

  python -m benchmarks.lora_sampler --json

A SmolLM2-135M-shaped model (float32, rank-16 adapters on all seven projections), actor and
sampler colocated on one device, as on one GPU: seconds per push, per decode step (the sampler's
own jitted step, 16 rows, a 256-slot cache, a loop of 32 steps in one program), and per RL step's
generation + push at `--new_tokens` decode steps.
"""
from __future__ import annotations

import argparse
import time

from benchmarks.common import add_host_flags, emit, setup_host


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--rows", type=int, default=16)
  parser.add_argument("--new_tokens", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=5)
  add_host_flags(parser)
  args = parser.parse_args()
  setup_host(args)
  import jax
  actor, copies, plain = _copies(args.rank)
  best = _timed(actor, copies, plain, args.rows, args.repeats)
  per_step = {m: best[f"{m}_push_s"] + args.new_tokens * best[f"{m}_decode_step_s"]
              for m in copies}
  emit({**{k: round(v, 6) for k, v in best.items()},
        **{f"{m}_generation_and_push_s": round(v, 4) for m, v in per_step.items()},
        "adapters_over_merged": round(per_step["adapters"] / per_step["merged"], 3),
        "faster": min(per_step, key=per_step.get), "rank": args.rank, "rows": args.rows,
        "new_tokens": args.new_tokens, "device": jax.devices()[0].device_kind}, args.json)


def _copies(rank: int):
  """A SmolLM2-135M-shaped LoRA actor with its adapters off zero, its sampler's copy in each
  mode, and the plain model's graph."""
  import jax
  from flax import nnx

  from jaxrl.config_files import shipped
  tiny = shipped("tiny")
  from jaxrl.config_files import resolve
  from jaxrl.models import lora
  from jaxrl.models.transformer import LanguageModel
  from sharding.mesh import make_mesh
  from train.roles.role import ModelRole
  from train.roles.sampler_weights import SamplerWeights

  c = tiny.get_config()
  c.model.update(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                 head_dim=64, d_ff=1536, tie_embeddings=True, scale_tied_head=False)
  c.lora.rank = rank
  mesh = make_mesh({}, devices=jax.devices()[:1])
  cfg = resolve(c)
  actor = ModelRole("actor", lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(0), lora=cfg.lora),
                    mesh, trainable=lora.TRAINABLE).initialize()
  adapters = actor.split(actor.params)[0]
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(adapters))))
  actor.set_trained(jax.tree.map(lambda x: x + 0.01 * jax.random.normal(next(keys), x.shape),
                                 adapters))
  plain = nnx.split(nnx.eval_shape(lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(0))))[0]
  copies = {mode: SamplerWeights(resolve({**c.to_dict(), "lora": {**c.lora.to_dict(),
                                                                  "sampler": mode}}),
                                 actor, mesh, plain)
            for mode in ("merged", "adapters")}
  return actor, copies, plain


def _decoder(graphdef, b: int, slots: int, steps: int):
  """jit: `steps` greedy decode steps of `b` rows through the model's own decode step."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jaxrl.models.decoding import LMDecoding

  def run(params, cache, tok_B):
    dec = LMDecoding.of(nnx.merge(graphdef, params))
    step = dec.decode_fn("features" if jax.default_backend() == "cpu" else "rows")
    rope = dec.rope(jnp.zeros((b, 1), jnp.int32))
    valid = jnp.ones((b, slots), bool)

    def body(i, carry):
      tok, cache = carry
      logits, cache, _ = step(tok, (rope[0][:, 0], rope[1][:, 0]), valid, cache, i)
      return jnp.argmax(logits, -1).astype(jnp.int32), cache
    return jax.lax.fori_loop(0, steps, body, (tok_B, cache))[0]
  return jax.jit(run)


def _timed(actor, copies: dict, plain, b: int, repeats: int, slots: int = 256,
           steps: int = 32) -> dict:
  """The best push and per-step decode seconds of each mode, measured alternately."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jaxrl.models.decoding import LMDecoding

  runs = {mode: _decoder(copy.graphdef, b, slots, steps) for mode, copy in copies.items()}
  cache = LMDecoding.of(nnx.merge(plain, copies["merged"].fresh())).init_cache(b, slots)
  tok_B = jnp.zeros((b,), jnp.int32)
  times = {f"{m}_{k}": [] for m in copies for k in ("push_s", "decode_step_s")}
  for _ in range(repeats):  # alternately, so drifts in the machine hit both
    for mode, copy in copies.items():
      actor.set_trained(actor.split(actor.params)[0])  # a new version: push again
      t0 = time.perf_counter()
      params = copy.fresh()
      jax.block_until_ready(params)
      times[f"{mode}_push_s"].append(time.perf_counter() - t0)
      jax.block_until_ready(runs[mode](params, cache, tok_B))  # compiled (first round)
      t0 = time.perf_counter()
      jax.block_until_ready(runs[mode](params, cache, tok_B))
      times[f"{mode}_decode_step_s"].append((time.perf_counter() - t0) / steps)
  return {k: min(v[1:] or v) for k, v in times.items()}


if __name__ == "__main__":
  main()
