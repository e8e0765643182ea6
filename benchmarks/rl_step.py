"""The RL step, stage by stage: seconds, model FLOP utilization, decode against the memory
roofline, compile seconds and peak memory.

  python -m benchmarks.rl_step --json                       # the default experiment, + modes
  python -m benchmarks.rl_step --json --workload w1         # the 4-layer d_model-256 workload
  python -m benchmarks.rl_step --json --workload w1 --exact pass  # drawn by the trainer's pass
  python -m benchmarks.rl_step --json --workload w1 --inflight-slots 16 --exact replay
  python -m benchmarks.rl_step --json --workload qwen0.5b   # on a GPU: Qwen2.5-0.5B, gsm8k shapes
  python -m benchmarks.rl_step --json --workload qwen1.5b   # on a GPU: Qwen2.5-1.5B, gsm8k shapes

Workloads (`WORKLOADS`, `GSM8K_WORKLOADS`), each built by `train.run.Experiment` from a
fresh policy (so almost every response runs to max_new_tokens):
  default  the default experiment's RL stage (64 prompts x 8 samples, reverse task, 2 minibatches)
           in its own placement; `--modes` (on by default here) also runs it in sync-colocate,
           sync-separate and async-separate and reports samples/s, seconds per step and the
           bubble of each (`async_over_sync` = async-separate / sync-separate samples/s).
  w1       vocab 264, d_model 256, 4 layers, 4 heads / 2 KV heads, head_dim 64, MLP 1024, untied
           embeddings; reverse task with 30 letters (36-token prompts with BOS), 8 prompts x 8 samples,
           32 new tokens, KL to the reference, one minibatch accumulated over 8-row micro-batches
           (`--micro-batch-size` overrides); colocated on one CPU device.
  qwen0.5b, qwen1.5b
           a random model of Qwen2.5-0.5B's / -1.5B's shape (qkv biases, tied unscaled
           embeddings, vocab 151936, bf16 compute; no download) in the GSM8K recipe's step
           (configs/hf_gsm8k.py: 16 prompts x 8 samples, 512 new tokens, 8 minibatches, KL to the
           reference): 96-token prompts (BOS + the reverse task's 90 letters, a GSM8K question's
           length), every response forced to 512 tokens (`rl.rollout.ignore_eos`), colocated on one
           device. `--scale reduced` (automatic on a CPU) shrinks them to a smoke run: 2 layers,
           vocab 2048, a quarter of the widths, 16-token prompts, 2 prompts x 2 samples, 16 new
           tokens, 2 minibatches.
Per stage (generate, reward, reference, old_logprobs, update, weight_push): the mean seconds of
its calls on the timeline, its model FLOPs (jaxrl/models/flops.py: only the work the step needs;
a skipped pass counts zero), `flops_utilization` = FLOPs / (seconds x matmul peak) and
`compile_s`: the seconds the run summary records for its programs (train/io/compilation.py), or
where it records none, its first step's seconds minus a steady step's. The peak (roofline.py):
the device table's dense bf16 peak per device on an accelerator (times the devices), the matmul
peak measured in this process in the model's dtype on a CPU. `decode`: generated tokens per
second of the generate stage (its prefill included) and the fraction of the memory roofline
that is (the weights and KV cache each decode step must read / HBM bandwidth). `compile_s`: the
run summary's total (initialisation and the held-out evaluation included, `compile_by_label`),
else the stages' sum; `compile_source` says which. `peak_memory_bytes`: the device's peak on an
accelerator, the process's peak resident memory on a CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import resource
import time

from benchmarks.common import add_host_flags, emit, setup_host
from sharding.host import force_cpu_devices

MODES = {"sync-colocate": ("colocate", "sync"), "sync-separate": ("separate", "sync"),
         "async-separate": ("separate", "async")}
# Timeline labels (train/loop/controller.py) of each stage.
STAGE_LABELS = {"generate": ("generate",), "reward": ("score",), "reference": ("ref logprobs",),
                "old_logprobs": ("old logprobs",), "update": ("update",),
                "weight_push": ("reshard", "push")}


@dataclasses.dataclass(frozen=True)
class Workload:
  devices: int  # fake CPU devices
  overrides: dict  # config sections -> fields, over the default experiment
  modes: bool  # also compare the placements and modes
  reduced: dict = dataclasses.field(default_factory=dict)  # sections -> fields: the CPU size

  def sections(self, reduced: bool) -> dict:
    if not reduced:
      return self.overrides
    names = self.overrides.keys() | self.reduced.keys()
    return {s: {**self.overrides.get(s, {}), **self.reduced.get(s, {})} for s in names}


def reduced_model(model: dict) -> dict:
  """A CPU-sized stand-in: 2 layers, vocab 2048, a quarter of the head and MLP widths; the same
  heads, biases, tying and dtype."""
  head_dim = model["head_dim"] // 4
  return dict(model, n_layers=2, vocab_size=2048, head_dim=head_dim,
              d_model=model["n_heads"] * head_dim, d_ff=model["d_ff"] // 4)


W1_MODEL = dict(vocab_size=264, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64,
                d_ff=1024, tie_embeddings=False)
WORKLOADS = {
    "default": Workload(8, {}, modes=True),
    "w1": Workload(1, {"model": W1_MODEL, "task": {"num_digits": 30},
                       "data": {"max_prompt_tokens": 36},
                       "rl": {"prompts_per_step": 8, "group_size": 8,
                              "rollout": {"max_new_tokens": 32}, "kl": {"coef": 0.02},
                              "batching": {"num_minibatches": 1, "micro_batch_size": 8}},
                       "placement": {"strategy": "colocate", "cpu_devices": 1,
                                     "sampler_tensor": 1}}, modes=False),
}
# Built on demand (`find_workload`): their shapes come from configs/, whose imports start JAX, which
# must not happen before the fake CPU devices are set.
GSM8K_WORKLOADS = ("qwen0.5b", "qwen1.5b")


def qwen_model(name: str) -> dict:
  from jaxrl.config_files import shipped
  QWEN2_5_0_5B = shipped("qwen2_5_0_5b_gsm8k").QWEN2_5_0_5B
  if name == "qwen0.5b":
    return QWEN2_5_0_5B
  # Qwen2.5-1.5B's config.json: the 0.5B's vocabulary, RoPE, norms, biases and tying.
  return dict(QWEN2_5_0_5B, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
              d_ff=8960)


def gsm8k_workload(name: str) -> Workload:
  """The GSM8K recipe's RL step on a random model of `name`'s shape, colocated on one device."""
  from jaxrl.config_files import shipped
  hf_gsm8k = shipped("hf_gsm8k")
  recipe = hf_gsm8k.config(model={}, placement={}).rl
  rl = {"prompts_per_step": recipe.prompts_per_step, "group_size": recipe.group_size,
        "learning_rate": recipe.learning_rate, "kl": {"coef": recipe.kl.coef},
        "batching": {"num_minibatches": recipe.batching.num_minibatches},
        "rollout": {"max_new_tokens": recipe.rollout.max_new_tokens,
                    "temperature": recipe.rollout.temperature, "ignore_eos": True}}
  model = qwen_model(name)
  full = {"model": model, "sft": {"steps": 0}, "eval": {"batch_size": 32},
          "task": {"num_digits": 90}, "data": {"max_prompt_tokens": 96},  # 96 tokens with BOS
          "rl": rl,
          "placement": {"strategy": "colocate", "cpu_devices": 1, "sampler_tensor": 1}}
  reduced = {"model": reduced_model(model), "task": {"num_digits": 10},
             "data": {"max_prompt_tokens": 16},
             "rl": {"prompts_per_step": 2, "group_size": 2, "rollout": {"max_new_tokens": 16},
                    "batching": {"num_minibatches": 2}}}
  return Workload(1, full, modes=False, reduced=reduced)


def find_workload(name: str) -> Workload:
  return WORKLOADS[name] if name in WORKLOADS else gsm8k_workload(name)


def build_config(workload: Workload, steps: int, reduced: bool = False,
                 rl: dict | None = None) -> dict:
  """The workload's config, `rl` (nested sections) over its RL section."""
  from train.preflight.calibration import bench_config
  from jaxrl.config_files import merge
  raw = bench_config(workload.sections(reduced), steps)
  raw["rl"] = merge(raw["rl"], rl or {})
  return raw


def step_flops(exp, rows: list[dict], ran_old_pass: bool) -> dict[str, float]:
  """Model FLOPs per stage of one step, from the config and the responses' mean length; the old
  log-prob pass counts only where the step needed it (and so ran it)."""
  from jaxrl.models import flops
  rl, p, n = exp.cfg.rl, exp.ctx.task.prompt_len, exp.cfg.rl.rollout.max_new_tokens
  model = exp.cfg.model
  mean_len = sum(r["response_len"] for r in rows) / len(rows)
  forward = flops.forward_flops(model, rl.rollouts, p + n, n)
  return {"generate": flops.generate_flops(model, rl.prompts_per_step, p, rl.group_size,
                                           mean_len),
          "reward": 0.0, "reference": forward, "old_logprobs": forward if ran_old_pass else 0.0,
          "update": flops.train_flops(model, rl.rollouts, p + n, n), "weight_push": 0.0}


def peak_memory_bytes() -> int:
  import jax
  stats = jax.devices()[0].memory_stats()
  if stats and "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"])
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def sig(x: float) -> float:
  """4 significant digits: small ratios and seconds stay visible (never rounded to 0)."""
  return float(f"{x:.4g}")


@dataclasses.dataclass(frozen=True)
class Timed:
  rows: list  # the timed steps' metrics rows
  wall_s: float  # of the timed steps
  calls: dict  # label -> seconds of each call in the timed steps
  first: dict  # label -> seconds of each call in the first step


def timed_steps(exp, steps: int, warmup: int) -> Timed:
  """The first step (compiles), warmup - 1 more, then `steps` timed ones."""
  timeline = exp.ctx.timeline
  start = time.perf_counter()
  exp.rl.step()
  after_first = time.perf_counter()
  for _ in range(warmup - 1):
    exp.rl.step()
  t0 = time.perf_counter()
  rows = [exp.rl.step() for _ in range(steps)]
  wall = time.perf_counter() - t0
  since_start, later = timeline.durations(start), timeline.durations(after_first)
  first = {k: v[:len(v) - len(later.get(k, []))] for k, v in since_start.items()}
  return Timed(rows, wall, timeline.durations(t0), first)


def stage_table(timed: Timed, stage_flops: dict, steps: int, peak: float) -> dict:
  stages = {}
  for name, labels in STAGE_LABELS.items():
    seconds = sum(t for label in labels for t in timed.calls.get(label, [])) / steps
    first = sum(t for label in labels for t in timed.first.get(label, []))
    util = stage_flops[name] / (seconds * peak) if seconds and stage_flops[name] else 0.0
    stages[name] = {"seconds": sig(seconds), "flops": stage_flops[name],
                    "flops_utilization": sig(util), "compile_s": sig(max(first - seconds, 0.0))}
  return stages


def decode_stats(exp, generate_s: float, mean_len: float, ceilings) -> dict:
  """Generated tokens per second of the generate stage against the decode roofline."""
  from benchmarks.roofline import decode_roofline_s, kv_bytes_per_position, weight_bytes
  cfg, rl = exp.cfg.model, exp.cfg.rl
  mesh = exp.ctx.cluster.meshes["sampler"]
  devices = mesh.devices.size
  roofline_s = decode_roofline_s(
      cfg, rl.rollouts, exp.ctx.task.prompt_len, mean_len,
      weight_copies=devices // mesh.shape["tensor"],
      bytes_per_s=ceilings.memory_bytes_per_s * (1 if ceilings.shared else devices))
  tokens = rl.rollouts * mean_len
  return {"tokens_per_s": sig(tokens / generate_s),
          "roofline_tokens_per_s": sig(tokens / roofline_s) if roofline_s else 0.0,
          "roofline_fraction": sig(roofline_s / generate_s),
          "weight_bytes": weight_bytes(cfg), "kv_bytes_per_position": kv_bytes_per_position(cfg)}


def compile_seconds(summary: dict, stages: dict) -> dict:
  """Compile seconds per stage and in all: the run summary's where it records them
  (train/io/compilation.py: per timeline label, "other" for work outside the stages), else each
  stage's first step minus its steady step (the stages' table as it is)."""
  by_label = summary.get("compile")
  if not isinstance(by_label, dict) or "compile_s" not in summary:
    return {"stages": stages, "compile_s": sig(sum(s["compile_s"] for s in stages.values())),
            "compile_source": "first step - steady step"}
  logged = {name: {**stage, "compile_s": sig(sum(by_label.get(label, {}).get("s", 0.0)
                                                 for label in STAGE_LABELS[name]))}
            for name, stage in stages.items()}
  return {"stages": logged, "compile_s": summary["compile_s"],
          "compile_cache_hits": summary.get("compile_cache_hits", 0),
          "compile_by_label": by_label, "compile_source": "run summary"}


def run_stages(workload: Workload, *, steps: int, warmup: int, reduced: bool,
               rl: dict | None = None) -> dict:
  """Per-stage seconds, FLOPs, utilization and compile seconds of the workload's sync RL step,
  its decode against the roofline."""
  import jax

  from benchmarks.roofline import device_ceilings
  from train.preflight.dry_run import busiest_total
  from train.run import Experiment
  with Experiment(build_config(workload, steps + warmup, reduced, rl)) as exp:
    estimate = busiest_total(exp.cfg, exp.ctx.cluster.devices)  # abstract: allocates nothing
    ceilings = device_ceilings(exp.cfg.model.dtype)
    peak = ceilings.matmul_flops_per_s * (1 if ceilings.shared else jax.device_count())
    timed = timed_steps(exp, steps, warmup)
    stage_flops = step_flops(exp, timed.rows, ran_old_pass="old logprobs" in timed.calls)
    stages = stage_table(timed, stage_flops, steps, peak)
    mean_len = sum(r["response_len"] for r in timed.rows) / steps
    decode = decode_stats(exp, stages["generate"]["seconds"], mean_len, ceilings)
    compiled = compile_seconds(exp.finish(), stages)  # finish: the summary's compile entries
  step_s = timed.wall_s / steps
  return {**compiled, "step_s": sig(step_s),
          "flops_utilization": sig(sum(stage_flops.values()) / (step_s * peak)),
          "response_len": mean_len, "decode": decode, "matmul_flops_per_s": round(peak),
          "memory_bytes_per_s": round(ceilings.memory_bytes_per_s), "peak_source": ceilings.source,
          "dry_run_bytes": estimate}


def run_mode(strategy: str, mode: str, *, steps: int, warmup: int, max_staleness: int,
             rl: dict | None = None) -> dict:
  """The default experiment's RL stage in one placement and mode."""
  from jaxrl.config_files import merge
  from train.run import Experiment
  schedule = {"schedule": {"mode": mode, "max_staleness": max_staleness}}
  raw = build_config(WORKLOADS["default"], steps + warmup, rl=merge(rl or {}, schedule))
  raw["placement"]["strategy"] = strategy
  with Experiment(raw) as exp:
    for _ in range(warmup):
      exp.rl.step()
    t0 = time.perf_counter()
    lags = [exp.rl.step()["policy_lag"] for _ in range(steps)]
    wall = time.perf_counter() - t0
    summary = exp.ctx.timeline.summary(t0)
    samples = exp.cfg.rl.rollouts
  return {"samples_per_s": samples * steps / wall, "step_s": wall / steps,
          "bubble": summary["bubble"], "busy": summary["busy"], "max_lag": max(lags)}


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--workload", default="default",
                      choices=sorted(WORKLOADS) + list(GSM8K_WORKLOADS))
  parser.add_argument("--scale", choices=("auto", "full", "reduced"), default="auto",
                      help="reduced: the workload's CPU-sized form (auto: on a CPU, if it has one)")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--warmup", type=int, default=2,
                      help="untimed steps first (>= 1: the first compiles)")
  parser.add_argument("--modes", action=argparse.BooleanOptionalAction, default=None,
                      help="also compare placements and modes (default: on for `default`)")
  parser.add_argument("--max-staleness", type=int, default=1)
  parser.add_argument("--micro-batch-size", type=int, default=None,
                      help="rl.batching.micro_batch_size (default: the workload's)")
  parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                      help="model.layers.scan (default: auto, unrolled on a CPU)")
  parser.add_argument("--exact", choices=("", "pass", "replay"), default="",
                      help="rl.rollout.exact: each token drawn by the trainer's own pass, or "
                           "the trainer replaying the sampler's decode loop")
  parser.add_argument("--inflight-slots", type=int, default=0,
                      help="rl.rollout.inflight_slots (0: the static engine)")
  add_host_flags(parser)
  args = parser.parse_args()
  if args.warmup < 1 or args.steps < 1:
    parser.error("--warmup and --steps must be >= 1")
  return args


def main() -> None:
  args = parse_args()
  retained = setup_host(args)
  work = find_workload(args.workload)
  if args.scan_layers is not None:
    model = {**work.overrides.get("model", {}), "layers": {"scan": args.scan_layers}}
    work = dataclasses.replace(work, overrides={**work.overrides, "model": model})
  force_cpu_devices(work.devices)
  import jax

  cpu = jax.default_backend() == "cpu"
  reduced = args.scale == "reduced" or (args.scale == "auto" and cpu and bool(work.reduced))
  rl = ({} if args.micro_batch_size is None
        else {"batching": {"micro_batch_size": args.micro_batch_size}})
  rl["rollout"] = {"exact": args.exact, "inflight_slots": args.inflight_slots}
  result = {"workload": args.workload, "scale": "reduced" if reduced else "full",
            "exact": args.exact, "inflight_slots": args.inflight_slots,
            "scan_layers": cpu is False if args.scan_layers is None else args.scan_layers,
            **run_stages(work, steps=args.steps, warmup=args.warmup, reduced=reduced, rl=rl)}
  if work.modes if args.modes is None else args.modes:
    modes = {name: run_mode(strategy, mode, steps=args.steps, warmup=args.warmup,
                            max_staleness=args.max_staleness, rl=rl)
             for name, (strategy, mode) in MODES.items()}
    result.update(modes=modes, max_staleness=args.max_staleness,
                  async_over_sync=modes["async-separate"]["samples_per_s"]
                  / modes["sync-separate"]["samples_per_s"])
  emit({**result, "peak_memory_bytes": peak_memory_bytes(), "retain_freed_memory": retained,
        "steps": args.steps, "device": jax.devices()[0].device_kind,
        "n_devices": jax.device_count()}, args.json)


if __name__ == "__main__":
  main()
