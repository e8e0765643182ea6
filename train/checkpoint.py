"""Orbax checkpoints under `run_dir/checkpoints/PHASE`: atomic, keep-N, never overwriting a good one.

Each phase (sft, rl) has its own manager, so keep-N garbage collection of RL checkpoints never
removes the SFT warm start.
"""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from flax import nnx


class Checkpointer:

  def __init__(self, run_dir: str, phase: str, keep: int):
    self.directory = os.path.abspath(os.path.join(run_dir, "checkpoints", phase))
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def save(self, step: int, params: nnx.State, extra: dict | None = None) -> None:
    """Saves the actor's parameters (pure dict) and small metadata; asynchronous."""
    self._manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(nnx.to_pure_dict(params)),
        meta=ocp.args.JsonSave(dict(extra or {}))))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def restore_params(self, abstract_params: nnx.State, step: int | None = None) -> nnx.State:
    step = self.latest_step() if step is None else step
    restored = self._manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(nnx.to_pure_dict(abstract_params))))
    params = jax.tree.map(lambda x: x, abstract_params)
    nnx.replace_by_pure_dict(params, restored["params"])
    return params

  def restore_meta(self, step: int | None = None) -> dict:
    step = self.latest_step() if step is None else step
    return dict(self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
