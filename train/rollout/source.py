"""Where the RL loop's rollout batches come from, and where its new weights go.

Sync (`rl.schedule.mode=sync`): batch i is generated when the loop asks for it, from the sampler's
fresh copy of the actor, on the generator's executor. Async: a worker thread generates ahead of the
trainer under the schedule (jaxrl/schedules.py): whole batches (`RolloutWorker`) or, with
`rl.schedule.partial_rollouts`, a stream of rows in in-flight slots that takes new weights between
decode segments (`PartialRolloutWorker`); every push of the trainer's weights reaches it. Either way
batch i is drawn with `rollout_key(seed, i)`: async with `max_staleness=0` reproduces sync.

`stream_geometry` is the one place the config's numbers become the partial rollouts' stream
layout (sampler/stream.py's `StreamGeometry`): the stream is built to it, and the RL stage
compares a checkpoint's rows in flight with it on resume.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import jax

from jaxrl.config import ExperimentConfig
from jaxrl.config_rl import RLConfig
from sampler.stream import StreamGeometry
from train.io.timeline import Timeline
from train.roles.sampler_weights import SamplerWeights
from train.rollout.batches import RolloutBatch, WorkerState
from train.rollout.generator import Generator, rollout_key
from train.rollout.partial import PartialRolloutWorker
from train.rollout.whole import RolloutWorker


def stream_geometry(rl: RLConfig, prompt_width: int) -> StreamGeometry | None:
  """The layout of partial rollouts' stream under this config, for prompts of up to
  `prompt_width` tokens (None: no stream): a step's rollouts per batch, and open at once the
  batch the trainer takes next and the `rl.schedule.max_staleness` generated ahead of it. The
  stream is built to it, and a resume continues a checkpoint's rows in flight only where it is
  theirs."""
  if not rl.schedule.partial_rollouts:
    return None
  return StreamGeometry(slots=rl.rollout.inflight_slots, rows=rl.rollouts,
                        live=rl.schedule.live_batches, prompt_width=prompt_width,
                        max_new_tokens=rl.rollout.max_new_tokens,
                        conversations=bool(rl.environment.name))


def make_worker(cfg: ExperimentConfig, generator: Generator, prompts, timeline: Timeline, params,
                *, prompt_len: int, **common):
  """The async worker of this config: partial rollouts' (a stream of rows in in-flight slots,
  prompts of up to `prompt_len` tokens) or whole batches' (`common`: the Worker's settings)."""
  geometry = stream_geometry(cfg.rl, prompt_len)
  if geometry is not None:
    return PartialRolloutWorker(generator.stream(params, geometry), prompts, params,
                                span=lambda: timeline.span("sampler", "decode"), **common)

  def generate(params, prompts, key):
    with timeline.span("sampler", "generate"):  # the device time, not the dispatch
      return jax.block_until_ready(generator.sample(params, prompts, key))
  return RolloutWorker(generate, prompts, params, **common)


class RolloutSource:

  def __init__(self, cfg: ExperimentConfig, generator: Generator, weights: SamplerWeights,
               prompts, *, prompt_len: int, timeline: Timeline, run: Callable, next_index: int,
               split=None, exact=None):
    """`prompts[i]`: prompt batch i (host arrays); `run(fn, *args, label=...)`: a call on the
    generator's executor (sync mode); `next_index`: the first batch not yet trained on; `split`: the
    trainer's and the sampler's processes where they are apart (sharding/crossing.py); `exact`:
    `rl.rollout.exact`'s sampler (train/loop/exact.py), which then draws every batch."""
    self.cfg, self.rl, self.generator, self.weights = cfg, cfg.rl, generator, weights
    self.exact = exact
    self.prompts, self.prompt_len, self.timeline, self._run = prompts, prompt_len, timeline, run
    self.next_index = next_index
    self.split = split
    self.worker = None

  def start(self, version: int, state: WorkerState | None = None) -> None:
    """Async mode: starts the generator ahead of the trainer, from the first batch not yet
    trained on (it draws the same prompts and keys as the sync loop), or from a checkpoint's
    generator `state`. Where the placement gives the sampler processes of its own, the generator
    runs there (train/rollout/remote.py), in sync mode as the fixed schedule with
    `max_staleness=0` (the same rollouts as generated in turn)."""
    sync = self.rl.schedule.mode != "async"
    if sync and (self.split is None or self.exact is not None):
      return
    self.weights.pin()  # the worker may decode with a copy the trainer replaced
    params = self.weights.fresh()
    worker = dict(start_index=self.next_index, schedule=self.rl.schedule.name,
                  max_staleness=self.rl.schedule.max_staleness, seed=self.cfg.seed)
    if self.split is not None:
      if sync:  # the fixed schedule that never runs ahead
        worker.update(schedule="fixed", max_staleness=0)
      from train.rollout.replicas import remote_worker
      self.worker = remote_worker(self.split, self.prompts, params, version=version, state=state,
                                  timeline=self.timeline, **worker)
      self.weights.release()  # (sent: the trainer keeps no mirror between pushes)
      return
    self.worker = make_worker(self.cfg, self.generator, self.prompts, self.timeline, params,
                              prompt_len=self.prompt_len, version=version, state=state, **worker)

  def next(self, version: int) -> tuple[RolloutBatch, float]:
    """The next batch (its rollout, prompts, index, policy version) and the seconds waited."""
    t0 = time.perf_counter()
    if self.worker is None:
      index = self.next_index
      prompts, key = self.prompts[index], rollout_key(self.cfg.seed, index)
      if self.exact is not None:  # (the actor's own weights: no copy to refresh)
        rollout = self._run(self.exact.sample, prompts, key, label="generate")
      else:
        rollout = self._run(self.generator.sample, self.weights.fresh(), prompts, key,
                            label="generate")
      batch = RolloutBatch(rollout, prompts, version, index, 0.0)
    else:  # (a failed worker thread raises RolloutWorkerError here)
      batch = self.worker.get()
    self.next_index = batch.index + 1
    return batch, time.perf_counter() - t0

  def publish(self, version: int):
    """The actor's new weights (`version`) into the sampler's copy, and to the async worker;
    the push's transfer statistics."""
    stats = self.weights.push()
    if self.worker is not None:
      self.worker.update_weights(self.weights.params, version)
      self.weights.release()
    return stats

  def close(self) -> None:
    if self.worker is not None:
      self.worker.close()
      self.worker = None
      self.weights.unpin()
