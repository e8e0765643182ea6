"""The stage protocol and the one loop that runs every stage with the shared hooks.

A stage (SFT, DPO, reward model, RL, ...) owns its learners, its data position, its progress and
its entries of the run summary, and knows nothing of the other stages; it sees the `RunContext`.
`run_stage` drives any stage: `start` once, then `step` until the stage's steps are done, calling
each hook as it starts, after every step and once at the end (evaluation, logging, checkpoints,
the progress bar and stop requests are hooks, train/run/hooks.py). A stage's run state is its
`progress` (steps taken, its latest evaluation), `state()` (small JSON: data positions,
versions) and `arrays()` (device arrays to checkpoint besides the models and the learners'
optimizer states).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import ClassVar

from jaxrl.config import ExperimentConfig
from train.roles.learner import Learner
from train.stages.context import RunContext


@dataclasses.dataclass(frozen=True)
class StageProgress:
  """Where a stage stands: what a checkpoint's meta records of it (`snapshot`) and a resume puts
  back (`load`). The stage replaces it as it moves (`Stage.begin`, `advance`, ...); nothing else
  writes it."""
  started: bool = False
  done: int = 0  # steps taken (for RL, the policy version)
  finished: bool = False
  last_eval: dict = dataclasses.field(default_factory=dict)  # the latest evaluation
  last_eval_step: int | None = None  # the step it ran after
  saved: int | None = None  # the step of the stage's latest checkpoint

  def snapshot(self) -> dict:
    return {"done": self.done, "finished": self.finished, "last_eval": self.last_eval,
            "last_eval_step": self.last_eval_step}

  @classmethod
  def load(cls, meta: dict) -> StageProgress:
    """The progress a checkpoint's meta records (the checkpoint holds its step `done`)."""
    return cls(started=True, done=meta["done"], finished=meta["finished"],
               last_eval=meta["last_eval"], last_eval_step=meta["last_eval_step"],
               saved=meta["done"])


class Stage:
  name: ClassVar[str]  # also the config section holding the stage's `steps`
  log_every: ClassVar[int] = 1  # steps between logged rows (evaluations are always logged)
  # Whether the policy is evaluated as the stage starts: a step-0 row, `heldout_acc_NAME_start`
  evaluates_at_start: ClassVar[bool] = False

  def __init__(self, ctx: RunContext):
    self.ctx, self.cfg = ctx, ctx.cfg
    self.progress = StageProgress()
    self._summary: dict = {}  # the stage's summary entries, in the order they came

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
    """Summary entries, after the final evaluation (`progress.last_eval`)."""
    return {}

  def learners(self) -> dict[str, Learner]:
    return {}

  def state(self) -> dict:
    return {}

  def arrays(self) -> dict:
    return {}

  def abstract_arrays(self, state: dict) -> dict:
    return {}

  def paused(self):
    """A context in which the stage is paused for a checkpoint: `state()` and `arrays()` stay
    consistent while it copies them (RL: the async generator paused)."""
    return contextlib.nullcontext()

  def restore(self, state: dict, arrays: dict) -> None:
    """Puts back what `state()` and `arrays()` saved (after `start(restoring=True)`)."""

  def close(self) -> None:
    """Releases threads and executors."""

  # -- progress and summary: run_stage, the hooks and the Experiment move them through these --
  def begin(self) -> None:
    """`start`s the stage afresh."""
    self.start()
    self.progress = dataclasses.replace(self.progress, started=True)

  def advance(self) -> dict:
    """One `step`, counted; its row."""
    row = self.step()
    self.progress = dataclasses.replace(self.progress, done=self.progress.done + 1)
    return row

  def evaluate_now(self) -> dict:
    """`evaluate`, kept as the stage's latest evaluation (after its current step)."""
    metrics = self.evaluate()
    self.progress = dataclasses.replace(self.progress, last_eval=metrics,
                                        last_eval_step=self.progress.done)
    return metrics

  def evaluate_start(self, key: str) -> dict:
    """The policy's held-out score as the stage starts, kept as summary entry `key`; its row
    entries."""
    score = self.ctx.evaluate()
    self.note({key: score})
    return {"heldout_acc": score}

  def conclude(self) -> None:
    """The stage's steps are done: what `finish` returns joins its summary."""
    self.progress = dataclasses.replace(self.progress, finished=True)
    self.note(self.finish())

  def mark_saved(self) -> None:
    """A checkpoint now holds the current step (the summary's `NAME_checkpoint_step`)."""
    self.progress = dataclasses.replace(self.progress, saved=self.progress.done)
    self.note({f"{self.name}_checkpoint_step": self.progress.done})

  def load_progress(self, meta: dict) -> None:
    """Takes the progress a checkpoint's meta records (after `restore`)."""
    self.progress = StageProgress.load(meta)

  def note(self, entries: dict) -> None:
    """Adds summary entries (a key already there keeps its place)."""
    self._summary.update(entries)

  def summary(self) -> dict:
    """The stage's entries of the run summary, in the order they came: its start evaluations,
    the rows its data skipped, its latest checkpoint's step and what `finish` returned (a
    checkpoint's summary holds those of the stages before it)."""
    return dict(self._summary)


class Stopped(Exception):
  """A stop request ended the run at a step boundary (a checkpoint was saved first)."""


def run_stage(stage: Stage, hooks, steps: int | None = None) -> dict:
  """Runs `stage` for `steps` more steps (default: to its end); returns the last step's row."""
  if not stage.progress.started:
    stage.begin()
    row = {"phase": stage.name, "step": stage.progress.done}
    for hook in hooks:
      hook.on_start(stage, row)
  total = stage.total
  target = total if steps is None else min(total, stage.progress.done + steps)
  row: dict = {}
  while stage.progress.done < target:
    row = stage.advance()
    row = {"phase": stage.name, "step": stage.progress.done, **row}
    for hook in hooks:
      hook.after_step(stage, row)
  if stage.progress.done >= total and not stage.progress.finished:
    stage.conclude()
    for hook in hooks:
      hook.after_stage(stage)
  return row
