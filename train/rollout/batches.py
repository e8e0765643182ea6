"""What the async workers hand over: `RolloutBatch` (a finished batch, for the trainer) and
`WorkerState` (a worker's run state: its queue of batches not yet taken and, where a subclass
adds them, its in-flight arrays and older weights; train/rollout/async_state.py puts it in a
checkpoint)."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from sampler.engine import Rollout


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
  rollout: Any
  prompts: Any
  version: int  # policy version of its oldest tokens (whole batches: of all of them)
  index: int  # position in the prompt stream
  seconds: float  # wall time from its start to its end
  versions_BN: np.ndarray | None = None  # partial rollouts: each token's policy version

  def token_versions(self, n: int) -> np.ndarray:
    """[B, n] policy versions of the completion slots."""
    if self.versions_BN is not None:
      return self.versions_BN[:, :n]
    return np.full((self.rollout.completion_mask_BN.shape[0], n), self.version, np.int32)


@dataclasses.dataclass
class WorkerState:
  """A worker's run state: device arrays (an orbax item: nested dicts) and JSON meta."""
  arrays: dict
  meta: dict


def queue_state(queue: Iterable[RolloutBatch], installed: int) -> WorkerState:
  """The run state of a queue of finished batches (`installed`: the version the worker
  decodes with)."""
  arrays, meta = {}, {"installed": installed, "queue": []}
  for batch in queue:
    arrays.setdefault("queue", {})[str(batch.index)] = {
        k: v for k, v in vars(batch.rollout).items() if v is not None}
    meta["queue"].append({"index": batch.index, "version": batch.version,
                          "seconds": batch.seconds,
                          "versions": None if batch.versions_BN is None
                          else batch.versions_BN.tolist()})
  return WorkerState(arrays, meta)


def restored_queue(state: WorkerState, prompts: Sequence) -> Iterator[RolloutBatch]:
  """The batches `queue_state` saved."""
  for m in state.meta["queue"]:
    rollout = Rollout(**state.arrays["queue"][str(m["index"])])
    versions = None if m["versions"] is None else np.asarray(m["versions"], np.int32)
    yield RolloutBatch(rollout, prompts[m["index"]], m["version"], m["index"], m["seconds"],
                       versions)
