"""The stage protocol and the one loop that runs every stage with the shared hooks.

A stage (SFT, DPO, reward model, RL, ...) owns its learners and its data position and knows
nothing of the other stages; it sees the `RunContext`. `run_stage` drives any stage: `start`
once, then `step` until the stage's steps are done, calling each hook after every step and once
at the end (evaluation, logging, checkpoints, the progress bar and stop requests are hooks,
train/hooks.py). A stage's run state is `done` (steps taken), `state()` (small JSON: data
positions, versions) and `arrays()` (device arrays to checkpoint besides the models and the
learners' optimizer states).
"""
from __future__ import annotations

from typing import ClassVar

from jaxrl.config import ExperimentConfig
from train.context import RunContext
from train.learner import Learner


class Stage:
  name: ClassVar[str]  # also the config section holding the stage's `steps`
  log_every: ClassVar[int] = 1  # steps between logged rows (evaluations are always logged)

  def __init__(self, ctx: RunContext):
    self.ctx, self.cfg = ctx, ctx.cfg
    self.done = 0
    self.started = self.finished = False
    self.last_eval: dict = {}  # the latest evaluation and the step it ran after
    self.last_eval_step: int | None = None

  @classmethod
  def enabled(cls, cfg: ExperimentConfig) -> bool:
    """Whether a run with `cfg` includes this stage (by default: when it has steps)."""
    return getattr(cfg, cls.name).steps > 0

  @classmethod
  def check(cls, cfg: ExperimentConfig) -> None:
    """Checks the user inputs the stage will read (data files) when the run starts, so a bad
    row costs seconds, not the stages before this one."""

  @property
  def total(self) -> int:
    """The stage's steps."""
    return getattr(self.cfg, self.name).steps

  def eval_due(self, done: int) -> bool:
    """Whether to evaluate after step `done` (by default at the end only)."""
    return done == self.total

  def start(self, *, restoring: bool = False) -> None:
    """Builds the stage's models, learners and data; with `restoring`, in the abstract (a
    restore fills them)."""

  def step(self) -> dict:
    """One step; its metrics row (values may stay on device until logged)."""
    raise NotImplementedError

  def evaluate(self) -> dict:
    """Held-out metrics of the current models (by default the policy's greedy accuracy)."""
    return {"heldout_acc": self.ctx.evaluate()}

  def finish(self) -> dict:
    """Summary entries, after the final evaluation."""
    return {}

  def learners(self) -> dict[str, Learner]:
    return {}

  def state(self) -> dict:
    return {}

  def arrays(self) -> dict:
    return {}

  def abstract_arrays(self, state: dict) -> dict:
    return {}

  def restore(self, state: dict, arrays: dict) -> None:
    """Puts back what `state()` and `arrays()` saved (after `start(restoring=True)`)."""

  def close(self) -> None:
    """Releases threads and executors."""


class Stopped(Exception):
  """A stop request ended the run at a step boundary (a checkpoint was saved first)."""


def run_stage(stage: Stage, hooks, steps: int | None = None) -> dict:
  """Runs `stage` for `steps` more steps (default: to its end); returns the last step's row."""
  if not stage.started:
    stage.start()
    stage.started = True
    for hook in hooks:
      hook.on_start(stage)
  target = stage.total if steps is None else min(stage.total, stage.done + steps)
  row: dict = {}
  while stage.done < target:
    row = stage.step()
    stage.done += 1
    row = {"phase": stage.name, "step": stage.done, **row}
    for hook in hooks:
      hook.after_step(stage, row)
  if stage.done >= stage.total and not stage.finished:
    stage.finished = True
    stage.ctx.summary.update(stage.finish())
    for hook in hooks:
      hook.after_stage(stage)
  return row
