"""The hooks every stage shares: evaluation, logging, checkpoints, the progress bar, stop requests.

`run_stage` (train/stages/base.py) calls `on_start` when a stage starts afresh (with its step-0
row), `after_step` after each step with its metrics row (hooks run in list order and may add to
the row: evaluation first, so the row that is logged and the checkpoint that follows carry its
results) and `after_stage` when the stage is done. Hooks move a stage only through its methods
(`evaluate_now`, `evaluate_start`); the Log hook is the one writer of metrics rows.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
from tqdm import tqdm

from sharding.distributed import agree, post_stop, posted_stop
from train.io import metrics
from train.io.host_transfers import HostTransfers
from train.stages.base import Stage, Stopped

log = logging.getLogger("jaxrl")


class Hook:

  def on_start(self, stage: Stage, row: dict) -> None:
    pass

  def after_step(self, stage: Stage, row: dict) -> None:
    pass

  def after_stage(self, stage: Stage) -> None:
    pass


class Evaluate(Hook):
  """Held-out evaluation, the one place a run starts it: as a stage starts (the policy before
  the run's first stage, `heldout_acc_init`; and, for a stage that `evaluates_at_start`, its
  step-0 row and `heldout_acc_NAME_start`) and after each step it is due (added to the row)."""

  def __init__(self, *, initial: bool):
    self.initial = initial  # the run's starting policy is not evaluated yet

  def on_start(self, stage, row):
    if self.initial:
      stage.evaluate_start("heldout_acc_init")
      self.initial = False
    if stage.evaluates_at_start:
      row.update(stage.evaluate_start(f"heldout_acc_{stage.name}_start"))

  def after_step(self, stage, row):
    if stage.eval_due(stage.progress.done):
      row.update(stage.evaluate_now())


class Log(Hook):
  """Every `log_every`-th row, each evaluated row (a stage's step-0 row too) and the last row go
  to metrics.jsonl (their device values fetched then, not every step); a finished stage logs the
  numbers of the run's `summary()` so far. `transfers`: the run's named host transfers."""

  def __init__(self, writer, summary: Callable[[], dict[str, Any]], transfers: HostTransfers):
    self.writer, self.summary, self.transfers = writer, summary, transfers

  def on_start(self, stage, row):
    if row.keys() - {"phase", "step"}:  # evaluated: host numbers already, in the row's order
      self.writer.write(row)

  def after_step(self, stage, row):
    p = stage.progress
    if p.done % stage.log_every == 0 or p.done == stage.total or p.last_eval_step == p.done:
      row.update(self.writer.write(self.transfers.to_host(row, "metrics")))

  def after_stage(self, stage):
    shown = {k: v for k, v in self.summary().items() if isinstance(v, float)}
    log.info("%s done after %d steps: %s", stage.name, stage.progress.done,
             ", ".join(f"{k} {metrics.shown(v)}" for k, v in shown.items()))


class Progress(Hook):
  """A tqdm bar per stage; its postfix shows the last logged row's headline metrics."""

  SHOWN = {"loss": "loss", "reward_mean": "reward", "step_time": "step_s", "policy_lag": "lag",
           "heldout_acc": "acc", "accuracy": "acc", "margin": "margin"}

  def __init__(self, enabled: bool):
    self.enabled, self.bar = enabled, None

  def on_start(self, stage, row):
    self._open(stage, stage.progress.done)

  def _open(self, stage, done: int):
    self.bar = tqdm(total=stage.total, initial=done, disable=not self.enabled,
                    desc=stage.name.replace("_", " "), dynamic_ncols=True)

  def after_step(self, stage, row):
    if self.bar is None:  # a stage that started earlier (restored, or run piecewise): the bar
      self._open(stage, stage.progress.done - 1)  # starts where it was before this step
    self.bar.update(1)
    shown = {short: row[k] for k, short in self.SHOWN.items()
             if isinstance(row.get(k), (int, float))}
    if shown:
      self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()})

  def after_stage(self, stage):
    self.close()

  def close(self):
    if self.bar is not None:
      self.bar.close()
      self.bar = None


def agreed(flag: bool) -> bool:
  """Process 0's `flag` on every process: saving and stopping are collective (orbax saves with
  a barrier), so processes must decide them together, not by their own clocks or signals."""
  return bool(agree(bool(flag), "flag"))


class NumericsError(RuntimeError):
  """Too many updates in a row had a NaN or an Inf in their gradients."""


class NonFinite(Hook):
  """Stops the run once `limit` updates in a row were skipped for a NaN or an Inf in their
  gradients (the optimizer skips them: train/updates/, `make_optimizer`). It reads the count
  from rows the Log hook has fetched, so it adds no host transfer: every step in RL, every
  `log_every` steps in SFT, DPO and reward-model training. Skipped updates leave the weights
  as they were, and it runs before the Checkpoint hook, so the last checkpoint is a good one."""

  def __init__(self, limit: int):
    self.limit = limit

  def after_step(self, stage, row):
    runs = [v for k, v in row.items() if k.endswith("skipped_in_a_row_max")
            and isinstance(v, (int, float))]
    if runs and max(runs) >= self.limit:
      saved = stage.progress.saved
      raise NumericsError(
          f"{stage.name} step {stage.progress.done}: {int(max(runs))} updates in a row had a NaN "
          f"or an Inf in their gradients and were skipped (max_skipped_updates={self.limit}); "
          + ("no checkpoint of this stage was saved yet" if saved is None else
             f"checkpoints/{stage.name}/{saved} is intact"))


class Checkpoint(Hook):
  """A run-state checkpoint every `every` steps, at least every `minutes`, and at the end of
  every stage; `save(stage)` writes one (train/run/experiment.py)."""

  def __init__(self, save: Callable[[Stage], None], every: int, minutes: float):
    self.save, self.every, self.seconds = save, every, minutes * 60
    self.last = time.monotonic()

  def after_step(self, stage, row):
    done = stage.progress.done
    if done == stage.total:  # the last step is saved by after_stage
      return
    late = self.seconds > 0 and time.monotonic() - self.last >= self.seconds
    if done % self.every == 0 or agreed(late):
      self.save(stage)
      self.last = time.monotonic()

  def after_stage(self, stage):
    self.save(stage)
    self.last = time.monotonic()


class StopRequest(Hook):
  """SIGTERM / SIGINT (handlers installed in the main thread while a run is inside `with`)
  end it at the next step boundary of any stage, after a checkpoint; a second Ctrl-C raises
  KeyboardInterrupt at once. A request after a stage's last step ends the run once that stage
  has finished (and saved), before the next one starts."""

  def __init__(self, save: Callable[[Stage], None]):
    self.save, self.event, self.signal, self._old = save, threading.Event(), None, {}
    self._depth = 0

  def __enter__(self):
    self._depth += 1
    if self._depth > 1:  # already inside a run
      return self
    self.event.clear()  # a stop honoured earlier (e.g. in a notebook) does not stop this run
    self.signal = None
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def requested(self) -> bool:
    """Whether the run stops here, the same on every process: process 0's word, which counts
    a stop any process of the job posted (a SIGTERM to one trainer or sampler process)."""
    mine = (self.signal or "stop request") if self.event.is_set() else None
    if mine is None and jax.process_index() == 0:
      mine = posted_stop()
    name = agree(mine or "", "stop")
    if name and name != "stop request":
      self.signal = self.signal or name
    return bool(name)

  def check(self) -> None:
    """Between stages: ends the run if a stop was requested."""
    if self.requested():
      raise Stopped(self.signal or "stop request")

  def _handle(self, signum, frame):
    if self.event.is_set():
      raise KeyboardInterrupt
    self.signal = signal.Signals(signum).name
    log.warning("%s: stopping after the current step and saving a checkpoint", self.signal)
    self.event.set()
    post_stop(self.signal)  # (on several processes: for process 0, whichever got the signal)

  def __exit__(self, *exc):
    self._depth -= 1
    if self._depth:
      return
    for sig, old in self._old.items():
      signal.signal(sig, old)
    self._old.clear()

  def after_step(self, stage, row):
    if stage.progress.done < stage.total and self.requested():  # the last step: see `check`
      self.save(stage)
      raise Stopped(self.signal or "stop request")
