"""A GRPO step's scoring pass and update with each prompt run once for its group
(`rl.batching.share_prefix`) against the unshared batch, alternately in one process.

  python -m benchmarks.shared_prefix --json                        # grpo
  python -m benchmarks.shared_prefix --json --workload multiturn

Workloads (a random Llama-family model, `--d-model` 256, `--layers` 4, float32; `--prompts`
2 prompts x `--group` 8 rows, responses of uniform random lengths; the batch pads to the
longest):
  grpo       512-token prompts, 128-256-token responses (a GSM8K-style step at long prompts).
  multiturn  256-token prompts, 4-turn conversations of 256-512 tokens (each turn a 64-token
             reply and up to 64 tokens of the environment's), one row per conversation as
             jaxrl trains them: what the group shares is its prompt.

Variants: `unshared` (the [B, T] batch), `shared` (each prompt's KV cache computed once, its
rows' responses continuing from it: train/updates/prefix.py), `tree` (packed rows, each prompt
once with its rows' responses as branches: train/updates/packing.py; a dense [L, L] mask per
packed row on the CPU). Each is compiled once: the scoring pass (the completion log-probs, as the
reference and old-log-prob passes run) and the update's gradient (`policy_loss` and its
gradient, one minibatch). Reported per variant: forward tokens (positions the passes run), the
compiled programs' FLOPs (XLA's cost analysis), the best seconds over `--rounds` alternating
rounds of two calls each (freed memory kept mapped: `--no-retain-freed-memory` not to); then unshared over each (`*_speedup`), and the largest log-prob difference from the
unshared pass (`max_abs_diff`).
"""
from __future__ import annotations

import argparse
import time

from benchmarks.common import add_host_flags, emit, setup_host

WORKLOADS = {"grpo": dict(prompt=512, low=128, high=256),
             "multiturn": dict(prompt=256, low=256, high=512)}


def _parse():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--workload", choices=sorted(WORKLOADS), default="grpo")
  parser.add_argument("--prompts", type=int, default=2)
  parser.add_argument("--group", type=int, default=8)
  parser.add_argument("--d-model", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--vocab", type=int, default=4096)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--variants", default="unshared,shared,tree")
  add_host_flags(parser)
  return parser.parse_args()


def batch(args, seed: int = 0):
  """(graphdef, params, Experience, prompt lengths, response lengths) of the workload."""
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from jaxrl.models.config import from_fields
  from jaxrl.models.transformer import LanguageModel
  from train.loop.experience import Experience
  w = WORKLOADS[args.workload]
  d = args.d_model
  cfg = from_fields(dict(vocab_size=args.vocab, d_model=d, n_layers=args.layers, n_heads=d // 64,
                         n_kv_heads=d // 64, head_dim=64, d_ff=4 * d, dtype="float32"))
  graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(seed)
  b, p = args.prompts * args.group, w["prompt"]
  lengths = rng.integers(w["low"], w["high"] + 1, b)
  n = int(lengths.max())
  tokens = rng.integers(3, args.vocab, (b, p + n))
  tokens[:, :p] = np.repeat(tokens[::args.group, :p], args.group, axis=0)
  valid = np.arange(p + n)[None, :] < (p + lengths)[:, None]
  tokens = jnp.asarray(np.where(valid, tokens, 0), jnp.int32)
  mask = jnp.asarray(valid[:, p:])
  zeros = jnp.zeros(mask.shape, jnp.float32)
  exp = Experience(tokens_BT=tokens, valid_BT=jnp.asarray(valid), completion_mask_BN=mask,
                   sampler_logprobs_BN=zeros, ref_logprobs_BN=zeros, old_logprobs_BN=zeros,
                   advantages_BN=jnp.asarray(rng.standard_normal(mask.shape) * mask, jnp.float32))
  return graphdef, params, exp, np.full(b, p), lengths


def programs(args, variant: str, graphdef, exp, prompt_lens, lengths):
  """(the experience the variant runs, its scoring and gradient programs, forward tokens)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxrl.algos.losses import aggregation_weights
  from jaxrl.config_rl import BatchingConfig, KLConfig, RLConfig, RolloutConfig
  from train.updates.packing import packed_logprobs, plan
  from train.updates.policy import policy_loss
  from train.updates.prefix import prefix_logprobs
  from train.updates.forward import completion_logprobs
  b, t = exp.tokens_BT.shape
  n = exp.completion_mask_BN.shape[1]
  p, g = t - n, args.group
  pack_length = p + g * n if variant == "tree" else 0
  cfg = RLConfig(prompts_per_step=args.prompts, group_size=g, kl=KLConfig(coef=0.0),
                 rollout=RolloutConfig(max_new_tokens=n),
                 batching=BatchingConfig(num_minibatches=1, pack_length=pack_length,
                                         share_prefix="off" if variant == "unshared" else "on"))
  tokens = b * t
  if variant == "tree":
    pack = plan(prompt_lens, lengths, prompt_width=p, completion_slots=n, pieces=1,
                length=pack_length, row_buckets=(args.prompts, b), group=g)
    exp = exp.replace(pack=jax.tree.map(jnp.asarray, pack))
    tokens = pack.packed_tokens
    score = lambda q, e: packed_logprobs(graphdef, q, e.tokens_BT, e.pack,  # noqa: E731
                                         e.completion_mask_BN, tree=True)[0]
  elif variant == "shared":
    tokens = b // g * p + b * n
    score = lambda q, e: prefix_logprobs(graphdef, q, e.tokens_BT, e.valid_BT, p, g)[0]  # noqa
  else:
    score = lambda q, e: completion_logprobs(graphdef, q, e.tokens_BT, e.valid_BT, p)[0]  # noqa
  weights = aggregation_weights("token_mean", exp.policy_mask_BN)
  grad = jax.grad(lambda q, e: policy_loss(q, (e, weights, weights), graphdef=graphdef,
                                           cfg=cfg)[0])
  return exp, jax.jit(score), jax.jit(grad), int(tokens) if np.isscalar(tokens) else tokens


def _flops(fn, *args) -> float:
  cost = fn.lower(*args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("flops", 0.0))


def _best(fn, args, rounds: int) -> float:
  import jax
  best = float("inf")
  for _ in range(rounds):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def measure(args) -> dict:
  import jax
  import numpy as np
  graphdef, params, exp, prompt_lens, lengths = batch(args)
  variants = args.variants.split(",")
  built = {v: programs(args, v, graphdef, exp, prompt_lens, lengths) for v in variants}
  out = {"workload": args.workload, "rows": int(exp.tokens_BT.shape[0]),
         "prompt_tokens": int(exp.prompt_len), "mean_response": float(lengths.mean())}
  want = None
  for v, (e, score, grad, tokens) in built.items():
    logp = np.asarray(jax.block_until_ready(score(params, e)))  # (compiles)
    jax.block_until_ready(grad(params, e))
    want = logp if want is None else want
    mask = np.asarray(exp.completion_mask_BN)
    out.update({f"{v}_forward_tokens": tokens,
                f"{v}_scoring_gflops": _flops(score, params, e) / 1e9,
                f"{v}_update_gflops": _flops(grad, params, e) / 1e9,
                f"{v}_max_abs_diff": float(np.abs(logp - want)[mask].max())})
  best = {f"{v}_{k}": float("inf") for v in variants for k in ("scoring_s", "update_s")}
  for _ in range(args.rounds):  # alternating: each variant's best of 2 calls a round
    for v, (e, score, grad, _) in built.items():
      best[f"{v}_scoring_s"] = min(best[f"{v}_scoring_s"], _best(score, (params, e), 2))
      best[f"{v}_update_s"] = min(best[f"{v}_update_s"], _best(grad, (params, e), 2))
  out.update(best)
  for v in variants[1:]:
    for k in ("scoring_s", "update_s"):
      out[f"{v}_{k[:-2]}_speedup"] = best[f"{variants[0]}_{k}"] / best[f"{v}_{k}"]
    out[f"{v}_tokens_ratio"] = out[f"{variants[0]}_forward_tokens"] / out[f"{v}_forward_tokens"]
    out[f"{v}_update_flops_ratio"] = (out[f"{variants[0]}_update_gflops"]
                                      / out[f"{v}_update_gflops"])
  return out


def main():
  args = _parse()
  retained = setup_host(args)
  emit({**measure(args), "retain_freed_memory": retained}, args.json)


if __name__ == "__main__":
  main()
