"""Executors: named workers, one per role, each running its calls on its own thread.

`submit(fn, *args) -> Future`: calls to one executor run one at a time, in submission order (they
share that role's devices); different executors run concurrently, so independent stages such as
reward scoring, reference log-probs and critic values overlap (interleaving). Every call is a busy
interval on the timeline; a failure surfaces as `ExecutorError` naming the executor, with the
original exception as its cause. `inline=True` runs calls in the caller's thread, in program
order: where several processes hold the trainer's meshes, each must launch the same programs in
the same order (JAX's multi-controller model), which concurrent threads cannot promise.
"""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import jax

from train.io.timeline import Timeline


class ExecutorError(RuntimeError):
  """An executor's call failed; `executor` names it, `__cause__` is the original error."""

  def __init__(self, executor: str, error: BaseException):
    super().__init__(f"{executor} executor failed: {type(error).__name__}: {error}")
    self.executor = executor


class Executor:

  def __init__(self, name: str, timeline: Timeline, devices=(), *, inline: bool = False):
    """`devices`: where the role's calls run (they count towards the timeline's bubble)."""
    self.name, self._timeline = name, timeline
    self._pool = (None if inline else
                  concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"jaxrl-{name}"))
    timeline.register(name, [d.id for d in devices])

  def submit(self, fn: Callable[..., Any], *args, label: str = "",
             **kwargs) -> concurrent.futures.Future:
    """Runs `fn(*args, **kwargs)` on this executor."""

    def call():
      with self._timeline.span(self.name, label or self.name):
        # Blocking here makes the busy interval the real device time, not the dispatch.
        return jax.block_until_ready(fn(*args, **kwargs))

    if self._pool is not None:
      return self._pool.submit(call)
    future = concurrent.futures.Future()
    try:
      future.set_result(call())
    except Exception as e:  # noqa: BLE001 - raised by result(), with the executor named
      future.set_exception(e)
    return future

  def result(self, future: concurrent.futures.Future, timeout: float | None = None):
    try:
      return future.result(timeout)
    except ExecutorError:
      raise
    except Exception as e:  # noqa: BLE001 - re-raised with the executor named
      raise ExecutorError(self.name, e) from e

  def __call__(self, *args, **kwargs):
    return self.result(self.submit(*args, **kwargs))

  def close(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)


class Executors:
  """The RL loop's executors, one per role: sampler (the sampler's mesh: generation), reward
  (the host verifier, and the reward model's mesh when the reward comes from one), reference,
  critic (when there is one) and trainer (actor + critic updates and the weight push)."""

  def __init__(self, cluster, timeline: Timeline, *, reward_model: bool, critic_mesh=None):
    # Several processes holding these meshes must launch the same programs in the same order
    inline = len(cluster.process_group()[1]) > 1
    ex = lambda name, mesh: Executor(name, timeline, () if mesh is None else mesh.devices.flat,
                                     inline=inline)
    # (the sampler's own processes' devices where it has some: its busy time comes from there)
    sampler = ([cluster.meshes["sampler"]] if cluster.split is None else cluster.split.replicas)
    self.sampler = Executor("sampler", timeline, [d for m in sampler for d in m.devices.flat],
                            inline=inline)
    self.reward = ex("reward", cluster.meshes["reward"] if reward_model else None)
    self.reference = ex("reference", cluster.split.scorer if "reference" in cluster.apart
                        else cluster.meshes["reference"])  # (apart: its own processes' devices)
    self.critic = None if critic_mesh is None else ex("critic", critic_mesh)
    self.trainer = ex("trainer", cluster.meshes["actor"])

  def close(self) -> None:
    for ex in (self.sampler, self.reward, self.reference, self.critic, self.trainer):
      if ex is not None:
        ex.close()
