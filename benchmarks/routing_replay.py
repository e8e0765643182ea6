"""Routing replay on a tiny mixture of experts: how far the trainer's log-probs and expert
choices are from the sampler's, with and without replaying the sampler's routing.

  python -m benchmarks.routing_replay --json

A random Qwen3-MoE-shaped model (4 layers, 32 experts, 4 per token) samples `--rows` rows of
`--new_tokens` tokens with the engine (sampler/engine.py: a prefill and a decode loop, which
records each token's experts); then the trainer's forward (train/updates/forward.py: one pass
over the whole sequence) scores the same tokens, routing by itself
(`model.moe.routing_replay="off"`) and replaying the recorded experts ("rollout"). Per dtype (float32, bfloat16): the mismatch
|log mu - log pi| over the completion tokens (mean and max; jaxrl/algos/correction.mismatch) and
the share of (token, layer) routings whose top-k set differs between sampler and trainer.
"""
from __future__ import annotations

import argparse


def measure(dtype: str, args) -> dict:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jaxrl.algos.correction import mismatch
  from jaxrl.models.config import ModelConfig, MoEConfig, from_fields
  from jaxrl.models.transformer import LanguageModel
  from sampler.engine import generate
  from sampler.methods import SamplingConfig
  from train.updates.forward import routed_logprobs

  cfg = ModelConfig(family="qwen3_moe", vocab_size=512, d_model=128, n_layers=4, n_heads=4,
                    n_kv_heads=2, head_dim=32, d_ff=256, dtype=dtype,
                    moe=MoEConfig(experts=32, per_token=4, d_ff=64, norm_topk=True))
  graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  prompts_BP = jax.random.randint(jax.random.key(1), (args.rows, 16), 3, cfg.vocab_size)
  sampling = SamplingConfig(max_new_tokens=args.new_tokens, eos_id=1, pad_id=0, ignore_eos=True)
  rollout = jax.jit(lambda p, t, v, k: generate(graphdef, p, t, v, k, cfg=sampling))(
      params, prompts_BP, jnp.ones(prompts_BP.shape, bool), jax.random.key(2))
  out = {}
  for replay in ("off", "rollout"):
    g = nnx.split(LanguageModel(from_fields({"moe.routing_replay": replay}, base=cfg),
                                rngs=nnx.Rngs(0)))[0]
    score = jax.jit(lambda p, r: routed_logprobs(g, p, r.tokens_BT, r.valid_BT, start=15,
                                                 routes_BTLK=r.routes_BTLK))
    logp_BN, _, _, metrics = score(params, rollout)
    mask_BN = rollout.completion_mask_BN
    gap = mismatch(logp_BN, rollout.logprobs_BN, mask_BN, mask_BN / mask_BN.sum())
    # The sampler's own routing compared with this pass's own choice: with replay the pass
    # used the recorded experts, so `routing_differs` still counts where its router disagrees.
    out[f"replay_{replay}"] = {"mismatch_mean": float(gap["mismatch_mean"]),
                               "mismatch_max": float(gap["mismatch_max"]),
                               "routing_differs": float(metrics["routing_differs"])}
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--rows", type=int, default=32)
  parser.add_argument("--new_tokens", type=int, default=64)
  args = parser.parse_args()
  import jax

  from benchmarks.common import emit
  emit({**{dtype: measure(dtype, args) for dtype in ("float32", "bfloat16")},
        "rows": args.rows, "new_tokens": args.new_tokens,
        "device": jax.devices()[0].device_kind}, args.json)


if __name__ == "__main__":
  main()
