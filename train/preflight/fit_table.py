"""The dry run's per-device memory of the 7B/8B GSM8K configs on 1, 2, 4 and 8 x 80 GB devices,
full-parameter or LoRA, with or without idle-role offload: the table in docs/lora.md.

  python -m train.preflight.fit_table            # print the table
  python -m train.preflight.fit_table --write    # rewrite it in docs/lora.md (tests/test_lora_run.py)

Every cell is `--dry_run`'s total for the busiest device (what stays through a step plus its
largest phase, train/preflight/dry_run.py) with the config's own settings except: placement colocate on N
devices (the sampler's tensor degree chosen automatically), `model.layers.remat=dots`, and the
column's LoRA (rank 16 on every projection) and `placement.offload` ("all" or none).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "lora.md")
CONFIGS = {"Qwen2.5-7B": "configs/qwen2_5_7b_gsm8k.py", "Llama-3.1-8B": "configs/llama3_1_8b_gsm8k.py"}
DEVICES = (1, 2, 4, 8)
COLUMNS = {"full": (0, ""), "full + offload": (0, "all"), "LoRA": (16, ""),
           "LoRA + offload": (16, "all")}


def cell(path: str, devices: int, rank: int, offload: str) -> str:
  """'GiB per device, fits' or '..., no' for one dry run."""
  import jax

  from jaxrl.config_files import config_module, resolve
  from train.preflight.dry_run import report
  raw = config_module(path).get_config()
  raw.model.layers.remat = "dots"
  raw.placement.update(strategy="colocate", cpu_devices=devices, sampler_tensor=0,
                       offload=offload)
  raw.lora.update(rank=rank, alpha=2.0 * rank if rank else 16.0)
  lines, fits = report(resolve(raw), devices=jax.devices()[:devices])
  total = re.search(r"total \(what stays \+ the largest phase\)\s+([\d.]+)", "\n".join(lines))
  return f"{float(total.group(1)):.1f} {'fits' if fits else 'no'}"


def table() -> list[str]:
  rows = ["| model | devices | " + " | ".join(COLUMNS) + " |",
          "|---|---|" + "---|" * len(COLUMNS)]
  for name, path in CONFIGS.items():
    for n in DEVICES:
      cells = [cell(path, n, rank, offload) for rank, offload in COLUMNS.values()]
      rows.append(f"| {name} | {n} x 80 GB | " + " | ".join(cells) + " |")
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--write", action="store_true")
  args = parser.parse_args()
  from sharding.host import force_cpu_devices
  force_cpu_devices(max(DEVICES))
  logging.disable(logging.INFO)
  with contextlib.redirect_stderr(io.StringIO()):  # the dry runs' own lines
    rows = table()
  print("\n".join(rows))
  if args.write:
    from planner.scaling import write_block
    write_block(DOC, "fit table", rows)


if __name__ == "__main__":
  main()
