"""Whole batches: `RolloutWorker` generates each prompt batch with one generate call, with the
weights it installed as the batch started (the schedule, the queue and the run state are
train/rollout/worker.py's `Worker`; partial rollouts are train/rollout/partial.py's)."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from train.rollout.batches import RolloutBatch
from train.rollout.worker import Worker


class RolloutWorker(Worker):
  """Whole batches: `generate_fn(params, prompts, key) -> rollout` per prompt batch, batch i
  with `rollout_key(seed, i)`; `prompts[i]` is batch i (IndexError: the stream ended);
  `transfer` moves trainer weights into the sampler's layout (identity when None)."""

  def __init__(self, generate_fn: Callable[[Any, Any, jax.Array], Any], prompts: Sequence,
               params: Any, **worker):
    """`worker`: the Worker's settings (train/rollout/worker.py)."""
    super().__init__(prompts, params, **worker)
    self._generate = generate_fn
    self.launch()

  def _run(self) -> None:
    index = self.next_to_generate
    while True:
      try:
        prompts = self.prompt_batch(index)
      except IndexError:
        return self.finish()
      with self.locked():
        weights = self.start_batch(index)
      if weights is None:  # closed
        return
      t0 = time.perf_counter()
      key = self.batch_key(index)
      rollout = jax.block_until_ready(self._generate(weights.params, prompts, key))
      self.put(RolloutBatch(rollout, prompts, weights.version, index, time.perf_counter() - t0))
      index += self.stride
