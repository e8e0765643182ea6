"""Run outputs: metrics.jsonl (one JSON object per line) and a PNG plot at the end."""
from __future__ import annotations

import json
import math
import os

PLOTTED = (("loss", "SFT loss", ("sft",)), ("reward_mean", "reward (train samples)", ("rl",)),
           ("heldout_acc", "held-out greedy accuracy (RL step 0 = after SFT)", ("rl",)),
           ("kl", "KL(pi || ref)", ("rl",)), ("entropy", "entropy (nats/token)", ("rl",)))


class MetricsWriter:

  def __init__(self, run_dir: str):
    self.path = os.path.join(run_dir, "metrics.jsonl")
    self._f = open(self.path, "a", encoding="utf-8")

  def write(self, row: dict) -> None:
    clean = {k: (float(v) if hasattr(v, "dtype") or isinstance(v, float) else v) for k, v in row.items()}
    self._f.write(json.dumps(clean) + "\n")
    self._f.flush()

  def close(self) -> None:
    self._f.close()


def read_metrics(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def plot_metrics(metrics_path: str, out_path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = read_metrics(metrics_path)
  fig, axes = plt.subplots(1, len(PLOTTED), figsize=(3.6 * len(PLOTTED), 3.2))
  for ax, (key, title, phases) in zip(axes, PLOTTED):
    for phase in phases:
      pts = [(r["step"], r[key]) for r in rows
             if r.get("phase") == phase and key in r and not math.isnan(r[key])]
      if pts:
        ax.plot(*zip(*pts), marker="." if key == "heldout_acc" else None, label=phase)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.lines:
      ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out_path, dpi=100)
  plt.close(fig)
