"""Sampler throughput against this machine's matmul peak, measured in the same process.

  python -m benchmarks.sampler --json              # batch 64 (the reference config)
  python -m benchmarks.sampler --json --batch 8
  python -m benchmarks.sampler --json --devices 1  # one device only
  python -m benchmarks.sampler --json --model 2048,16,16,8,8192,32000 --dtype bfloat16  # on a GPU
  python -m benchmarks.sampler --json --lengths longtail  # in-flight vs static batching
  python -m benchmarks.sampler --json --lengths longtail --stream 8  # partial rollouts' stream
  python -m benchmarks.sampler --json --stop-text  # the cost of stop strings matched on text

Reference config: vocab 256, d_model 256, 4 layers, 4 heads, 2 KV heads, MLP 1024, prompt 16,
64 new tokens, fp32, temperature 1, EOS ignored. FLOPs are counted as 2 x non-embedding
parameters per generated token. Decode runs as the sampler role does, data parallel over a mesh
of `--devices` devices (default on a CPU host: one device per core while each keeps >= 32 rows,
since below that a core spends its step streaming weights for too few rows; elsewhere 1). The
matmul peak is measured over the whole host (all cores) either way.

`--lengths longtail` (256 new tokens and 2 repeats unless `--new-tokens` / `--repeats` say
otherwise): `--prompts` prompts (512: the rollouts of one step of the default RL config, 64
prompts x 8 samples), each with its own response budget, drawn once with numpy's
`default_rng(0)` as `round(new_tokens / 4 * exp(normal(0, 1)))` clipped to [1, new_tokens] (a
lognormal with median new_tokens / 4: most responses short, ~8% at the budget, as reasoning
traces are). EOS is ignored, so each row's length is exactly its budget. The static engine
decodes the prompts in consecutive batches of `--batch` rows (each batch runs until its longest
row ends); the in-flight generator (sampler/inflight.py) decodes all of them in `--batch` row
slots. Useful tokens are the generated (non-padding) ones, the sum of the budgets; FLOPs count
those only. `greedy_identical`: both paths' greedy outputs are the same.

`--stream K` (with `--lengths longtail`): the prompts as K consecutive RL batches (of
prompts / K rows each). `inflight_batches` decodes each batch in its own in-flight call in
`--batch` slots, one after the other (what the async worker does without partial rollouts: a
batch's tail runs alone); `stream` decodes them as partial rollouts do (sampler/stream.py): the
same slots, two batches open at once, so the next batch's rows fill the slots the tail leaves,
with new weights installed after each batch leaves (the rows in flight continue with them).
Reported: rows per second of each and `stream_over_inflight_batches`.

`--stop-text` (fixed lengths): the same batch decoded without and with stop strings matched on
text (sampler/stops.py: `</python>`, `</calc>`, `</tool_call>` over a vocabulary of random
printable pieces of geometric lengths, seeded), alternately; `stop_text_over_plain` is the
plain decode's seconds over the one with the automaton (1.0: free). The strings practically
never occur in random text, so both decode the same number of tokens.
"""
from __future__ import annotations

import argparse
import os

from benchmarks.common import add_host_flags, best_seconds, emit, matmul_flops_per_s, setup_host
from sharding.host import force_cpu_devices


def _parse():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true", help="print only the JSON line")
  parser.add_argument("--lengths", choices=("fixed", "longtail"), default="fixed",
                      help="fixed: every row generates --new-tokens; longtail: see the docstring")
  parser.add_argument("--batch", type=int, default=64, help="rows per batch (longtail: slots)")
  parser.add_argument("--prompts", type=int, default=512, help="longtail: number of prompts")
  parser.add_argument("--prompt-len", type=int, default=16)
  parser.add_argument("--new-tokens", type=int, default=0, help="0: 64 (fixed), 256 (longtail)")
  parser.add_argument("--repeats", type=int, default=0, help="0: 5 (fixed), 2 (longtail)")
  parser.add_argument("--stream", type=int, default=0,
                      help="longtail: also decode the prompts as this many RL batches, "
                      "batch by batch and as a stream (partial rollouts)")
  parser.add_argument("--stop-text", action="store_true",
                      help="fixed: also decode with stop strings matched on text, alternately")
  parser.add_argument("--tensor", type=int, default=1, help="tensor-parallel degree")
  parser.add_argument(
      "--devices", type=int, default=0,
      help="decode devices (0: one per CPU core with >= 32 rows each on a CPU host)")
  parser.add_argument(
      "--model", default="256,4,4,2,1024,256",
      help="d_model,layers,heads,kv_heads,mlp,vocab (default: the reference config)")
  parser.add_argument("--dtype", default="float32", help="compute dtype: float32 or bfloat16")
  parser.add_argument("--scan-layers", default="auto", help="model.layers.scan: auto (unrolled "
                      "on a CPU), true or false")
  parser.add_argument("--layout", default="auto", help="decode activation layout: auto, "
                      "features or rows (SamplingConfig.decode_layout)")
  add_host_flags(parser)
  args = parser.parse_args()
  fixed = args.lengths == "fixed"
  args.new_tokens = args.new_tokens or (64 if fixed else 256)
  args.repeats = args.repeats or (5 if fixed else 2)
  return parser, args


def _alternately(runs: dict, repeats: int) -> dict:
  """Each run's best seconds over `repeats` rounds, the runs in turn within a round (so that a
  change in the machine's load hits every one); the first round compiles."""
  seconds = {name: best_seconds(run, repeats=1) for name, run in runs.items()}
  for _ in range(repeats - 1):
    seconds = {name: min(seconds[name], best_seconds(run, repeats=1, warmup=0))
               for name, run in runs.items()}
  return seconds


def longtail_budgets(prompts: int, new_tokens: int):
  """Per-prompt response budgets (the docstring's lognormal)."""
  import numpy as np
  draw = np.exp(np.random.default_rng(0).normal(0.0, 1.0, prompts))
  return np.clip(np.round(new_tokens / 4 * draw), 1, new_tokens).astype(np.int32)


def _paths(graphdef, cfg, batch: int, mesh, shardings) -> dict:
  """`fn(params, tokens_BP, valid_BP, key, budget_B)` per path: the static engine over
  consecutive batches of `batch` rows (concatenated), and in-flight batching in `batch` slots."""
  import jax
  import jax.numpy as jnp

  from sampler.sampler import Sampler
  static = Sampler(graphdef, cfg, mesh=mesh, param_shardings=shardings)

  def batches(params, tokens_BP, valid_BP, key, budget_B):
    parts = [static.generate(params, tokens_BP[i:i + batch], valid_BP[i:i + batch],
                             jax.random.fold_in(key, i), budget_B[i:i + batch])
             for i in range(0, tokens_BP.shape[0], batch)]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)
  inflight = Sampler(graphdef, cfg, mesh=mesh, param_shardings=shardings, inflight_slots=batch)
  return {"static": batches, "inflight": inflight.generate}


def _longtail(args, graphdef, params, sample_cfg, mesh, shardings, vocab: int):
  """Static batches vs in-flight slots on the long-tailed budgets: timings and greedy parity;
  returns the result and the useful tokens."""
  import dataclasses

  import jax
  import jax.numpy as jnp
  import numpy as np

  budget_B = longtail_budgets(args.prompts, args.new_tokens)
  tokens_BP = jax.random.randint(jax.random.key(1), (args.prompts, args.prompt_len), 1, vocab)
  valid_BP = jnp.ones((args.prompts, args.prompt_len), bool)
  inputs = (params, tokens_BP, valid_BP, jax.random.key(2), jnp.asarray(budget_B))
  greedy = {name: jax.device_get(fn(*inputs)) for name, fn in _paths(
      graphdef, dataclasses.replace(sample_cfg, method="greedy"), args.batch, mesh,
      shardings).items()}
  assert all((g.lengths_B == budget_B).all() for g in greedy.values())  # EOS ignored
  paths = _paths(graphdef, sample_cfg, args.batch, mesh, shardings)
  runs = {name: lambda fn=fn: jax.block_until_ready(fn(*inputs)) for name, fn in paths.items()}
  seconds = _alternately(runs, args.repeats)
  useful = int(budget_B.sum())
  same = np.array_equal(greedy["static"].tokens_BT, greedy["inflight"].tokens_BT)
  return {"useful_tokens_per_s": round(useful / seconds["inflight"], 1),
          "static_useful_tokens_per_s": round(useful / seconds["static"], 1),
          "speedup_over_static": round(seconds["static"] / seconds["inflight"], 3),
          "greedy_identical": bool(same), "prompts": args.prompts, "slots": args.batch,
          "useful_tokens": useful, "mean_len": round(float(budget_B.mean()), 1),
          "at_budget": int((budget_B == args.new_tokens).sum()), "seconds": seconds["inflight"],
          "static_seconds": round(seconds["static"], 4)}, useful


def _stream_paths(args, graphdef, cfg, mesh, shardings, params):
  """`run(tokens_BP, valid_BP, budget_B) -> rows decoded` per path, over `args.stream` batches:
  one in-flight call per batch, and the partial rollouts' stream."""
  import jax
  import numpy as np

  from sampler.sampler import Sampler
  from sampler.stream import StreamGeometry
  sampler = Sampler(graphdef, cfg, mesh=mesh, param_shardings=shardings,
                    inflight_slots=args.batch)
  rows = args.prompts // args.stream
  other = jax.tree.map(lambda x: x * 1.0, params)  # a second copy: a real swap each batch

  def batch_by_batch(tokens_BP, valid_BP, budget_B):
    for i in range(0, rows * args.stream, rows):
      jax.block_until_ready(sampler.generate(params, tokens_BP[i:i + rows], valid_BP[i:i + rows],
                                             jax.random.key(i), budget_B[i:i + rows]))
    return rows * args.stream

  s = sampler.stream(params, StreamGeometry(slots=args.batch, rows=rows * sampler.n, live=2,
                                            prompt_width=args.prompt_len,
                                            max_new_tokens=cfg.max_new_tokens))

  def stream(tokens_BP, valid_BP, budget_B):  # batches first, .. first + K - 1 of the stream
    tokens_BP, valid_BP = np.asarray(tokens_BP), np.asarray(valid_BP)
    first, end = s.next_index, s.next_index + args.stream
    while s.next_emit < end:
      for _ in s.poll():
        s.swap(other if s.next_emit % 2 else params, s.next_emit)
      while s.next_index < end and s.free > s.unadmitted and s.open_batches < 2:
        i = (s.next_index - first) * rows
        s.open({"prompt_tokens": tokens_BP[i:i + rows], "prompt_valid": valid_BP[i:i + rows],
                "max_new": budget_B[i:i + rows]}, np.array([0, s.next_index], np.uint32))
      if s.unadmitted and s.free:
        s.admit()
      if s.decoding:
        s.decode()
    return rows * args.stream
  return {"inflight_batches": batch_by_batch, "stream": stream}


def _stream(args, graphdef, params, sample_cfg, mesh, shardings, vocab: int) -> dict:
  import jax
  import jax.numpy as jnp

  budget_B = longtail_budgets(args.prompts, args.new_tokens)
  tokens_BP = jax.random.randint(jax.random.key(1), (args.prompts, args.prompt_len), 1, vocab)
  valid_BP = jnp.ones((args.prompts, args.prompt_len), bool)
  paths = _stream_paths(args, graphdef, sample_cfg, mesh, shardings, params)
  runs = {name: lambda fn=fn: fn(tokens_BP, valid_BP, budget_B) for name, fn in paths.items()}
  seconds = _alternately(runs, args.repeats)
  rows = args.prompts // args.stream * args.stream
  return {"stream_batches": args.stream,
          "inflight_batches_rows_per_s": round(rows / seconds["inflight_batches"], 1),
          "stream_rows_per_s": round(rows / seconds["stream"], 1),
          "stream_over_inflight_batches": round(seconds["inflight_batches"] / seconds["stream"], 3)}


def _fixed(args, fn, params, vocab: int):
  """The static engine on one batch of fixed-length rows; returns the result and the tokens."""
  import jax
  import jax.numpy as jnp
  tokens_BP = jax.random.randint(jax.random.key(1), (args.batch, args.prompt_len), 1, vocab)
  valid_BP = jnp.ones((args.batch, args.prompt_len), bool)
  seconds = best_seconds(
      lambda: jax.block_until_ready(fn(params, tokens_BP, valid_BP, jax.random.key(2))),
      repeats=args.repeats)
  tokens = args.batch * args.new_tokens
  return {"tokens_per_s": round(tokens / seconds, 1), "batch": args.batch,
          "seconds": seconds}, tokens


def _stop_text(args, graphdef, sample_cfg, mesh, shardings, params, vocab: int) -> dict:
  """Plain decode against decode with stop strings on text, alternately (the docstring)."""
  import dataclasses

  import jax
  import jax.numpy as jnp
  import numpy as np

  from sampler.sampler import Sampler
  from sampler.stops import StopText
  rng = np.random.default_rng(0)
  pieces = [bytes(rng.integers(32, 127, n).astype(np.uint8))
            for n in np.minimum(rng.geometric(0.2, vocab), 32)]
  stop = StopText(["</python>", "</calc>", "</tool_call>"], pieces)
  tokens_BP = jax.random.randint(jax.random.key(1), (args.batch, args.prompt_len), 1, vocab)
  valid_BP = jnp.ones((args.batch, args.prompt_len), bool)
  runs = {name: (lambda s=Sampler(graphdef, c, mesh=mesh, param_shardings=shardings):
                 jax.block_until_ready(s.generate(params, tokens_BP, valid_BP, jax.random.key(2))))
          for name, c in (("plain", sample_cfg),
                          ("stop_text", dataclasses.replace(sample_cfg, stop_text=stop)))}
  seconds = _alternately(runs, args.repeats)
  lengths = int(runs["stop_text"]().lengths_B.sum())
  return {"stop_text_over_plain": round(seconds["plain"] / seconds["stop_text"], 3),
          "stop_text_seconds": round(seconds["stop_text"], 4),
          "stop_text_tokens": lengths, "stop_text_classes": int(stop.next_SC.shape[1])}


def main() -> None:
  parser, args = _parse()
  retained = setup_host(args)
  cpu_devices = args.devices or max(1, min(len(os.sched_getaffinity(0)), args.batch // 32))
  force_cpu_devices(cpu_devices)  # only affects the CPU backend

  import jax
  from flax import nnx

  from jaxrl.models.config import LayersConfig, ModelConfig
  from jaxrl.models.transformer import LanguageModel
  from sampler.methods import SamplingConfig
  from sampler.sampler import Sampler
  from sharding.mesh import make_mesh, param_shardings
  from sharding.rules import SAMPLER_RULES

  try:
    d, layers, heads, kv_heads, mlp, vocab = (int(x) for x in args.model.split(","))
    cfg = ModelConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads,
                      n_kv_heads=kv_heads, head_dim=d // heads, d_ff=mlp, tie_embeddings=True,
                      dtype=args.dtype, layers=LayersConfig(scan=args.scan_layers))
  except ValueError as e:
    parser.error(f"--model {args.model!r} / --dtype {args.dtype!r} / --scan-layers: {e}")
  graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  sample_cfg = SamplingConfig(max_new_tokens=args.new_tokens, eos_id=0, pad_id=0,
                              method="temperature", temperature=1.0, ignore_eos=True,
                              decode_layout=args.layout)
  devices = args.devices or (cpu_devices if jax.default_backend() == "cpu" else 1)
  rows = args.batch if args.lengths == "fixed" else args.prompts
  if args.batch % devices or rows % devices or devices % args.tensor:
    parser.error(f"--devices {devices}: must divide --batch {args.batch} (and --prompts) and be "
                 f"a multiple of --tensor {args.tensor}")
  mesh = make_mesh({"data": devices // args.tensor, "tensor": args.tensor}, jax.devices()[:devices])
  shardings = param_shardings(params, SAMPLER_RULES, mesh)
  params = jax.device_put(params, shardings)
  if args.lengths == "fixed":
    sampler = Sampler(graphdef, sample_cfg, mesh=mesh, param_shardings=shardings)
    result, tokens = _fixed(args, sampler.generate, params, vocab)
    if args.stop_text:
      result.update(_stop_text(args, graphdef, sample_cfg, mesh, shardings, params, vocab))
  else:
    result, tokens = _longtail(args, graphdef, params, sample_cfg, mesh, shardings, vocab)
    if args.stream:
      result.update(_stream(args, graphdef, params, sample_cfg, mesh, shardings, vocab))
  non_embedding = sum(x.size for x in jax.tree.leaves(params)) - cfg.vocab_size * cfg.d_model
  flops_per_s = 2 * non_embedding * tokens / result["seconds"]
  peak = matmul_flops_per_s(dtype=args.dtype)
  emit({**result, "devices": devices, "retain_freed_memory": retained, "layout": args.layout,
        "scanned": cfg.scanned, "model": args.model, "dtype": args.dtype, "lengths": args.lengths,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "flops_per_s": round(flops_per_s), "matmul_flops_per_s": round(peak),
        "ratio_to_matmul_peak": round(flops_per_s / peak, 3),
        "seconds": round(result["seconds"], 4), "device": jax.devices()[0].device_kind}, args.json)


if __name__ == "__main__":
  main()
