"""Run outputs: metrics.jsonl (one JSON object per line) and a PNG plot at the end.

The writer counts its rows; a run-state checkpoint records that count, and a resumed run cuts
the file back to it, so a step redone after a crash is logged once, not twice. On several
processes only process 0 writes (the others count the same rows).
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

PLOTTED = (("loss", "SFT loss", ("sft",)), ("reward_mean", "reward (train samples)", ("rl",)),
           ("heldout_acc", "held-out greedy accuracy (RL step 0 = as RL starts)", ("rl",)),
           ("kl", "KL(pi || ref)", ("rl",)), ("entropy", "entropy (nats/token)", ("rl",)))


def _plain(v):
  if isinstance(v, (np.ndarray, np.generic)) or hasattr(v, "dtype"):
    v = np.asarray(v).item()
  return float(v) if isinstance(v, float) else v


def shown(v: float) -> str:
  """A summary number for a log line: 3 decimals, or 3 significant digits below 0.001 (a
  float32 mismatch of 3e-5 must not read 0.000)."""
  return f"{v:.3f}" if v == 0 or abs(v) >= 1e-3 else f"{v:.3g}"


def plain_row(row: dict) -> dict:
  """A metrics row of host values as plain Python numbers and strings."""
  return {k: _plain(v) for k, v in row.items()}


class MetricsWriter:

  def __init__(self, run_dir: str, *, enabled: bool = True):
    self.path = os.path.join(run_dir, "metrics.jsonl")
    self.enabled = enabled
    self.rows: list[dict] = []
    self.trackers = None  # train/io/tracking.py: TensorBoard, W&B (set once the rows are known)
    self._f = None

  def resume(self, n_rows: int) -> None:
    """Keeps the first `n_rows` rows of an existing file (those a checkpoint covers)."""
    self.rows = read_metrics(self.path)[:n_rows] if os.path.exists(self.path) else []
    if self.enabled:
      with open(self.path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in self.rows)

  def write(self, row: dict) -> dict:
    clean = plain_row(row)
    self.rows.append(clean)
    if self.enabled:
      if self._f is None:
        self._f = open(self.path, "a", encoding="utf-8")
      self._f.write(json.dumps(clean) + "\n")
      self._f.flush()
    if self.trackers is not None:
      self.trackers.write(clean)
    return clean

  def close(self) -> None:
    if self._f is not None:
      self._f.close()
      self._f = None
    if self.trackers is not None:
      self.trackers.close()


def read_metrics(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def plot_metrics(rows: list[dict], out_path: str) -> None:
  from matplotlib.figure import Figure  # no pyplot: leaves a notebook's backend alone

  fig = Figure(figsize=(3.6 * len(PLOTTED), 3.2))
  axes = fig.subplots(1, len(PLOTTED))
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
