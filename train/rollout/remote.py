"""The async generator on processes of its own (MPMD): the trainer's processes and the sampler's
run different programs, and meet only where the schedule says.

Where the placement gives the sampler whole processes (`separate` on several hosts,
sharding/placement.py), the sampler's processes run `SamplerHost.serve` instead of the
experiment: the worker of one process (train/rollout/worker.py, partial.py: whole batches or
partial rollouts, either schedule) on the sampler's mesh, driven by requests (start, batch,
weights, pause, resume, close) through the job's request service (train/roles/link.py). The
trainer's processes run the experiment as on one process, with a `RemoteWorker` in the worker's
place; their copy of the sampler's weights, and the evaluation, are on `mirror` of the sampler's
mesh over the trainer's devices (sharding/crossing.py), from where each push crosses as it is.

The generator's first process answers each request with what the trainer needs on the host
(a batch's index, version and token versions; an error), and decides for its group what timing
decides (`Worker.agreed`: which weights a batch or segment decodes with, when a batch opens);
the others take its choices (train/rollout/decisions.py). With several generators
(`placement.sampler_replicas`) each serves its own requests in the one numbering and takes part
in the others' crossings (train/rollout/replicas.py). Only two waits join the groups: the
trainer's for its next batch, and the generator's for a push its schedule says to wait for (the
fixed schedule's). A dead process ends the job through the coordination service's heartbeat,
except one generator of several: it is dropped (replicas.py).
"""
from __future__ import annotations

import contextlib
import logging
import time

import jax
import numpy as np

from sampler.engine import Rollout
from sharding import crossing
from sharding.distributed import from_env, job
from train.roles.link import REPLIED, GroupHost, Link
from train.rollout.batches import RolloutBatch, WorkerState
from train.rollout.decisions import Decisions
from train.rollout.worker import RolloutWorkerError

log = logging.getLogger("jaxrl")


def _state_arrays(state: WorkerState) -> dict:
  arrays = {k: v for k, v in state.arrays.items() if k != "params"}
  if "params" in state.arrays:
    arrays["params"] = crossing.numbered(state.arrays["params"])
  return arrays


def _with_params(arrays: dict, like) -> dict:
  arrays = dict(arrays)
  if "params" in arrays:
    arrays["params"] = crossing.unnumbered(like, arrays["params"])
  return arrays


class GeneratorLost(Exception):
  """A generator replica of several died before it answered (train/rollout/replicas.py deals
  its batches to the others)."""

  def __init__(self, replica: int):
    super().__init__(f"generator {replica} stopped answering")
    self.replica = replica


class RemoteWorker:
  """The trainer's side: what the controller asks of a worker (`get`, `update_weights`,
  `paused`, `close`, `version`), served by the generator's processes."""

  def __init__(self, link: Link, prompts, params, *, version: int, state: WorkerState | None,
               timeline, replica: int = 0, ends: bool = True, **worker):
    """`link`: the session's; `params`: the first weights, on the mirror; `timeline`: where
    the generator's busy intervals go; `replica`: which generator; `ends`: its `close` ends
    the session (the only worker of it); `worker`: the worker's settings (start_index,
    schedule, max_staleness, seed, stride)."""
    self._link, self._prompts, self._version = link, prompts, version
    self._replica, self._ends = replica, ends
    self._timeline = timeline
    self._like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    arrays = {"params": crossing.numbered(params)}
    if state is not None:
      arrays["state"] = _state_arrays(state)
    self._request({"op": "start", "version": version, "worker": worker,
                   "state": None if state is None else state.meta}, arrays)

  @property
  def version(self) -> int:
    return self._version

  @property
  def replica(self) -> int:
    return self._replica

  @property
  def link(self) -> Link:
    return self._link

  def _request(self, message: dict, arrays: dict | None = None) -> dict | None:
    """Posts request n (the first process), sends `arrays` (every process), and returns the
    generator's reply where the request has one."""
    link = self._link
    link.post({**message, "replica": self._replica}, arrays)
    if message["op"] not in REPLIED:
      return None
    lost = lambda: {"lost": self._replica} if self._replica in job().dropped else None  # noqa
    reply = link.reply(RolloutWorkerError, "rollout worker on the generator's processes",
                       poll_s=1.0, instead=lost if jax.process_index() == 0 else None)
    if "lost" in reply:  # (the trainer's first process saw the generator die: every process)
      raise GeneratorLost(self._replica)
    return reply

  def _received(self, reply: dict) -> dict:
    """The reply's arrays, here. One generator of several may die while they cross: they are
    pulled in full first, and where any trainer process failed to, every one raises
    `GeneratorLost` once the peer watch dropped the generator."""
    link = self._link
    home, there = link.ends(self._replica)
    arrays = crossing.receive(reply["arrays"], there, home)
    if len(link.split.replicas) == 1:  # (a dead generator ends the job: the peer watch)
      return arrays
    try:
      jax.block_until_ready(arrays)
      error = None
    except jax.errors.JaxRuntimeError as e:
      error = e
    if link.pulled(error is None):
      return arrays
    deadline = time.monotonic() + from_env().heartbeat_timeout_s + 5
    while self._replica not in job().dropped:
      if time.monotonic() > deadline:  # (not a death: the error, or another process's)
        raise RolloutWorkerError(f"generator {self._replica}'s reply {link.n - 1} did not "
                                 f"arrive on every trainer process") from error
      time.sleep(0.2)
    log.warning("generator %d died while its reply %d crossed", self._replica, link.n - 1)
    raise GeneratorLost(self._replica)

  def get(self) -> RolloutBatch:
    reply = self._request({"op": "batch"})
    if reply.get("exhausted"):
      raise StopIteration
    now = time.perf_counter()  # the generator's busy intervals, as of this reply
    for label, ago_start, ago_end in reply["spans"]:
      self._timeline.add("sampler", label, now - ago_start, now - ago_end)
    versions = reply["versions"]
    return RolloutBatch(Rollout(**self._received(reply)), self._prompts[reply["index"]],
                        reply["version"], reply["index"], reply["seconds"],
                        None if versions is None else np.asarray(versions, np.int32))

  def update_weights(self, params, version: int, taken: int | None = None) -> None:
    self._request({"op": "weights", "version": version, "taken": taken},
                  {"params": crossing.numbered(params)})
    self._version = version

  @contextlib.contextmanager
  def paused(self):
    """The generator's run state, arrays on the trainer's mirror of the sampler's mesh."""
    reply = self._request({"op": "pause"})
    arrays = _with_params(self._received(reply), self._like)
    try:
      yield WorkerState(arrays, reply["meta"])
    finally:
      self._request({"op": "resume"})

  def close(self) -> None:
    self._request({"op": "close"})
    if self._ends:
      self._link.end()


class SamplerHost(GroupHost):
  """The sampler's side: `serve()` runs the workers the trainer starts until it is done."""

  name = "sampler"

  def __init__(self, ctx, make_worker):
    """`ctx`: the run's context on these processes (train/stages/context.py), its cluster
    abstract: what a worker needs (prompts, generator, the sampler's weights' layout);
    `make_worker`: train/rollout/source.py's."""
    split = ctx.cluster.split
    self.replica = self.target = split.replica_of(jax.process_index())  # (its generator)
    super().__init__(split, split.processes(self.replica))
    self.ctx, self._make_worker = ctx, make_worker
    self.several = len(split.processes(self.replica)) > 1
    self.worker, self.decisions = None, None
    self._spans_sent = 0  # the timeline's events the trainer has (its generator's busy time)
    self._held = contextlib.ExitStack()  # a pause the trainer asked for, until it resumes

  def _start(self, request: dict) -> None:
    arrays = self.arrived(request)
    weights = self.ctx.cluster.sampler_weights.abstract()
    params = crossing.unnumbered(weights, arrays["params"])
    state = None
    if request["state"] is not None:
      state = WorkerState(_with_params(arrays["state"], weights), request["state"])
    name = f"{self.link.name}/{self.replica}"
    self.decisions = Decisions(name, self.leader) if self.several else None
    self.worker = self._make_worker(
        self.ctx.cfg, self.ctx.generator, self.ctx.task.prompts, self.ctx.timeline, params,
        prompt_len=self.ctx.task.prompt_len, version=request["version"], state=state,
        decide=self.decisions, **request["worker"])

  def _batch(self, request: dict) -> dict:
    try:
      batch = self.worker.get()
    except StopIteration:
      return {"exhausted": True}
    arrays = {k: v for k, v in vars(batch.rollout).items() if v is not None}
    described = crossing.send(arrays, self.split.mirror)
    spans, self._spans_sent = self.ctx.timeline.since(self._spans_sent, "sampler")
    now = time.perf_counter()  # (the trainer places them before its own now)
    ago = [(label, now - start, now - end) for label, start, end in spans]
    return {"arrays": described, "index": batch.index, "version": batch.version,
            "seconds": batch.seconds, "spans": ago,
            "versions": None if batch.versions_BN is None else batch.versions_BN.tolist()}

  def _weights(self, request: dict) -> None:
    like = self.ctx.cluster.sampler_weights.abstract()
    params = crossing.unnumbered(like, self.arrived(request)["params"])
    self.worker.update_weights(params, request["version"], request["taken"])

  def _pause(self, request: dict) -> dict:
    state = self._held.enter_context(self.worker.paused())
    described = crossing.send(_state_arrays(state), self.split.mirror)
    return {"arrays": described, "meta": state.meta}

  def _resume(self, request: dict) -> None:
    self._held.close()

  def _close(self, request: dict) -> None:
    self._held.close()
    if self.decisions is not None:
      self.decisions.close(self.worker)
    elif self.worker is not None:
      self.worker.close()
    self.worker = self.decisions = None
