"""Calibration: fit the cost model's efficiency factors to what this machine does.

`profile()` measures the device (matmul peak, memory and transfer bandwidth); `samples_from_run`
reads a finished run directory (config.json, trace.json, metrics.jsonl) into measured stage and
step times; `fit` moves the factors (matmul efficiencies per kind of call, fixed costs) to match
them, in log space, pulled towards the prior so a factor the runs say nothing about stays put.
A calibration is saved as JSON and read back by `jaxrl-plan --calibration` and
`placement.calibration`; every run's own trace can be fed back in, so predictions improve with use.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from jaxrl.config import ExperimentConfig
from jaxrl.config_files import from_mapping
from planner.cost import Mesh, Plan, Workload, stage_times, step_time
from planner.devices import DeviceSpec, Efficiency
from planner.memory import kv_rows

# Timeline labels (train/loop/controller.py) -> the cost model's stages they time.
TRACE_STAGES = {"generate": ("generate",), "score": ("reward",), "ref logprobs": ("reference",),
                "old logprobs": ("old_logprobs",), "values": ("values",),
                "update": ("update", "critic_update"), "reshard": ("weight_push",),
                "push": ("weight_push",), "host": ("host",)}
FIT_FIELDS = ("train_mfu", "forward_mfu", "prefill_mfu", "decode_mfu", "call_overhead_s",
              "layer_overhead_s", "decode_step_overhead_s", "step_overhead_s", "matmul_half_dim",
              "matmul_half_rows", "collective_latency_s", "shared_overlap", "link")
BOUNDED = ("shared_overlap", "link")  # fractions: at most 1, as the *_mfu and *_hbm fields


@dataclasses.dataclass(frozen=True)
class Sample:
  workload: Workload
  plan: Plan
  label: str  # a TRACE_STAGES label, or "step" (a whole step, from metrics.jsonl)
  seconds: float
  devices: int = 8  # how many devices the run had


@dataclasses.dataclass(frozen=True)
class Calibration:
  device: DeviceSpec
  efficiency: Efficiency

  def save(self, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
      json.dump({"device": dataclasses.asdict(self.device),
                 "efficiency": dataclasses.asdict(self.efficiency)}, f, indent=1)

  @classmethod
  def load(cls, path: str) -> Calibration:
    with open(path, encoding="utf-8") as f:
      raw = json.load(f)
    return cls(DeviceSpec(**raw["device"]), Efficiency(**raw["efficiency"]))


def profile(dev: DeviceSpec, dtype: str = "float32") -> DeviceSpec:
  """`dev` with its matmul peak, memory and link bandwidth measured on this machine now."""
  from planner import measure
  link = measure.transfer_bytes_per_s()
  return dataclasses.replace(dev, matmul_flops=measure.matmul_flops_per_s(dtype=dtype),
                             hbm_bytes_per_s=measure.memory_bytes_per_s(),
                             link_bytes_per_s=link, network_bytes_per_s=link)


def preset_plan(cfg: ExperimentConfig, n_devices: int, dev: DeviceSpec) -> Plan:
  """The plan a config's fixed placement preset runs (sharding/placement.py), single host."""
  pl, rl = cfg.placement, cfg.rl
  k = n_devices if pl.strategy == "colocate" else pl.train_devices
  trainer = Mesh(fsdp=k)  # one host: fsdp over all the trainer's devices
  ns = n_devices - k if pl.strategy == "separate" else k
  sampler = Mesh(data=ns // cfg.sampler_tensor, tensor=cfg.sampler_tensor)
  scorer = Mesh(fsdp=(n_devices - k) // 2) if pl.strategy == "interleave" else trainer
  return Plan(pl.strategy, trainer, sampler, scorer, rl.schedule.mode, rl.batching.micro_batch_size,
              cfg.model.layers.remat, staleness=rl.schedule.max_staleness)


def predict(sample: Sample, dev: DeviceSpec, eff: Efficiency) -> float:
  """The model's seconds for a sample's label on the sample's devices of kind `dev`."""
  per_device = dev.memory_bytes / sample.devices if dev.shared_compute else dev.memory_bytes
  rows = kv_rows(sample.workload, sample.plan, per_device)
  times = stage_times(sample.workload, dev, eff, sample.plan, rows)
  if sample.label == "step":
    return step_time(times, sample.plan, dev, eff)
  return sum(times[s] for s in TRACE_STAGES[sample.label])


def alone(events: list[dict]) -> list[dict]:
  """The calls no other device call overlapped in time (the host's reward scoring aside): what
  one stage costs by itself, on devices that may be shared."""
  device = [e for e in events if e["name"] != "score"]
  def overlapped(e):
    start, end = e["ts"], e["ts"] + e["dur"]
    return any(o is not e and o["ts"] < end and start < o["ts"] + o["dur"] for o in device)
  return [e for e in events if e["name"] == "score" or not overlapped(e)]


def host_seconds(events: list[dict], step_times: list[float]) -> list[float]:
  """Per step of a sync run, the time no executor was busy: the step's wall time minus the
  union of its calls (a step starts with its `generate` call)."""
  events = sorted(events, key=lambda e: e["ts"])
  starts = [i for i, e in enumerate(events) if e["name"] == "generate"] + [len(events)]
  out = []
  for step, (a, b) in enumerate(zip(starts, starts[1:])):
    busy, end = 0.0, -float("inf")
    for e in events[a:b]:
      start, stop = max(e["ts"], end), e["ts"] + e["dur"]
      busy += max(0.0, stop - start)
      end = max(end, stop)
    if step < len(step_times):
      out.append(step_times[step] - busy / 1e6)
  return out


def _mean_after(values: list[float | None], skip: int) -> float | None:
  """The median of `values` after the first `skip` (None: not measured)."""
  kept = [v for v in values[skip:] if v is not None]
  return float(np.median(kept)) if kept else None


def samples_from_run(run_dir: str, dev: DeviceSpec, n_devices: int | None = None,
                     skip: int = 2) -> list[Sample]:
  """Measured stage times (the median of each label's calls after the first `skip`, which
  compile, among the calls that ran alone) and the median RL step time of a finished run. Async
  runs give only the step: their stages run at the same time as each other."""
  with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
    cfg = from_mapping(ExperimentConfig, json.load(f))
  n = n_devices or cfg.placement.cpu_devices
  workload, plan = Workload.from_config(cfg, dev.platform), preset_plan(cfg, n, dev)
  out = []
  with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  steps = _mean_after([r["step_time"] for r in rows if "step_time" in r], skip)
  if steps is not None:
    out.append(Sample(workload, plan, "step", steps, n))
  if cfg.rl.schedule.mode == "async":
    return out
  with open(os.path.join(run_dir, "trace.json"), encoding="utf-8") as f:
    events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
  host = _mean_after(host_seconds(events, [r["step_time"] for r in rows if "step_time" in r]),
                     skip)
  if host is not None and host > 0:
    out.append(Sample(workload, plan, "host", host, n))
  solo = {id(e) for e in alone(events)}
  by_label: dict[str, list[dict]] = {}
  for e in events:
    by_label.setdefault(e["name"], []).append(e)
  for label, calls in by_label.items():
    seconds = _mean_after([e["dur"] / 1e6 if id(e) in solo else None for e in calls], skip)
    sample = Sample(workload, plan, label, seconds, n)
    if label in TRACE_STAGES and seconds and predict(sample, dev, Efficiency()) > 0:
      out.append(sample)
  return out


def fit(samples: list[Sample], dev: DeviceSpec, prior: Efficiency, *,
        fields=FIT_FIELDS, ridge: float = 0.05) -> Efficiency:
  """The factors that best predict `samples` (least squares on log seconds), each kept near
  `prior` by a ridge term: factors the samples do not exercise stay at the prior."""
  from scipy.optimize import least_squares
  theta0 = np.log([getattr(prior, f) for f in fields])

  def efficiency(theta):
    return dataclasses.replace(prior, **dict(zip(fields, np.exp(theta).tolist())))

  def residuals(theta):
    eff = efficiency(theta)
    errors = [np.log(predict(s, dev, eff) / s.seconds) for s in samples]
    return np.concatenate([errors, ridge * (theta - theta0)])

  # Efficiencies are fractions of the peak: at most 1 (an overhead or width has no such bound).
  upper = np.array([0.0 if f.endswith(("_mfu", "_hbm")) or f in BOUNDED else np.inf
                    for f in fields])
  result = least_squares(residuals, np.minimum(theta0, upper - 1e-9), bounds=(-np.inf, upper),
                         method="trf")
  return efficiency(result.x)


def errors(samples: list[Sample], dev: DeviceSpec, eff: Efficiency) -> list[float]:
  """Relative error of each prediction: predicted / measured - 1."""
  return [predict(s, dev, eff) / s.seconds - 1 for s in samples]
