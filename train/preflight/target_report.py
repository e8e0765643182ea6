"""What `--dry_run --target` prints (train/preflight/target_compile.py compiles): per program the
compiler's bytes, FLOPs and a time estimate, per phase the busiest device against the dry run's
estimate, the verdict against the chip's HBM; and the same numbers as JSON
(`--target_json=PATH`), which `python -m benchmarks.target_table` gathers into the docs'
table."""
from __future__ import annotations

import json

from train.preflight import dry_run
from train.preflight.target_compile import GIB, Compiled, TargetRun, compile_run
from jaxrl import platform
from jaxrl.config import ExperimentConfig
from planner.targets import Target


def step_seconds(c: Compiled, target: Target) -> tuple[float, str]:
  """One call of the program on the target: the compiler's own estimate where it is valid for
  the whole call (positive, and no Pallas kernel or repeated loop body it would count once),
  else the roofline of its FLOPs (every loop's runs, the kernels') and XLA's bytes accessed
  (a loop's body once: a lower bound) on the chip's datasheet."""
  optimal = c.cost.get("optimal_seconds", -1.0)
  once = c.products <= 1.01 * c.cost.get("flops", 0.0)
  if optimal > 0 and not c.program.kernel_flops and once and not c.unknown_loops:
    return optimal, "compiler"
  spec = target.spec
  return max(c.flops / spec.matmul_flops,
             c.cost.get("bytes accessed", 0.0) / spec.hbm_bytes_per_s), "roofline"


def _program_lines(compiled: list[Compiled], target: Target, unit: tuple[str, int]) -> list[str]:
  name, size = unit
  lines = [f"  {'program, ' + name + ' per device':<34}{'args':>7}{'out':>7}{'temp':>7}{'code':>7}"
           f"{'GFLOP':>10}{'GB moved':>10}{'est. ms':>9} (how)    compile s"]
  for c in compiled:
    m, (sec, how) = c.memory, step_seconds(c, target)
    cell = lambda n: f"{n / size:7.2f}"
    lines.append(f"  {c.program.name:<34}{cell(m.argument_size_in_bytes)}"
                 f"{cell(m.output_size_in_bytes - m.alias_size_in_bytes)}"
                 f"{cell(m.temp_size_in_bytes)}{cell(m.generated_code_size_in_bytes)}"
                 f"{c.flops / 1e9:10.1f}"
                 f"{c.cost.get('bytes accessed', 0) / 1e9:10.2f}"
                 f"{sec * 1e3:9.2f} ({how}){c.seconds:>12.1f}")
  return lines


def _phase_lines(peaks: dict, estimate: dict, unit: tuple[str, int]) -> list[str]:
  name, size = unit
  lines = [f"  {'phase: busiest device, ' + name:<34}{'compiler':>10}{'estimate':>10}   "
           f"(what stays + the phase; the estimate is --dry_run's)"]
  for phase, per_device in peaks.items():
    d = max(per_device, key=per_device.get)
    est = estimate.get(phase, {}).get(d)
    lines.append(f"  {phase + f' (device {d})':<34}{per_device[d] / size:10.2f}"
                 + (f"{est / size:10.2f}" if est else f"{'-':>10}"))
  return lines


def summary(run: TargetRun) -> dict:
  """The report's numbers: per program and device, bytes, and for one call FLOPs (every loop's
  runs and the Pallas kernels', XLA's own count with each loop body once, jaxrl's count) and
  seconds; per phase the busiest device, the compiler's bytes and the dry run's estimate."""
  programs = []
  for c in run.compiled:
    m, p, (sec, how) = c.memory, c.program, step_seconds(c, run.target)
    programs.append({
        "name": p.name, "phase": p.phase, "argument_bytes": m.argument_size_in_bytes,
        "output_bytes": m.output_size_in_bytes - m.alias_size_in_bytes,
        "temp_bytes": m.temp_size_in_bytes, "code_bytes": m.generated_code_size_in_bytes,
        "flops": c.flops, "xla_flops": c.cost.get("flops", 0.0),
        "kernel_flops": p.kernel_flops * p.pieces, "jaxrl_flops": c.jaxrl_flops or None,
        "unknown_loops": c.unknown_loops, "bytes_accessed": c.cost.get("bytes accessed", 0.0),
        "seconds": sec, "seconds_from": how, "compile_seconds": c.seconds})
  hbm = run.target.spec.memory_bytes
  return {"target": run.target.describe(), "hosts": run.hosts, "hbm_bytes": hbm,
          "placement": run.cfg.placement.strategy, "meshes": run.meshes, "programs": programs,
          **phase_summary(run.peaks, run.estimate, hbm)}


def phase_summary(peaks: dict, estimate: dict, hbm: float) -> dict:
  """Per phase its busiest device, the compiler's bytes there and the dry run's estimate; the
  worst phase, its bytes and whether they fit `hbm`."""
  phases = {}
  for phase, per_device in peaks.items():
    d = max(per_device, key=per_device.get)
    phases[phase] = {"device": d, "compiler_bytes": per_device[d],
                     "estimate_bytes": estimate.get(phase, {}).get(d)}
  worst_phase = max(phases, key=lambda p: phases[p]["compiler_bytes"])
  worst = phases[worst_phase]["compiler_bytes"]
  return {"phases": phases, "worst_phase": worst_phase, "worst_bytes": worst,
          "fits": worst <= hbm}


def report(cfg: ExperimentConfig, target: Target, json_path: str = "") -> tuple[list[str], bool]:
  """The target compile's lines, and whether every phase fits the chip's HBM; with `json_path`,
  `summary` written there too."""
  run = compile_run(cfg, target)
  if json_path:
    with open(json_path, "w", encoding="utf-8") as f:
      json.dump(summary(run), f, indent=1)
  hbm = target.spec.memory_bytes
  worst_phase, worst = run.worst()
  unit = ("GiB", GIB) if worst >= GIB else ("MiB", 1 << 20)
  lines = [f"target: {target.describe()}, {run.hosts} hosts; compiled here by libtpu",
           f"placement {cfg.placement.strategy}: "
           + ", ".join(f"{role} {mesh}" for role, mesh in run.meshes.items()),
           "(per call: GFLOP counts the matrix products as often as their loops run, a decode "
           "loop once (its length depends on the samples), plus jaxrl's count of the splash "
           "kernel's attention, which XLA's leaves out; GB moved is XLA's, a loop's body once)"]
  lines += _program_lines(run.compiled, target, unit) + _phase_lines(run.peaks, run.estimate,
                                                                     unit)
  where = (f"{worst / GIB:.2f} GiB at the busiest device ({worst_phase}) of "
           f"{hbm / GIB:.2f} GiB HBM")
  if worst <= hbm:
    return lines + [f"verdict: fits: {where}"], True
  with platform.building_for("tpu"):  # the estimate's remedy, for the target's kernels
    remedy = dry_run.remedy(cfg, run.cluster, run.resident, hbm)
  return lines + [f"verdict: DOES NOT FIT: {remedy} (the estimate's remedy); {where}"], False
