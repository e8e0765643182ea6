"""Every real-size config compiled for its TPU target by the TPU compiler on this CPU: the table
in docs/benchmarks.md (its "target table" block).

  python -m benchmarks.target_table --rows qwen2.5-0.5b,llama3.1-8b   # compile these rows
  python -m benchmarks.target_table --rows qwen2.5-7b --unrolled   # the decoder unrolled
  python -m benchmarks.target_table --write    # the docs' table from the stored rows
  python -m benchmarks.target_table --json     # the table, then the stored rows as one JSON line
  python -m benchmarks.target_table --estimates --write  # today's dry run against stored compiles

A row is `python -m train.cli.train --config=CONFIG --dry_run --target=SLICE OVERRIDES
--target_json=FILE` in a process of its own (minutes to tens of minutes each on a 2-core
machine). Its report's numbers are kept in benchmarks/target_table.json with the date, the
commit and this machine's CPU, so a row is compiled again only when named. Rows compile as a
TPU runs them, the decoder scanned (`model.layers.scan`); the rows stored as `NAME/unrolled`
were compiled before the decoder could be scanned (the 70B's full depth could not be: only
8- and 16-layer cuts, its 80 layers' update needing more than this 24 GB machine's memory),
and the second table sets their compile seconds beside the scanned ones.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from benchmarks.common import emit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORE = os.path.join(ROOT, "benchmarks", "target_table.json")
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Row:
  label: str
  config: str
  target: str
  overrides: tuple[str, ...] = ()


COLOCATE = ("--config.placement.strategy=colocate",)
SEPARATE = ("--config.placement.strategy=separate", "--config.rl.schedule.mode=async")
ROWS = {
    "qwen2.5-0.5b": Row("Qwen2.5-0.5B", "configs/qwen2_5_0_5b_gsm8k.py", "v5p-8"),
    "qwen2.5-7b": Row("Qwen2.5-7B", "configs/qwen2_5_7b_gsm8k.py", "v5p-8", COLOCATE),
    "qwen2.5-7b-lora": Row("Qwen2.5-7B LoRA", "configs/qwen2_5_7b_gsm8k_lora.py", "v5p-8"),
    "llama3.1-8b": Row("Llama-3.1-8B", "configs/llama3_1_8b_gsm8k.py", "v5p-8", COLOCATE),
    "llama3.1-8b-lora": Row("Llama-3.1-8B LoRA", "configs/llama3_1_8b_gsm8k_lora.py", "v5p-8"),
    "gemma3-4b": Row("Gemma-3-4B", "configs/gemma3_4b_gsm8k.py", "v5p-8", COLOCATE),
    # The trainer and the sampler on hosts of their own, async (docs/hosts.md)
    "qwen2.5-7b-separate": Row("Qwen2.5-7B, separate hosts, async", "configs/qwen2_5_7b_gsm8k.py",
                               "v5p-16", SEPARATE + ("--config.placement.train_devices=4",)),
    "llama3.1-8b-separate": Row("Llama-3.1-8B, separate hosts, async",
                                "configs/llama3_1_8b_gsm8k.py", "v5p-32",
                                SEPARATE + ("--config.placement.train_devices=8",)),
    "llama3.1-70b": Row("Llama-3.1-70B", "configs/llama3_1_70b_gsm8k.py", "v5p-64"),
    "qwen3-30b-a3b": Row("Qwen3-30B-A3B", "configs/qwen3_30b_a3b_gsm8k.py", "v5p-32"),
    "gemma3-12b": Row("Gemma-3-12B", "configs/gemma3_12b_gsm8k.py", "v5p-16"),
    "gemma3-12b-fsdp8": Row("Gemma-3-12B, trainer on 8 chips", "configs/gemma3_12b_gsm8k.py",
                            "v5p-32", ("--config.placement.train_devices=8",)),
    # where the dry run's verdict contradicted the compiler's (issue 64): the head windowed over
    # 16 chips, remat dots with the splash kernel, one micro-batch per minibatch; it fits, and
    # with 768 new tokens it does not
    "qwen2.5-3b": Row("Qwen2.5-3B", "configs/qwen2_5_3b_gsm8k.py", "v5e-16"),
    "qwen2.5-3b-768": Row("Qwen2.5-3B, 768 new tokens", "configs/qwen2_5_3b_gsm8k.py", "v5e-16",
                          ("--config.rl.rollout.max_new_tokens=768",)),
}


def _machine() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    model = platform.processor() or "unknown CPU"
  return f"{model}, {os.cpu_count()} cores"


def compile_row(name: str, unrolled: bool = False) -> dict:
  """One row's target compile in a child process: its summary, or the error line it ended on.
  `unrolled`: the decoder unrolled (`--config.model.layers.scan=false`)."""
  row = ROWS[name]
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "summary.json")
    cmd = [sys.executable, "-m", "train.cli.train", f"--config={row.config}", "--dry_run",
           f"--target={row.target}", f"--target_json={out}", *row.overrides,
           *(["--config.model.layers.scan=false"] if unrolled else [])]
    start, errors = time.perf_counter(), []
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    for line in proc.stderr:  # the target compile's progress, program by program
      if line.startswith("jaxrl:"):
        print(f"  {name}: {line.rstrip()}", file=sys.stderr, flush=True)
        errors += [line.strip()] if line.startswith("jaxrl: error:") else []
    proc.wait()
    wall = time.perf_counter() - start
    summary = None
    if os.path.exists(out):
      with open(out, encoding="utf-8") as f:
        summary = json.load(f)
  commit = _commit()
  shown = ["python"] + [a for a in cmd[1:] if not a.startswith("--target_json")]
  return {"command": " ".join(shown),
          "exit": proc.returncode, "error": errors[-1] if errors else None, "summary": summary,
          "wall_seconds": round(wall, 1), "date": datetime.date.today().isoformat(),
          "commit": commit, "machine": _machine()}


def row_config(name: str, entry: dict):
  """(the experiment config, the target) of a stored row, from the command it was compiled by
  (a row stored as NAME/unrolled: the decoder unrolled, as it was before it could scan)."""
  from train.cli.flags import parse_args
  from jaxrl.config_files import with_gin
  from planner.targets import parse_target
  args = entry["command"].split(" -m train.cli.train ")[1].split()
  if name.endswith(UNROLLED) and "--config.model.layers.scan=false" not in args:
    args.append("--config.model.layers.scan=false")
  raw, gin_files, gin_params, flags = parse_args(["refresh", *args])
  return with_gin(raw, gin_files, gin_params), parse_target(flags["target"])


def refreshed(name: str, entry: dict) -> dict:
  """A stored row with this commit's dry run: its phases from the stored programs' bytes (what
  stays and what offload brings back, per phase), the estimates from today's memory model and
  jaxrl's FLOP counts from today's; no compile (the programs are built, not lowered). Call
  after sharding.host.cpu_only_here."""
  from types import SimpleNamespace

  from train.preflight import dry_run
  from train.preflight.target_compile import (Compiled, estimates, phase_peaks, rl_programs,
                                        topology_devices)
  from train.preflight.target_report import phase_summary
  from jaxrl import platform
  summary = entry["summary"]
  cfg, target = row_config(name, entry)
  with platform.building_for("tpu"):
    cluster, resident, phases = dry_run.tables(cfg, topology_devices(target))
    programs = {p.name: p for p in rl_programs(cfg, cluster)}
  compiled = [Compiled(programs[p["name"]], SimpleNamespace(
      argument_size_in_bytes=p["argument_bytes"], output_size_in_bytes=p["output_bytes"],
      alias_size_in_bytes=0, temp_size_in_bytes=p["temp_bytes"],
      generated_code_size_in_bytes=p["code_bytes"]), {}, p["compile_seconds"], p["flops"], 0)
      for p in summary["programs"]]
  for p, c in zip(summary["programs"], compiled):  # jaxrl's count of each program, today's
    p["jaxrl_flops"] = c.jaxrl_flops or None
  summary = {**summary, **phase_summary(phase_peaks(compiled, resident, phases),
                                        estimates(resident, phases), summary["hbm_bytes"])}
  return {**entry, "summary": summary, "estimates_from": _commit()}


def _commit() -> str:
  return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                        text=True).stdout.strip()


def _ratio(a, b) -> str:
  return f"{a / b:.2f}" if a and b else "-"


def _programs(summary: dict, names: tuple[str, ...]) -> list[dict]:
  return [p for p in summary["programs"] if p["name"] in names]


def _flops_cell(summary: dict, names: tuple[str, ...]) -> str:
  """jaxrl's FLOPs over the compiled program's (one call, every loop's runs), per program."""
  return " / ".join(_ratio(p["jaxrl_flops"], p["flops"]) for p in _programs(summary, names)
                    if p["jaxrl_flops"]) or "-"


def _seconds_cell(summary: dict, names: tuple[str, ...]) -> str:
  """The named programs' estimated seconds (one call each: once per RL step), summed."""
  picked = _programs(summary, names)
  hows = "/".join(sorted({p["seconds_from"] for p in picked}))
  return f"{sum(p['seconds'] for p in picked):.2f} ({hows})" if picked else "-"


def _meshes(summary: dict) -> str:
  mesh = lambda role: " x ".join(f"{a} {n}" for a, n in summary["meshes"][role].items())
  return f"{summary['placement']}: trainer {mesh('actor')}, sampler {mesh('sampler')}"


SCORING = ("reference log-probs", "old log-probs")
GENERATE = "generate (prefill + decode loop)"
COMPILED = (GENERATE, "reference log-probs", "old log-probs", "actor update")
UNROLLED = "/unrolled"  # a stored row compiled with the decoder unrolled (before issue 55)


def table_row(row: Row, stored: dict) -> str:
  head = f"| {row.label} | {row.target} |"
  s = stored.get("summary")
  if s is None:
    return head + f" did not compile: {stored.get('error') or 'exit ' + str(stored['exit'])} |" \
        + " |" * 7
  ph = s["phases"][s["worst_phase"]]
  return (f"{head} {_meshes(s)} | {s['worst_bytes'] / GIB:.2f} ({s['worst_phase']}) of "
          f"{s['hbm_bytes'] / GIB:.1f}: {'fits' if s['fits'] else 'NO'} | "
          f"{_ratio(ph['estimate_bytes'], ph['compiler_bytes'])} | "
          f"{_flops_cell(s, ('actor update',))} | {_flops_cell(s, SCORING)} | "
          f"{_seconds_cell(s, ('actor update',))} | {_seconds_cell(s, SCORING)} | "
          f"{_seconds_cell(s, (GENERATE,))} | "
          f"{stored['wall_seconds'] / 60:.0f} min |")


def _compile_cell(entry: dict | None, name: str) -> str:
  s = (entry or {}).get("summary")
  picked = [p for p in (s or {}).get("programs", []) if p["name"] == name]
  return f"{picked[0]['compile_seconds']:.0f}" if picked else "-"


def compile_rows(store: dict) -> list[str]:
  """Compile seconds per program, the decoder unrolled (a stored `/unrolled` row) then scanned
  (`model.layers.scan`, the TPU default), with the machines each ran on."""
  lines = ["| config | generate: unrolled / scanned s | reference | old log-probs | update | "
           "whole command, min | machines (unrolled; scanned) |", "|---|---|---|---|---|---|---|"]
  cpu = lambda e: e["machine"].split(",")[0].replace("(R)", "") if e else "-"
  for name, row in ROWS.items():
    scanned, unrolled = store.get(name), store.get(name + UNROLLED)
    if scanned is None:
      continue
    cells = [f"{_compile_cell(unrolled, p)} / {_compile_cell(scanned, p)}" for p in COMPILED]
    wall = lambda e: f"{e['wall_seconds'] / 60:.1f}" if e else "-"
    lines.append(f"| {row.label} ({row.target}) | " + " | ".join(cells)
                 + f" | {wall(unrolled)} / {wall(scanned)} | {cpu(unrolled)}; {cpu(scanned)} |")
  return lines


def markdown(store: dict) -> list[str]:
  lines = ["| config | target | placement | busiest device, GiB (phase) of HBM | "
           "estimate / compiler | FLOPs jaxrl / compiled: update | scoring | est. s: update | "
           "scoring | generate (prefill + 1 decode step) | compile here |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  lines += [table_row(row, store[name]) for name, row in ROWS.items() if name in store]
  return lines + [""] + compile_rows(store)


def _stored() -> dict:
  if not os.path.exists(STORE):
    return {}
  with open(STORE, encoding="utf-8") as f:
    return json.load(f)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", default="", help=f"compile these rows: {','.join(ROWS)}")
  parser.add_argument("--unrolled", action="store_true", help="compile --rows with the decoder "
                      f"unrolled, stored as NAME{UNROLLED}")
  parser.add_argument("--write", action="store_true", help=f"rewrite the table in {DOC}")
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--estimates", action="store_true", help="the stored rows' phases and "
                      "estimates again with this commit's dry run (seconds; no compile)")
  args = parser.parse_args()
  names = [n for n in args.rows.split(",") if n]
  unknown = [n for n in names if n not in ROWS]
  if unknown:
    print(f"target_table: error: --rows: unknown {unknown}; known: {', '.join(ROWS)}",
          file=sys.stderr)
    sys.exit(2)
  for name in names:
    print(f"target_table: compiling {name} ...", file=sys.stderr, flush=True)
    result = compile_row(name, args.unrolled)
    key = name + UNROLLED if args.unrolled else name
    store = {**_stored(), key: result}  # (read again: another process may have added rows)
    with open(STORE, "w", encoding="utf-8") as f:
      json.dump(store, f, indent=1)
  if args.estimates:
    from sharding.host import cpu_only_here
    cpu_only_here()
    store = {n: refreshed(n, e) if (e or {}).get("summary") else e for n, e in _stored().items()}
    with open(STORE, "w", encoding="utf-8") as f:
      json.dump(store, f, indent=1)
  lines = markdown(_stored())
  print("\n".join(lines))
  if args.write:
    from planner.scaling import write_block
    write_block(DOC, "target table", lines)
  if args.json:
    emit({"rows": _stored()}, True)


if __name__ == "__main__":
  main()
