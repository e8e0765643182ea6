"""Experiment tracking: every metrics row also goes to TensorBoard and, when asked, W&B.

`metrics.jsonl` stays the record (train/io/metrics.py); these are views of it, written by process 0
only, with the same rows:

- TensorBoard (`logging.tensorboard`, on by default): event files through tensorboardX, one
  TensorBoard run per stage under RUN/tensorboard/STAGE (`tensorboard --logdir RUN/tensorboard`),
  each number of a row a scalar at the stage's step. A resumed run purges each stage's events
  after the steps its checkpoint covers, as it cuts metrics.jsonl back.
- Weights & Biases (`logging.wandb`; `pip install wandb`; WANDB_MODE=offline works offline):
  one W&B run per jaxrl run directory (its id from the directory's path, so a resumed run
  continues it), keys `STAGE/NAME` against `STAGE/step`.

The config and the chosen placement are logged once, as text and as the W&B run config.
"""
from __future__ import annotations

import hashlib
import json
import os

from jaxrl.config import ConfigError, ExperimentConfig, to_dict


def _numbers(row: dict) -> dict:
  """A row's numeric entries (not its phase, step or strings)."""
  return {k: float(v) for k, v in row.items()
          if k not in ("phase", "step") and isinstance(v, (int, float))
          and not isinstance(v, bool)}


class TensorBoard:

  def __init__(self, directory: str, purge_after: dict[str, int]):
    """`purge_after`: per stage, the last step a resumed run keeps (later events are dropped)."""
    self.directory, self.purge_after = directory, purge_after
    self._writers: dict = {}

  def _writer(self, phase: str):
    if phase not in self._writers:
      from tensorboardX import SummaryWriter
      purge = self.purge_after.get(phase)
      self._writers[phase] = SummaryWriter(os.path.join(self.directory, phase),
                                           purge_step=None if purge is None else purge + 1)
    return self._writers[phase]

  def write(self, row: dict) -> None:
    writer = self._writer(row.get("phase", "run"))
    for key, value in _numbers(row).items():
      writer.add_scalar(key, value, row.get("step", 0))

  def text(self, name: str, text: str) -> None:
    self._writer("run").add_text(name, text)

  def close(self) -> None:
    for writer in self._writers.values():
      writer.close()


class WandB:

  def __init__(self, cfg: ExperimentConfig, run_dir: str):
    try:
      import wandb
    except ImportError:
      raise ConfigError("config.logging.wandb: the wandb package is not installed "
                        "(pip install wandb)") from None
    self._wandb, self._phases = wandb, set()
    name = os.path.basename(os.path.normpath(run_dir))
    where = hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:8]
    self.run = wandb.init(project=cfg.logging.wandb_project, name=name, dir=run_dir,
                          id=f"{name}-{where}", resume="allow", config=to_dict(cfg))

  def write(self, row: dict) -> None:
    phase = row.get("phase", "run")
    if phase not in self._phases:
      self._phases.add(phase)
      self.run.define_metric(f"{phase}/step")
      self.run.define_metric(f"{phase}/*", step_metric=f"{phase}/step")
    self.run.log({f"{phase}/step": row.get("step", 0),
                  **{f"{phase}/{k}": v for k, v in _numbers(row).items()}})

  def text(self, name: str, text: str) -> None:
    self.run.config.update({name: text}, allow_val_change=True)

  def close(self) -> None:
    self.run.finish()


class Trackers:
  """The configured trackers (none on processes other than 0)."""

  def __init__(self, cfg: ExperimentConfig, run_dir: str, *, enabled: bool,
               purge_after: dict[str, int] | None = None):
    self.sinks = []
    if enabled and cfg.logging.tensorboard:
      self.sinks.append(TensorBoard(os.path.join(run_dir, "tensorboard"), purge_after or {}))
    if enabled and cfg.logging.wandb:
      self.sinks.append(WandB(cfg, run_dir))

  def write(self, row: dict) -> None:
    for sink in self.sinks:
      sink.write(row)

  def log_config(self, cfg: ExperimentConfig, placement: str) -> None:
    """The config (as JSON) and the placement chosen for it, once."""
    for sink in self.sinks:
      sink.text("config", json.dumps(to_dict(cfg), indent=1, default=str))
      sink.text("placement", placement)

  def close(self) -> None:
    for sink in self.sinks:
      sink.close()
    self.sinks = []


def last_steps(rows: list[dict]) -> dict[str, int]:
  """The last step of each stage among `rows` (a resumed run's kept metrics)."""
  out: dict[str, int] = {}
  for row in rows:
    if isinstance(row.get("step"), int):
      out[row.get("phase", "run")] = row["step"]
  return out
