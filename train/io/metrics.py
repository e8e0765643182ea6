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

# (metric, panel title, phases plotted); the held-out panel's phases share one step axis
PLOTTED = (("loss", "SFT loss", ("sft",)), ("reward_mean", "RL reward (train samples)", ("rl",)),
           ("heldout_acc", "held-out score (greedy)", ("sft", "rl")),
           ("kl", "RL KL(pi || ref), per token", ("rl",)),
           ("entropy", "RL entropy (nats/token)", ("rl",)))


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


def _points(rows: list[dict], key: str, phase: str) -> list[tuple[float, float]]:
  return [(r["step"], r[key]) for r in rows
          if r.get("phase") == phase and key in r and not math.isnan(r[key])]


def _heldout(ax, rows: list[dict], before: float | None) -> None:
  """The held-out score on one step axis: before SFT (step 0), SFT's evaluations, then RL's
  after SFT's last step; the axis spans [0, 1] when the scores do (a verifier's), so a gain
  reads at its true size."""
  sft = _points(rows, "heldout_acc", "sft")
  offset = max([s for s, _ in _points(rows, "loss", "sft")] + [s for s, _ in sft], default=0)
  if before is not None:
    sft = [(0, before), *sft]
  rl = [(offset + s, v) for s, v in _points(rows, "heldout_acc", "rl")]
  for pts, label in ((sft, "SFT"), (rl, "RL")):
    if pts:
      ax.plot(*zip(*pts), marker=".", label=label)
  values = [v for _, v in sft + rl]
  if values and 0 <= min(values) and max(values) <= 1:
    ax.set_ylim(-0.02, 1.02)
  if offset and rl:
    ax.axvline(offset, color="grey", lw=0.8, ls=":")
  ax.set_xlabel("step (SFT, then RL)" if offset and rl else "step")


def plot_metrics(rows: list[dict], out_path: str, *, title: str = "",
                 before: float | None = None):
  """metrics.png: a panel per PLOTTED metric, `title` above them; `before`: the held-out score
  before SFT (the summary's heldout_acc_init), the held-out panel's first point. Returns the
  matplotlib Figure."""
  from matplotlib.figure import Figure  # no pyplot: leaves a notebook's backend alone

  fig = Figure(figsize=(3.6 * len(PLOTTED), 3.5))
  axes = fig.subplots(1, len(PLOTTED))
  for ax, (key, panel, phases) in zip(axes, PLOTTED):
    ax.set_title(panel, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if key == "heldout_acc":
      _heldout(ax, rows, before)
    else:
      for phase in phases:
        if pts := _points(rows, key, phase):
          ax.plot(*zip(*pts))
    if len(ax.lines) > 1:
      ax.legend(fontsize=8)
  if title:
    fig.suptitle(title, fontsize=11)
  fig.tight_layout()
  fig.savefig(out_path, dpi=100)
  return fig
