"""The async generator's schedule (`rl.schedule.name`), written once for both workers
(train/rollout/worker.py: whole batches; partial.py: partial rollouts): when batch i may start,
which weights it starts with, whether new weights replace old ones mid-batch, and when a push
may land.

A schedule reads the worker through a `WorkerView`, the numbers it needs taken under the
worker's lock (which batch the trainer takes next, whether a push is coming, the installed and
newest versions, whether the prompts ran out); it decides from them alone.

Staleness: batch i starts only while at most `max_staleness` policy updates can come before the
trainer takes it (`WorkerView.ahead(i)`: the batches before it not yet taken, plus one when the
trainer has taken a batch since its last push and is not waiting for another). So no batch is
ever too stale to train on (none is dropped), and a trainer that takes several batches in one
step (DAPO's dynamic sampling) is never starved. `max_staleness=0` is synchronous.

  free   the newest weights whenever the worker looks: before each batch and, with partial
         rollouts, between decode segments. Which weights a token comes from depends on timing.
  fixed  batch i starts with exactly version max(0, i - max_staleness), which the worker waits
         for (partial rollouts: it opens batch i only once batch i - max_staleness - 1 has left
         the stream, and swaps weights only as a batch opens), and a push waits until the worker
         has installed the version before it (where one of its batches needs it: one of
         several generators makes every N-th batch). Rollouts are then a function of the seed,
         not of timing: a killed and resumed run reproduces an uninterrupted one bit for bit.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class WorkerView:
  """What a schedule reads of its worker, taken under the worker's lock."""
  taken: int  # the index of the next batch the trainer takes
  push_coming: bool  # the trainer took a batch since its last push and is not waiting for one
  installed: int  # the policy version the worker decodes with
  newest: int  # the newest pushed policy version
  exhausted: bool  # the prompts ran out
  next_own: int = 0  # the first of the worker's batches not yet started (or in flight)
  stride: int = 1  # the worker generates every stride-th batch (one of several generators)

  def ahead(self, index: int) -> int:
    """How many policy updates can come before the trainer takes batch `index`: the batches
    before it not yet taken, plus one when a push is coming (it lands first)."""
    return index - self.taken + self.push_coming


class Schedule:
  # Partial rollouts: new weights reach the rows in flight between decode segments (else only
  # as a batch opens)
  swaps_between_segments = False
  # The trainer takes one batch a step (DAPO's dynamic sampling, which takes several, cannot run)
  one_batch_per_step = False
  # A batch's rollouts are a function of its index, not of timing: several generators may split
  # the batches by index (placement.sampler_replicas)
  by_index = False

  def __init__(self, max_staleness: int):
    if max_staleness < 0:
      raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    self.max_staleness = max_staleness

  def blocked(self, view: WorkerView, index: int, next_emit: int) -> bool:
    """Partial rollouts: batch `index` cannot open yet, and waiting would hold the rows in
    flight (`next_emit`: the next batch to leave the stream)."""
    raise NotImplementedError

  def ready(self, view: WorkerView, index: int) -> bool:
    """Batch `index` may start now (the worker waits for this, holding its lock)."""
    raise NotImplementedError

  def takes_pending(self, view: WorkerView, index: int) -> bool:
    """Batch `index` starts with the newest pushed weights (else with the installed ones)."""
    raise NotImplementedError

  def push_ready(self, view: WorkerView, version: int) -> bool:
    """A push of `version` may replace the pending weights now."""
    return True


class Free(Schedule):
  swaps_between_segments = True

  def blocked(self, view: WorkerView, index: int, next_emit: int) -> bool:
    return not self.ready(view, index)

  def ready(self, view: WorkerView, index: int) -> bool:
    return view.ahead(index) <= self.max_staleness

  def takes_pending(self, view: WorkerView, index: int) -> bool:
    return True


class Fixed(Schedule):
  one_batch_per_step = True  # batch i belongs to step i: its version is i - max_staleness
  by_index = True

  def version_for(self, index: int) -> int:
    return max(0, index - self.max_staleness)

  def blocked(self, view: WorkerView, index: int, next_emit: int) -> bool:
    return index - self.max_staleness - 1 >= next_emit  # its weights need that batch trained

  def ready(self, view: WorkerView, index: int) -> bool:
    # (Older than the installed weights: a resume dropped the rows in flight, whose weights are
    # gone; their batches start again with the installed ones.)
    return self.version_for(index) <= view.installed or self.version_for(index) == view.newest

  def takes_pending(self, view: WorkerView, index: int) -> bool:
    return view.installed < self.version_for(index)

  def push_ready(self, view: WorkerView, version: int) -> bool:
    # (the pending version - 1 stays until the batch that needs it has started, if one does)
    return view.installed >= version - 1 or view.exhausted or not self._needs(view, version - 1)

  def _needs(self, view: WorkerView, version: int) -> bool:
    """Whether one of the worker's batches still to start decodes with `version`."""
    if version == 0:  # batches 0 .. max_staleness
      return view.next_own <= self.max_staleness
    index = version + self.max_staleness
    return index >= view.next_own and (index - view.next_own) % view.stride == 0


SCHEDULES = {"free": Free, "fixed": Fixed}
