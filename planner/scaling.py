"""The simulator: the cost model on clusters we do not have, written into docs/scaling.md.

  python -m planner.scaling            # prints the generated blocks
  python -m planner.scaling --write    # and replaces them in docs/scaling.md

Every input is fixed here, before any prediction is made, and printed in the document ahead of
the comparison: the device tables and the default efficiency factors of devices.py (public
sources, never fitted to the published step times), the models' shapes, and each setting's
workload with its source. The document's prose sits outside the generated blocks
(`<!-- BEGIN name -->` ... `<!-- END name -->`), which `--write` replaces.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re

from jaxrl.models.config import ModelConfig
from planner.cost import Workload, stage_times, step_time
from planner.devices import DEVICES, Efficiency
from planner.memory import kv_rows
from planner.search import Ranked, search

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "scaling.md")
_LLAMA = dict(vocab_size=128256, n_kv_heads=8, head_dim=128, tie_embeddings=False,
              dtype="bfloat16")
MODELS = {  # shapes from each model's config.json
    "Llama-3.1-8B": ModelConfig(d_model=4096, n_layers=32, n_heads=32, d_ff=14336, **_LLAMA),
    "Llama-3.1-70B": ModelConfig(d_model=8192, n_layers=80, n_heads=64, d_ff=28672, **_LLAMA),
    "Llama-3.1-405B": ModelConfig(d_model=16384, n_layers=126, n_heads=128, d_ff=53248,
                                  **_LLAMA),
    "Qwen3-32B": ModelConfig(vocab_size=151936, d_model=5120, n_layers=64, n_heads=64,
                             n_kv_heads=8, head_dim=128, d_ff=25600, tie_embeddings=False,
                             family="qwen3", dtype="bfloat16"),
    "Qwen2.5-7B": ModelConfig(vocab_size=152064, d_model=3584, n_layers=28, n_heads=28,
                              n_kv_heads=4, head_dim=128, d_ff=18944, tie_embeddings=False,
                              family="qwen2", dtype="bfloat16"),
}

NEMO = ("NeMo-RL v0.4 performance summary (github.com/NVIDIA-NeMo/RL, "
        "docs/about/performance-summary.md), GRPO on OpenMathInstruct-2, DGX-H100, bf16")
LLAMARL = "LlamaRL (Meta, arXiv 2505.24034), as quoted in this project's issue 15"
# A math-RL step as NeMo-RL's Llama 3.1 8B recipe runs it: 2,048 samples (64 prompts x 32),
# 512 per optimizer step (4 minibatches, so old log-probs need their own pass), a KL reference,
# sequences of 1,060 tokens on average and at most 4,096. The prompt length is not published:
# 128 tokens is our assumption. A modern engine: in-flight (continuous) batching with a paged
# KV cache, training on packed sequences (no padding) with flash attention (both systems
# compared here run on such kernels; added after the first run of this file found that, at
# 3,000-token sequences, [T, T] attention probabilities leave no plan that fits).
ENGINE = dict(inflight=True, paged=True, packed=True, flash_attention=True)
MATH_8B = dict(prompts=64, group_size=32, prompt_len=128, new_tokens=4096 - 128,
               mean_new_tokens=1060 - 128, num_minibatches=4, old_pass=True, reference=True,
               **ENGINE)
# NeMo-RL's Qwen3-32B row: the same batch, sequences of 3,206 tokens on average.
MATH_32B = dict(MATH_8B, mean_new_tokens=3206 - 128)
# configs/qwen2_5_7b_gsm8k.py as it is: 16 prompts x 8, prompts up to 256 tokens, 512 new
# tokens, 8 minibatches, KL reference; jaxrl's engine (static batches, padded passes), with
# every response running to the budget.
GSM8K_7B = dict(prompts=16, group_size=8, prompt_len=256, new_tokens=512, num_minibatches=8,
                old_pass=True, reference=True)


@dataclasses.dataclass(frozen=True)
class Setting:
  name: str
  model: str
  device: str
  devices: int
  workload: dict  # Workload fields besides the model
  published: dict  # column -> published seconds per step ({} when there is none)
  source: str = ""

  def build(self) -> Workload:
    return Workload(model=MODELS[self.model], **self.workload)


# Columns: "sync" is the best colocated synchronous plan (the design of LlamaRL's baseline and
# of NeMo-RL's on-policy runs), "async" the best separated asynchronous one (LlamaRL's design;
# NeMo-RL's 1-step off-policy runs), "plan" the planner's choice among everything.
SETTINGS = (
    Setting("Llama-3.1-8B, 256 x H100", "Llama-3.1-8B", "h100", 256, MATH_8B,
            {"sync": 22.45, "async": 8.90}, LLAMARL),
    Setting("Llama-3.1-70B, 256 x H100", "Llama-3.1-70B", "h100", 256, MATH_8B,
            {"sync": 82.32, "async": 20.67}, LLAMARL),
    Setting("Llama-3.1-405B, 1024 x H100", "Llama-3.1-405B", "h100", 1024, MATH_8B,
            {"sync": 635.8, "async": 59.5}, LLAMARL),
    Setting("Llama-3.1-8B, 16 x H100", "Llama-3.1-8B", "h100", 16, MATH_8B,
            {"sync": 97.7, "async": 74.6}, NEMO),
    Setting("Qwen3-32B, 32 x H100", "Qwen3-32B", "h100", 32, MATH_32B, {"sync": 393.0}, NEMO),
    Setting("Qwen3-32B, 64 x H100", "Qwen3-32B", "h100", 64, MATH_32B, {"async": 215.0}, NEMO),
    Setting("Qwen2.5-7B, TPU v5p-32 (16 chips)", "Qwen2.5-7B", "tpu_v5p", 16, GSM8K_7B, {},
            "configs/qwen2_5_7b_gsm8k.py"),
)
COLUMNS = {"sync": ("colocate", "sync"), "async": ("separate", "async"), "plan": (None, None)}


def ranked(setting: Setting) -> list[Ranked]:
  """Every plan that fits, fastest first, beyond what the presets build."""
  return search(setting.build(), setting.devices, DEVICES[setting.device], Efficiency(),
                presets_only=False, top=None)


def best(plans: list[Ranked], column: str) -> Ranked | None:
  """The fastest of `plans` in a column (None when nothing fits)."""
  strategy, mode = COLUMNS[column]
  return next((r for r in plans if strategy in (None, r.plan.strategy)
               and mode in (None, r.plan.mode)), None)


def _md(header: list[str], rows: list[list]) -> list[str]:
  out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def inputs_block() -> list[str]:
  """Devices, efficiency factors, models and workloads: every number the predictions use."""
  devices = sorted({s.device for s in SETTINGS})
  out = _md(["device", "bf16 TFLOP/s", "HBM TB/s", "memory GB", "link GB/s (one way)",
             "network GB/s", "per node", "source"],
            [[DEVICES[d].name, f"{DEVICES[d].matmul_flops / 1e12:.0f}",
              f"{DEVICES[d].hbm_bytes_per_s / 1e12:.2f}", f"{DEVICES[d].memory_bytes / 1e9:.0f}",
              f"{DEVICES[d].link_bytes_per_s / 1e9:.0f}",
              f"{DEVICES[d].network_bytes_per_s / 1e9:.0f}", DEVICES[d].devices_per_node,
              DEVICES[d].source] for d in devices])
  eff = dataclasses.asdict(Efficiency())
  out += [""] + _md(["efficiency factor", "value"], [[k, f"{v:g}"] for k, v in eff.items()])
  out += [""] + _md(["model", "parameters", "layers", "d_model", "heads / KV heads", "MLP",
                     "vocabulary"],
                    [[name, f"{Workload(m, 1, 1, 1, 1).params / 1e9:.2f}B", m.n_layers,
                      m.d_model, f"{m.n_heads} / {m.n_kv_heads}", m.d_ff, m.vocab_size]
                     for name, m in MODELS.items() if any(s.model == name for s in SETTINGS)])
  rows = []
  for s in SETTINGS:
    w = s.build()
    engine = ", ".join(k for k in ("inflight", "paged", "packed", "flash_attention")
                       if getattr(w, k)) or "static"
    rows.append([s.name, f"{w.prompts} x {w.group_size}", w.prompt_len, w.new_tokens,
                 f"{w.mean_response:g}", w.num_minibatches, engine, s.source])
  out += [""] + _md(["setting", "prompts x samples", "prompt tokens", "response budget",
                     "mean response", "minibatches", "engine", "source"], rows)
  return out


def _cell(r: Ranked | None) -> str:
  return "does not fit" if r is None else f"{r.step_s:.1f}"


def implied_scale(setting: Setting, column: str, plan) -> float | None:
  """The factor on both response lengths (budget and mean) at which `plan` would take the
  published time: what the published number implies about the workload, under this model."""
  target, dev = setting.published[column], DEVICES[setting.device]

  def predicted(f: float) -> float:
    w = setting.build()
    w = dataclasses.replace(w, new_tokens=max(1, round(w.new_tokens * f)),
                            mean_new_tokens=w.mean_response * f)
    rows = kv_rows(w, plan, dev.memory_bytes)
    return step_time(stage_times(w, dev, Efficiency(), plan, rows), plan, dev, Efficiency())

  lo, hi = 1 / 64, 8.0
  if not predicted(lo) <= target <= predicted(hi):
    return None
  for _ in range(40):
    mid = (lo * hi) ** 0.5
    lo, hi = (mid, hi) if predicted(mid) < target else (lo, mid)
  return lo


def results_block() -> list[str]:
  """Predicted against published step times, with the plan behind each prediction, and the
  response lengths at which that plan would take the published time."""
  rows, plans = [], []
  for s in SETTINGS:
    options = ranked(s)
    for column in ("sync", "async"):
      r = best(options, column)
      published = s.published.get(column)
      error = implied = ""
      if r is not None and published is not None:
        error = f"{r.step_s / published - 1:+.0%}"
        f = implied_scale(s, column, r.plan)
        implied = "out of range" if f is None else f"x{f:.2f}"
      rows.append([s.name, column, published or "-", _cell(r), error, implied,
                   "" if r is None else r.plan.describe()])
    r = best(options, "plan")
    plans.append([s.name, _cell(r), "" if r is None else r.plan.describe(),
                  "" if r is None else r.reason])
  out = _md(["setting", "column", "published s", "predicted s", "error",
             "responses that match", "plan"], rows)
  return out + [""] + _md(["setting", "planner's choice: s", "plan", "why"], plans)


BLOCKS = {"inputs": inputs_block, "results": results_block}


def replace_block(text: str, name: str, lines: list[str], doc: str) -> str:
  """`text` (the file `doc`) with its `<!-- BEGIN name -->` ... `<!-- END name -->` block's
  body replaced by `lines`; a ValueError when it has no such block."""
  pattern = re.compile(rf"(<!-- BEGIN {name} -->\n).*?(<!-- END {name} -->)", re.S)
  if not pattern.search(text):
    raise ValueError(f"{doc}: no '<!-- BEGIN {name} -->' ... '<!-- END {name} -->' block")
  return pattern.sub(lambda m: m.group(1) + "\n".join(lines) + "\n" + m.group(2), text)


def write_block(doc: str, name: str, lines: list[str]) -> None:
  """Rewrites the file `doc`'s `name` block (replace_block) in place."""
  with open(doc, encoding="utf-8") as f:
    text = replace_block(f.read(), name, lines, doc)
  with open(doc, "w", encoding="utf-8") as f:
    f.write(text)


def render(text: str) -> str:
  """`text` with every generated block replaced by what the code computes now."""
  for name, fn in BLOCKS.items():
    text = replace_block(text, name, fn(), DOC)
  return text


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--write", action="store_true", help=f"rewrite the blocks of {DOC}")
  args = parser.parse_args(argv)
  for name, fn in BLOCKS.items():
    print(f"## {name}\n" + "\n".join(fn()) + "\n")
  if args.write:
    with open(DOC, encoding="utf-8") as f:
      text = f.read()
    with open(DOC, "w", encoding="utf-8") as f:
      f.write(render(text))


if __name__ == "__main__":
  main()
