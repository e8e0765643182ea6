"""Where the sampler's log-probs and the trainer's part: one source at a time.

  python -m benchmarks.logprob_mismatch --json

A random dense model (`--d_model`, `--layers`, vocabulary 512) samples `--rows` rows of
`--new_tokens` tokens with the engine on one device (sampler/engine.py: a prefill, then one
decode step per token over a KV cache). The trainer's pass (train/updates/forward.py: one
forward over the whole sequence, the LM head in chunks) then scores the same tokens, and so do
variants of it that each change one thing the two sides do differently:

  sampler     the trainer's pass against the sampler's recorded log-probs (all sources)
  rows        one row at a time against all rows at once (a matmul's row count: a decode step
              multiplies B rows, the trainer B x T)
  length      the sequence right-padded by `--pad` invalid slots against as it is (attention's
              reduction over more keys: a cache's S slots against the causal T)
  head        the full-vocabulary head against the trainer's chunked one
  rules       the trainer's pass as the trainer jits it (on a mesh of one device, under the
              train rules' activation constraints) against a plain jit
  fsdp        that pass on an fsdp mesh of 4 devices against the mesh of one
  tensor      that pass on a data 2 x tensor 2 mesh against the mesh of one (the sampler's
              layout: the all-reduce of a partial sum)
  f32_one     the pass on one device against the same weights' float32 pass (the compute
              dtype's own error; 0 in float32)
  f32_mesh    the pass on the fsdp mesh of 4 against the same float32 pass
  decode_rows the sampler decoding in the "rows" layout (as off the CPU) against the trainer's
              pass, where `sampler` decodes in the CPU's "features" layout
  depth       `sampler` for the same model cut to 1, 2, ... of its layers (each depth's own
              samples): where along the stack the two sides first part, and how it grows
  grad        the log-probs a gradient program computes (the update's forward: value_and_grad
              of their sum) against the scoring pass's (the trainer's pi_old)
  trainer_decode  each token's log-prob from the trainer's pass over the sequence as a decode
              step would hold it (the tokens up to it, the later slots empty and masked)
              against the pass over the whole sequence: what decoding by the trainer's own
              forward would report; `trainer_decode_cost`: the wall time of those passes (one
              per new token, compiled once) over the engine's generation, in this process
  decode_replay  the other way round: the trainer scoring in the sampler's shapes. The decode
              loop of `rl.rollout.exact="replay"` (train/updates/replay.py: a prefill, then a
              `lax.scan` of one-token steps over a KV cache, the rows layout) draws the tokens;
              the same loop fed those tokens (teacher-forced) inside a gradient program (the
              update's kind) gives their log-probs; `decode_replay_cost`: that gradient
              program's wall time over the whole-sequence pass's gradient, in this process

Per dtype (float32, bfloat16), each is the largest |log-prob difference| over the completion
tokens and the share of those tokens whose log-probs are bitwise equal. A source whose max is 0
does not contribute on this machine; `sampler` is what `mismatch_max` reports in a run.

`--no_excess_precision` compiles every program with XLA's `--xla_allow_excess_precision=false`:
by default XLA may keep a bfloat16 program's intermediates in float32 where no collective or
other boundary forces the rounding, which a program split over a mesh does at other places than
one device's.
"""
from __future__ import annotations

import argparse
import math
import os


def _gap(a, b, mask) -> dict:
  import numpy as np
  a, b, mask = np.asarray(a, np.float32), np.asarray(b, np.float32), np.asarray(mask, bool)
  return {"max": float(np.abs(a - b)[mask].max(initial=0.0)),
          "bitwise_frac": float((a == b)[mask].mean())}


def _on_mesh(make, shape: dict, params, score, *args):
  """`score(graphdef, params, *args)` with the parameters laid out by the train rules on a
  mesh of `shape` (activations constrained by the same rules)."""
  import jax

  from sharding.mesh import make_mesh
  from sharding.rules import TRAIN_RULES
  from train.roles.role import ModelRole
  mesh = make_mesh(shape, jax.devices()[:math.prod(shape.values())])
  role = ModelRole("model", make, mesh, TRAIN_RULES)
  placed = jax.device_put(params, role.shardings)
  return role.jit(lambda p, *a: score(role.graphdef, p, *a))(placed, *args)


def _sampled(cfg, args, layout: str = "auto"):
  """(graphdef, params, the engine's rollout, prompt length): `cfg`'s random model sampling
  `args.rows` rows of `args.new_tokens` tokens on one device, decoding in `layout`."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jaxrl.models.transformer import LanguageModel
  from sampler.engine import generate
  from sampler.methods import SamplingConfig
  graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  p = 16
  prompts_BP = jax.random.randint(jax.random.key(1), (args.rows, p), 3, cfg.vocab_size)
  sampling = SamplingConfig(max_new_tokens=args.new_tokens, eos_id=1, pad_id=0, ignore_eos=True,
                            method="temperature", temperature=1.0, decode_layout=layout)
  r = jax.jit(lambda q, t, v, k: generate(graphdef, q, t, v, k, cfg=sampling))(
      params, prompts_BP, jnp.ones(prompts_BP.shape, bool), jax.random.key(2))
  return graphdef, params, r, p


def _sampler_gap(cfg, args, layout: str = "auto") -> dict:
  """The trainer's pass against the sampler's log-probs, `cfg`'s model decoding in `layout`."""
  import jax

  from train.updates.forward import completion_logprobs
  graphdef, params, r, p = _sampled(cfg, args, layout)
  score = jax.jit(lambda g, q, t, v: completion_logprobs(g, q, t, v, p)[0], static_argnums=0)
  return _gap(score(graphdef, params, r.tokens_BT, r.valid_BT), r.logprobs_BN,
              r.completion_mask_BN)


def _with_grad(score):
  """`score`'s log-probs as a gradient program computes them (aux of value_and_grad)."""
  import jax

  def fn(g, q, t, v):
    return jax.value_and_grad(lambda q: (lambda lp: (lp.sum(), lp))(score(g, q, t, v)),
                              has_aux=True)(q)[0][1]
  return jax.jit(fn, static_argnums=0)


def _trainer_decode(trainer, graphdef, params, r, p: int) -> tuple:
  """(each completion token's log-prob from the trainer's pass over the tokens up to it, the
  later slots empty and masked; the seconds those passes took, after a compiling one)."""
  import time

  import jax
  import jax.numpy as jnp
  n, t = r.completion_mask_BN.shape[1], r.tokens_BT.shape[1]

  def upto(i):
    keep = jnp.arange(t) <= p + i
    return (jnp.where(keep, r.tokens_BT, 0), r.valid_BT & keep)
  jax.block_until_ready(trainer(graphdef, params, *upto(0)))
  t0, cols = time.perf_counter(), []
  for i in range(n):
    cols.append(trainer(graphdef, params, *upto(i))[:, i])
  out = jax.block_until_ready(jnp.stack(cols, axis=1))
  return out, time.perf_counter() - t0


def _generation_seconds(cfg, args) -> float:
  """The engine's generation of `_sampled`'s rows, compiled, best of 3."""
  import time

  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jaxrl.models.transformer import LanguageModel
  from sampler.engine import generate
  from sampler.methods import SamplingConfig
  graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  prompts_BP = jax.random.randint(jax.random.key(1), (args.rows, 16), 3, cfg.vocab_size)
  sampling = SamplingConfig(max_new_tokens=args.new_tokens, eos_id=1, pad_id=0, ignore_eos=True,
                            method="temperature", temperature=1.0)
  gen = jax.jit(lambda q, t, v, k: generate(graphdef, q, t, v, k, cfg=sampling))
  run = lambda: jax.block_until_ready(gen(params, prompts_BP, jnp.ones(prompts_BP.shape, bool),  # noqa
                                          jax.random.key(2)))
  run()
  best = float("inf")
  for _ in range(3):
    t0 = time.perf_counter()
    run()
    best = min(best, time.perf_counter() - t0)
  return best


def _decode_replay(graphdef, params, r, p: int) -> tuple:
  """(the decode loop's drawn log-probs against its replay's in a gradient program; that
  gradient's seconds over the whole-sequence pass's gradient's): train/updates/replay.py
  `decode_loop`, its own gradient (not the whole pass's, on which `ride` puts the values)."""
  import time

  import jax
  import jax.numpy as jnp

  from train.updates.forward import completion_logprobs
  from train.updates.replay import decode_loop

  def gumbel_max(key):  # (temperature 1; no row ends: every slot drawn)
    return lambda logp_BV, i, done_B: (jnp.argmax(logp_BV + jax.random.gumbel(
        jax.random.fold_in(key, i), logp_BV.shape), -1).astype(jnp.int32), done_B)
  loop = lambda q, t, v, **kw: decode_loop(graphdef, q, t, v, prompt_len=p,  # noqa: E731
                                           temperature=1.0, **kw)
  draw = jax.jit(lambda q, t, v, k: loop(q, t, v, draw=gumbel_max(k)))
  tokens_BT, _, drawn, _ = draw(params, r.tokens_BT, r.valid_BT, jax.random.key(3))
  replay = lambda q, t, v: loop(q, t, v)[2]  # noqa: E731
  whole = lambda q, t, v: completion_logprobs(graphdef, q, t, v, p)[0]  # noqa: E731
  grads = [jax.jit(lambda q, t, v, f=f: jax.value_and_grad(
      lambda q: (lambda lp: (lp.sum(), lp))(f(q, t, v)), has_aux=True)(q)) for f in (replay, whole)]
  seconds = []
  for g in grads:
    jax.block_until_ready(g(params, tokens_BT, r.valid_BT))
    t0 = time.perf_counter()
    for _ in range(3):
      jax.block_until_ready(g(params, tokens_BT, r.valid_BT))
    seconds.append(time.perf_counter() - t0)
  (_, replayed), _ = grads[0](params, tokens_BT, r.valid_BT)
  return _gap(replayed, drawn, r.completion_mask_BN), seconds[0] / seconds[1]


def measure(dtype: str, args) -> dict:
  import dataclasses

  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from jaxrl.models.config import ModelConfig
  from jaxrl.models.lm_head import dense_logprobs
  from jaxrl.models.rope import positions_from_valid
  from jaxrl.models.transformer import LanguageModel
  from train.updates.forward import completion_logprobs
  from train.updates.state import model_of

  cfg = ModelConfig(vocab_size=512, d_model=args.d_model, n_layers=args.layers, n_heads=4,
                    n_kv_heads=2, head_dim=args.d_model // 4, d_ff=4 * args.d_model,
                    dtype=dtype)
  make = lambda: LanguageModel(cfg, rngs=nnx.Rngs(0))  # noqa: E731
  graphdef, params, r, p = _sampled(cfg, args)
  mask = r.completion_mask_BN
  score = lambda g, q, t, v: completion_logprobs(g, q, t, v, p)[0]  # noqa: E731
  trainer = jax.jit(score, static_argnums=0)
  base = trainer(graphdef, params, r.tokens_BT, r.valid_BT)
  one_by_one = np.concatenate([trainer(graphdef, params, r.tokens_BT[i:i + 1],
                                       r.valid_BT[i:i + 1]) for i in range(args.rows)])
  pad = lambda x, value: jnp.pad(x, ((0, 0), (0, args.pad)), constant_values=value)  # noqa
  n = base.shape[1]
  padded = trainer(graphdef, params, pad(r.tokens_BT, 0), pad(r.valid_BT, False))[:, :n]

  def dense(g, q, t, v):
    model = model_of(g, q)
    h, _, _ = model.decoder.forward(t, positions_from_valid(v), v)
    return dense_logprobs(h[:, p - 1:-1], model.head_VD(), t[:, p:],
                          softcap=cfg.logit_softcap)[0]
  head = jax.jit(dense, static_argnums=0)(graphdef, params, r.tokens_BT, r.valid_BT)
  meshes = {name: _on_mesh(make, shape, params, score, r.tokens_BT, r.valid_BT) for name, shape
            in (("one", {"fsdp": 1}), ("fsdp", {"fsdp": 4}), ("tensor", {"data": 2, "tensor": 2}))}
  grad = _with_grad(score)(graphdef, params, r.tokens_BT, r.valid_BT)
  decoded, decode_s = _trainer_decode(trainer, graphdef, params, r, p)
  replayed, replay_cost = _decode_replay(graphdef, params, r, p)
  g32 = nnx.split(LanguageModel(dataclasses.replace(cfg, dtype="float32"), rngs=nnx.Rngs(0)))[0]
  f32 = trainer(g32, params, r.tokens_BT, r.valid_BT)
  return {"sampler": _gap(base, r.logprobs_BN, mask), "rows": _gap(one_by_one, base, mask),
          "length": _gap(padded, base, mask), "head": _gap(head, base, mask),
          "rules": _gap(meshes["one"], base, mask),
          **{k: _gap(meshes[k], meshes["one"], mask) for k in ("fsdp", "tensor")},
          "f32_one": _gap(base, f32, mask), "f32_mesh": _gap(meshes["fsdp"], f32, mask),
          "decode_rows": _sampler_gap(cfg, args, "rows"),
          "depth": [_sampler_gap(dataclasses.replace(cfg, n_layers=d), args)
                    for d in range(1, cfg.n_layers + 1)],
          "grad": _gap(grad, base, mask), "trainer_decode": _gap(decoded, base, mask),
          "trainer_decode_cost": decode_s / _generation_seconds(cfg, args),
          "decode_replay": replayed, "decode_replay_cost": replay_cost}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--d_model", type=int, default=128)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--pad", type=int, default=24)
  parser.add_argument("--no_excess_precision", action="store_true",
                      help="XLA rounds every bfloat16 intermediate as the program says")
  parser.add_argument("--json", action="store_true")
  args = parser.parse_args(argv)
  if "XLA_FLAGS" not in os.environ:  # (the meshes need 4 devices on the CPU)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  if args.no_excess_precision:  # (read as JAX starts its backend)
    os.environ["XLA_FLAGS"] += " --xla_allow_excess_precision=false"
  import jax

  from benchmarks.common import emit
  result = {"device": jax.devices()[0].device_kind, "rows": args.rows,
            "new_tokens": args.new_tokens, "excess_precision": not args.no_excess_precision,
            **{dtype: measure(dtype, args) for dtype in ("float32", "bfloat16")}}
  emit(result, args.json)
  return result


if __name__ == "__main__":
  main()
