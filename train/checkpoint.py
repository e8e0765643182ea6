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

  def __init__(self, run_dir: str, phase: str, keep: int, *, directory: str | None = None):
    """`run_dir/checkpoints/phase`, or an existing checkpoint `directory` (read-only use)."""
    self.directory = os.path.abspath(directory or os.path.join(run_dir, "checkpoints", phase))
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                                             create=directory is None))

  def save(self, step: int, params: nnx.State, extra: dict | None = None) -> None:
    """Saves the actor's parameters (pure dict) and small metadata; asynchronous."""
    self._manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(nnx.to_pure_dict(params)),
        meta=ocp.args.JsonSave(dict(extra or {}))))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def restore_params(self, abstract_params: nnx.State, step: int | None = None) -> nnx.State:
    """Restores into `abstract_params`' structure; leaves that are arrays or carry a
    `.sharding` are restored straight into that sharding (any device count)."""
    step = self.latest_step() if step is None else step
    abstract_params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        abstract_params)
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


def load_params(directory: str, like: nnx.State) -> tuple[nnx.State, int]:
  """The latest params saved under `directory` (e.g. a run's checkpoints/sft), laid out like
  `like`; ValueError naming the directory when there is none or it does not fit the model."""
  if not os.path.isdir(directory):
    raise ValueError(f"config.init_checkpoint: no such directory {directory!r}")
  ckpt = Checkpointer("", "", 1, directory=directory)
  try:
    step = ckpt.latest_step()
    if step is None:
      raise ValueError(f"config.init_checkpoint: no checkpoint under {directory!r}")
    _check_shapes(os.path.join(ckpt.directory, str(step), "params"), like, directory, step)
    try:
      return ckpt.restore_params(like, step), step
    except (ValueError, KeyError, TypeError) as e:
      text = str(e).strip()
      first = text.splitlines()[0] if text else type(e).__name__
      raise ValueError(f"config.init_checkpoint: {directory!r} step {step} does not fit this "
                       f"model ({first})") from None
  finally:
    ckpt.close()


def _shapes(tree) -> dict[str, tuple]:
  flat = jax.tree_util.tree_leaves_with_path(tree)
  return {"/".join(str(getattr(k, "key", k)) for k in path): tuple(x.shape) for path, x in flat}


def _check_shapes(params_dir: str, like: nnx.State, directory: str, step: int) -> None:
  """Names the first parameter whose saved shape differs from the model's (before orbax reads)."""
  metadata = ocp.StandardCheckpointer().metadata(params_dir)
  saved = _shapes(getattr(metadata, "item_metadata", metadata))  # StepMetadata in newer orbax
  want = _shapes(nnx.to_pure_dict(like))
  for name in sorted(set(saved) | set(want)):
    if saved.get(name) != want.get(name):
      raise ValueError(f"config.init_checkpoint: {directory!r} step {step} does not fit this "
                       f"model: {name} is {saved.get(name, 'missing')} there, "
                       f"{want.get(name, 'missing')} here")
