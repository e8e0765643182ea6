"""Several generator replicas (`placement.sampler_replicas`), each on processes of its own, behind
one worker's face for the trainer (train/rollout/remote.py serves each).

Batch i is generator i mod N's (each generates every N-th batch, as its schedule allows), taken
in index order; every push goes to all. Under the fixed schedule a batch is a function of its
index, whichever generator makes it: N generators equal one, bit for bit (with partial rollouts
a function of the seed and N: a generator's rows in flight take the next version as its own
next batch opens). Under the free schedule each push tells every generator which batch the
trainer takes next, from which its staleness bound counts (between pushes a generator sees only
the batches taken from it: it counts from an older one, so the bound holds, the later of its
batches wait for the next push).

A generator that dies is dropped, and the run goes on. Every process's peer watch
(sharding/distributed.py `Job.drop`) notices it within the heartbeat; the trainer's first
process, waiting for its batch, answers in the dead generator's place ("lost"), so that every
trainer process and every other generator reads the same answer at the same request. The
trainer then closes the other generators' workers and starts new ones on them, dealt every
(N-1)-th batch from the one it waits for, with its newest weights: the batches the dead one
owed, and those the others had queued, are generated again. Those start with the newest
weights (fresher than the fixed schedule's version, never staler), so from the drop on the run
is no longer bit for bit the uninterrupted one; a checkpoint saved after a drop holds no
generator state (a resumed run starts its generators afresh from the trainer's weights).
"""
from __future__ import annotations

import contextlib
import logging

from jaxrl.config import ConfigError
from train.roles.link import Link
from train.rollout.batches import RolloutBatch, WorkerState
from train.rollout.remote import GeneratorLost, RemoteWorker

log = logging.getLogger("jaxrl")


def remote_worker(split, prompts, params, *, version: int, state: WorkerState | None,
                  timeline, start_index: int, **worker):
  """The trainer's worker of the generator(s) on processes of their own (the session's
  `RemoteWorker`, or `Generators` over several)."""
  link, n = Link(split), len(split.replicas)
  if n == 1:
    return RemoteWorker(link, prompts, params, version=version, state=_per_replica(state, 1)[0],
                        timeline=timeline, start_index=start_index, **worker)
  return Generators(link, prompts, params, version=version, state=state, timeline=timeline,
                    start_index=start_index, **worker)


class Generators:
  """Several generator replicas behind one worker's face: batch i is the i mod N-th live
  generator's; every push goes to all; a dead one is dropped (the module's docstring)."""

  def __init__(self, link: Link, prompts, params, *, version: int, state: WorkerState | None,
               timeline, start_index: int, **worker):
    self._split, self._params, self._version = link.split, params, version
    self._make = dict(prompts=prompts, timeline=timeline, **worker)
    self.live = list(range(len(link.split.replicas)))
    self.dropped: list[int] = []
    self.workers = self._start(link, start_index, _per_replica(state, len(self.live)))
    self._next = start_index

  def _start(self, link: Link, start_index: int, states: list) -> list[RemoteWorker]:
    """A worker on each live generator, the k-th making batches start_index + j, j = k mod n."""
    n = len(self.live)
    return [RemoteWorker(link, params=self._params, version=self._version, state=states[k],
                         replica=r, start_index=start_index + (k - start_index) % n, stride=n,
                         trainer_at=start_index, ends=False, **self._make)
            for k, r in enumerate(self.live)]

  @property
  def link(self) -> Link:
    """The session's (train/roles/link.py)."""
    return self.workers[0].link

  def _drop(self, lost: GeneratorLost) -> None:
    """The dead generator's batches, and the others', dealt again over the others, from the
    batch the trainer waits for."""
    self.live.remove(lost.replica)
    self.dropped.append(lost.replica)
    for worker in self.workers:
      if worker.replica != lost.replica:
        worker.close()
    self.link.end()
    log.warning("generator %d is dropped; from batch %d on the batches are dealt over "
                "generators %s", lost.replica, self._next, self.live)
    self.workers = self._start(Link(self._split), self._next, [None] * len(self.live))

  @property
  def version(self) -> int:
    return self._version

  def get(self) -> RolloutBatch:
    while True:
      try:
        batch = self.workers[self._next % len(self.workers)].get()
      except GeneratorLost as lost:
        self._drop(lost)
        continue
      self._next = batch.index + 1
      return batch

  def update_weights(self, params, version: int) -> None:
    self._params, self._version = params, version  # (a dropped generator's successors start so)
    for worker in self.workers:  # (each learns which batch the trainer takes next)
      worker.update_weights(params, version, taken=self._next)

  @contextlib.contextmanager
  def paused(self):
    """Every generator's run state, nested by replica (None once one was dropped: their
    states are not those of the run's N generators)."""
    with contextlib.ExitStack() as stack:
      try:
        states = [] if self.dropped else [stack.enter_context(w.paused()) for w in self.workers]
      except GeneratorLost as lost:
        stack.close()  # (the ones paused already resume)
        self._drop(lost)
      yield None if self.dropped else WorkerState(
          {f"replica{r}": s.arrays for r, s in enumerate(states)},
          {"replicas": [s.meta for s in states]})

  def close(self) -> None:
    for worker in self.workers:
      worker.close()
    self.link.end()


def _per_replica(state: WorkerState | None, n: int) -> list:
  """A checkpoint's generator state, one per replica (ConfigError: saved by another count)."""
  if state is None:
    return [None] * n
  metas = state.meta.get("replicas")
  saved = len(metas) if metas else 1
  if saved != n:
    raise ConfigError(f"config.placement.sampler_replicas: the checkpoint's generator state "
                      f"comes from {saved} generator(s), this run has {n}; resume with "
                      f"--config.placement.sampler_replicas={saved}")
  if metas is None:
    return [state]
  return [WorkerState(state.arrays[f"replica{r}"], m) for r, m in enumerate(metas)]
