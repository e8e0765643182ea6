"""Multi-turn RL steps with the KV cache kept across turns (`keep`) against each turn prefilling
its whole conversation (`prefill`: `rl.environment.keep_turn_cache=False`), alternately in one
process.

  python -m benchmarks.multiturn --json                          # synthetic: 8 turns
  python -m benchmarks.multiturn --json --workload gsm8k_tools   # the calculator after its SFT

Workloads (sync, colocated on one device, a fresh policy unless SFT runs first):
  synthetic    `rl.environment.name=synthetic` (jaxrl/envs/synthetic.py): 8 model turns of
               `--turn-tokens` (32) tokens each (`rl.rollout.ignore_eos`), each answered by the same
               100-token reply; the w1 model (vocab 264, d_model 256, 4 layers), 16-token
               prompts, 4 prompts x 4 samples: 956-token conversations.
  gsm8k_tools  configs/gsm8k_tools.py (the calculator: replies of a few tokens, 2-4 turns),
               after `--sft-steps` (400) steps of its SFT, 8 prompts x 4 samples.
  --scale full (the default on an accelerator) runs synthetic on Qwen2.5-0.5B's shape (random,
  bf16) with 64-token prompts, 8 prompts x 8 samples.

`--partial` compares instead multi-turn partial rollouts (`rl.schedule.partial_rollouts`:
conversations as requests that outlive weight swaps, train/rollout/conversations.py) with whole
batches, both async (`rl.schedule.max_staleness=1`) on `placement.strategy=separate` (one device
each for the trainer and the generator), on `synthetic_longtail` (the synthetic workload whose
conversations end after each turn with probability 1/4: 1-8 turns), in two measurements:
  generator   the rollouts alone, no trainer (one run, the weights fixed): `--batches` (6)
              batches generated whole, one after the other, against the same batches as one
              stream of conversations (up to 2 batches open); conversations/s and the model's
              tokens/s, alternating, medians of `--rounds`, after one untimed round each;
  steps       `--steps` (3) async RL steps after `--warmup`, a fresh run per variant and round,
              alternating: samples/s, seconds per step, the seconds a step waited for its
              rollout, and the mean token lag (`--steps 0`: not run).

`--slots K` sets `rl.rollout.inflight_slots` (default: as many slots as rows): with fewer slots than
conversations, kept caches are evicted for waiting conversations (`evicted`), whose next turn
prefills its whole context again.

Each round runs one RL step per variant, in alternating order, after `--warmup` (2) untimed
steps each (compiles: in-flight slots compile a prefill program per row count and width met).
Reported per variant, medians over `--rounds`: the step's seconds, the rollout's (the generate
stage), rollout tokens/s (the model's own tokens over the rollout seconds), and prefill tokens
per generated token (the prefills' padded [rows, width] sizes over the model's tokens); then
keep over prefill for each.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from benchmarks.common import emit
from benchmarks.rl_step import W1_MODEL, Workload, build_config, qwen_model, sig

VARIANTS = {"keep": True, "prefill": False}


def workload(name: str, args, full: bool) -> Workload:
  sync = {"strategy": "colocate", "cpu_devices": 1, "sampler_tensor": 1}
  if name == "gsm8k_tools":
    return Workload(1, {"sft": {"steps": args.sft_steps}, "placement": sync,
                        "rl": {"prompts_per_step": 8, "group_size": 4}}, modes=False)
  turns = 8
  model = dict(qwen_model("qwen0.5b")) if full else W1_MODEL
  prompts, samples, prompt_tokens = (8, 8, 64) if full else (4, 4, 16)
  rl = {"environment": {"name": "synthetic", "max_turns": turns,
                        "max_turn_tokens": args.turn_tokens},
        "rollout": {"ignore_eos": True,
                    "max_new_tokens": turns * args.turn_tokens + (turns - 1) * 100},
        "prompts_per_step": prompts, "group_size": samples,
        "batching": {"num_minibatches": 1}, "kl": {"coef": 0.0}}
  return Workload(1, {"model": model, "sft": {"steps": 0}, "placement": sync, "rl": rl,
                      "task": {"num_digits": prompt_tokens - 6},
                      "data": {"max_prompt_tokens": prompt_tokens}}, modes=False)


def partial_workload(args, full: bool) -> Workload:
  """`synthetic` on `synthetic_longtail`, async on separate devices."""
  from jaxrl.config_files import merge
  work = workload("synthetic", args, full)
  overrides = {**work.overrides, "placement": {"strategy": "separate", "cpu_devices": 2,
                                               "train_devices": 1, "sampler_tensor": 1}}
  overrides["rl"] = merge(overrides["rl"], {
      "environment": {"name": "synthetic_longtail"},
      "schedule": {"mode": "async", "max_staleness": 1, "name": "free"}})
  return Workload(2, overrides, modes=False)


def partial_run(raw: dict, partial: bool, steps: int, warmup: int) -> dict:
  """One run of `steps` timed async steps after `warmup`, with or without partial rollouts."""
  import copy

  from train.run import Experiment
  raw = copy.deepcopy(raw)
  raw["rl"]["schedule"]["partial_rollouts"] = partial
  raw["run_dir"] = tempfile.mkdtemp(prefix="jaxrl-bench-")
  with Experiment(raw) as exp:
    for _ in range(warmup):
      exp.rl.step()
    t0 = time.perf_counter()
    rows = [exp.rl.step() for _ in range(steps)]
    wall = time.perf_counter() - t0
  return {"samples_per_s": exp.cfg.rl.rollouts * steps / wall, "step_s": wall / steps,
          "waited_s": statistics.mean(r["time_generate"] for r in rows),
          "token_lag_mean": statistics.mean(r["token_lag_mean"] for r in rows)}


def generate_batches(exp, partial: bool, batches: int) -> dict:
  """`batches` prompt batches of conversations, whole or streamed: their speed."""
  import jax
  import numpy as np

  import dataclasses

  from train.rollout.generator import rollout_key
  from train.rollout.source import stream_geometry
  gen, task, rl = exp.ctx.generator, exp.ctx.task, exp.cfg.rl
  params = exp.ctx.cluster.sampler_weights.fresh()
  key = lambda i: rollout_key(exp.cfg.seed, i)
  start, rollouts = time.perf_counter(), []
  if not partial:
    rollouts = [jax.block_until_ready(gen.sample(params, task.prompts[i], key(i)))
                for i in range(batches)]
  else:
    # The stream the async run with partial rollouts builds (this run is sync: no generator
    # thread competes with the measured calls).
    schedule = dataclasses.replace(rl.schedule, mode="async", partial_rollouts=True)
    geometry = stream_geometry(dataclasses.replace(rl, schedule=schedule), task.prompt_len)
    stream = gen.stream(params, geometry)
    while len(rollouts) < batches:
      rollouts += [r for _, r in stream.poll()]
      while (stream.next_index < batches and stream.free > stream.unadmitted
             and stream.open_batches < geometry.live):
        stream.open(task.prompts[stream.next_index],
                    np.asarray(jax.random.key_data(key(stream.next_index))))
      stream.decode()
  seconds = time.perf_counter() - start
  tokens = sum(int(np.asarray(r.loss_mask_BN).sum()) for r in rollouts)
  return {"seconds": seconds, "conversations_per_s": batches * rl.rollouts / seconds,
          "tokens_per_s": tokens / seconds}


def measure_partial(raw: dict, rounds: int, warmup: int, steps: int, batches: int) -> dict:
  import copy

  from train.run import Experiment
  sync = copy.deepcopy(raw)
  sync["rl"]["schedule"].update(mode="sync", partial_rollouts=False)
  runs = {"whole": [], "partial": []}
  with Experiment(sync) as exp:
    for r in range(rounds + 1):  # round 0 compiles
      for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
        run = generate_batches(exp, name == "partial", batches)
        if r:
          runs[name].append(run)
  out = {"generator": _medians(runs)}
  if steps:
    runs = {"whole": [], "partial": []}
    for r in range(rounds):
      for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
        runs[name].append(partial_run(raw, name == "partial", steps, warmup))
    out["steps"] = _medians(runs)
  return {"rounds": rounds, "steps": steps, "batches": batches, **out}


def _medians(runs: dict) -> dict:
  out = {name: {k: sig(statistics.median(x[k] for x in rs)) for k in rs[0]}
         for name, rs in runs.items()}
  out["partial_over_whole"] = {k: sig(out["partial"][k] / out["whole"][k]) for k in out["whole"]
                               if k != "token_lag_mean"}
  return out


def timed_config(raw: dict, overrides: dict, steps: int) -> dict:
  """A config file's dict with `overrides`, set up for timing `steps` RL steps (a scratch run
  directory, no checkpoints, no evaluation before the end)."""
  from jaxrl.config_files import merge
  raw = merge(raw, overrides)
  raw.update(run_dir=tempfile.mkdtemp(prefix="jaxrl-bench-"), progress=False,
             checkpoint_every=10**6, checkpoint_minutes=0.0)
  raw["eval"]["every"] = 10**6
  raw["rl"]["steps"] = steps + 1
  return raw


def one_step(exp, keep: bool) -> dict:
  generator = exp.ctx.generator
  generator.turns["keep_cache"] = keep
  generator.multiturn.clear_stats()
  start = time.perf_counter()
  exp.rl.step()
  step_s = time.perf_counter() - start
  rollout_s = sum(exp.ctx.timeline.durations(start).get("generate", []))
  stats = generator.multiturn.stats()
  emitted = max(stats.get("emitted", 0), 1)
  return {"step_s": step_s, "rollout_s": rollout_s, "tokens_per_s": emitted / rollout_s,
          "prefill_per_token": stats.get("prefill_tokens", 0) / emitted, "emitted": emitted,
          "continued": stats.get("continued", 0), "evicted": stats.get("evicted", 0)}


def measure(raw: dict, rounds: int, warmup: int) -> dict:
  from train.run import Experiment
  with Experiment(raw) as exp:
    if "sft" in exp.stage_names:
      exp.stage("sft").run()
    for _ in range(warmup):  # compiles (in-flight slots: a prefill program per size met)
      for keep in VARIANTS.values():
        one_step(exp, keep)
    runs = {name: [] for name in VARIANTS}
    for r in range(rounds):
      for name in (list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]):
        runs[name].append(one_step(exp, VARIANTS[name]))
    device = str(exp.ctx.cluster.meshes["sampler"].devices.flat[0].device_kind)
  out = {name: {k: sig(statistics.median(r[k] for r in rs)) for k in rs[0]}
         for name, rs in runs.items()}
  keep, prefill = out["keep"], out["prefill"]
  out["keep_over_prefill"] = {k: sig(keep[k] / prefill[k]) for k in
                              ("step_s", "rollout_s", "tokens_per_s", "prefill_per_token")}
  return {"device": device, "rounds": rounds, **out}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--workload", choices=("synthetic", "gsm8k_tools"), default="synthetic")
  parser.add_argument("--scale", choices=("auto", "full", "reduced"), default="auto")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
  parser.add_argument("--turn-tokens", type=int, default=32)
  parser.add_argument("--slots", type=int, default=0,
                      help="rl.rollout.inflight_slots (0: as many as the rows); fewer: kept caches "
                           "are evicted for waiting conversations and prefilled again")
  parser.add_argument("--sft-steps", type=int, default=400)
  parser.add_argument("--partial", action="store_true",
                      help="partial rollouts against whole batches, async (synthetic_longtail)")
  parser.add_argument("--steps", type=int, default=3, help="timed steps per --partial run")
  parser.add_argument("--batches", type=int, default=6, help="batches per --partial generator run")
  args = parser.parse_args()
  if args.partial:
    from sharding.host import force_cpu_devices
    force_cpu_devices(2)
  import jax
  full = args.scale == "full" or (args.scale == "auto" and jax.default_backend() != "cpu")
  if args.partial:
    raw = build_config(partial_workload(args, full), steps=args.warmup + args.steps)
    rl = raw["rl"]
    rl["rollout"]["inflight_slots"] = args.slots or rl["prompts_per_step"] * rl["group_size"]
    emit({"workload": "synthetic_longtail", "scale": "full" if full else "reduced",
          "device": str(jax.devices()[0].device_kind),
          **measure_partial(raw, args.rounds, args.warmup, args.steps, args.batches)}, args.json)
    return
  if args.workload == "gsm8k_tools":
    from jaxrl.config_files import shipped
    gsm8k_tools = shipped("gsm8k_tools")
    raw = timed_config(gsm8k_tools.get_config().to_dict(),
                       workload("gsm8k_tools", args, full).overrides,
                       steps=2 * (args.rounds + args.warmup))
  else:
    raw = build_config(workload("synthetic", args, full), steps=2 * (args.rounds + args.warmup))
  raw["rl"]["rollout"]["inflight_slots"] = args.slots
  emit({"workload": args.workload, "scale": "full" if full else "reduced",
        **measure(raw, args.rounds, args.warmup)}, args.json)


if __name__ == "__main__":
  main()
