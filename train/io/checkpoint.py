"""Run-state checkpoints: `run_dir/checkpoints/STAGE/STEP`, one orbax CheckpointManager per stage.

A checkpoint holds everything needed to continue the run, one orbax item each: every model's
parameters (`actor`, `reference`, `reward`, `critic`: pure dicts), the current stage's learners
(`learner_actor`, ...: optimizer state and step counter), the stage's own arrays (`stage`, e.g.
DPO's reference log-probs) and `meta` (JSON: the stage, its steps done (for RL, the policy
version), its data position, its last evaluation, the finished stages' summaries, how many
metrics rows it covers). Items restore one by
one, each array straight into the sharding its abstract leaf carries. Saves are asynchronous and atomic (orbax writes a temporary
directory and renames it when complete, so a run killed mid-save leaves the previous checkpoint
as the latest). Each stage keeps its last `keep` checkpoints plus the best by held-out accuracy,
so the end of every stage stays on disk (`init_checkpoint=RUN/checkpoints/sft` starts another
run from it).
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxrl.config import first_line
from jaxrl.models.scan import layer_keys, path_keys, stacked_keys
from sharding.reshard import to_device
from train.io import layer_forms
from train.io.host_transfers import HostTransfers

policies = ocp.checkpoint_managers


class CheckpointError(RuntimeError):
  """A save that failed (a full disk, a failing write): which one, why, and which checkpoint
  is intact. The failed one stays a temporary directory that no resume reads."""


class RunCheckpointer:

  def __init__(self, run_dir: str, stages: Sequence[str], *, keep: int = 3,
               transfers: HostTransfers | None = None, processes: set[int] | None = None):
    """`stages`: the run's stage names in order (a resume takes the latest stage first);
    `transfers`: the run's named host transfers, where a save's bytes are counted;
    `processes`: the processes that save (default: all; not the sampler's own)."""
    self.processes = processes
    self.root = os.path.abspath(os.path.join(run_dir, "checkpoints"))
    self.stages, self.keep = tuple(stages), keep
    self.transfers = HostTransfers() if transfers is None else transfers
    self._managers: dict[str, ocp.CheckpointManager] = {}
    self._writing: dict[str, int] = {}  # stage -> the step its save in progress writes

  def _manager(self, stage: str) -> ocp.CheckpointManager:
    if stage not in self._managers:
      keep = policies.AnyPreservationPolicy([
          policies.LatestN(n=self.keep),
          policies.BestN(get_metric_fn=lambda m: m["heldout_acc"], n=1,
                         keep_checkpoints_without_metrics=False)])
      path = os.path.join(self.root, stage)
      os.makedirs(path, exist_ok=True)  # (orbax will not where only some processes save)
      self._managers[stage] = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(
          preservation_policy=keep, cleanup_tmp_directories=True, create=False,
          multiprocessing_options=ocp.options.MultiprocessingOptions(
              active_processes=self.processes)))
    return self._managers[stage]

  def save(self, stage: str, step: int, items: dict, meta: dict,
           metrics: dict | None = None) -> None:
    """Asynchronous: returns once the arrays are copied off the devices. A CheckpointError
    when this save, or the one before it still being written, failed."""
    self._finished(stage)
    try:
      with jax.transfer_guard("allow"):  # a deliberate copy to the host
        args = {name: ocp.args.StandardSave(self._local(tree)) for name, tree in items.items()}
        saved = self._manager(stage).save(step, args=ocp.args.Composite(
            **args, meta=ocp.args.JsonSave(meta)), metrics=metrics)
    except Exception as e:  # noqa: BLE001 - a full disk, a failing write, ...
      raise self._failed(stage, step, e) from e
    if not saved:  # orbax refuses a step at or below one it already has
      raise RuntimeError(f"checkpoints/{stage}/{step} was not saved: the directory already "
                         f"holds step {self._manager(stage).latest_step()}")
    self._writing[stage] = step
    self.transfers.count("checkpoint", sum(x.nbytes for x in jax.tree.leaves(items)))

  def _finished(self, stage: str) -> None:
    """Waits for `stage`'s save in progress; a CheckpointError if it failed."""
    if stage not in self._managers:
      return
    try:
      self._managers[stage].wait_until_finished()
    except Exception as e:  # noqa: BLE001 - what the background write raised
      raise self._failed(stage, self._writing.pop(stage, None), e) from e
    self._writing.pop(stage, None)

  def _failed(self, stage: str, step: int | None, error: Exception) -> CheckpointError:
    good = [f"checkpoints/{s}/{n}" for s, n in self.saved()]
    return CheckpointError(
        f"checkpoints/{stage}/{step if step is not None else '?'}: the save failed "
        f"({type(error).__name__}: {first_line(error)}); "
        + (f"{good[0]} is intact" if good else "no earlier checkpoint exists"))

  def saved(self) -> list[tuple[str, int]]:
    """Every (stage, step) on disk, newest first."""
    out = []
    for stage in reversed(self.stages):
      if os.path.isdir(os.path.join(self.root, stage)):
        out += [(stage, step) for step in sorted(self._manager(stage).all_steps(), reverse=True)]
    return out

  def item_shapes(self, stage: str, step: int, items) -> dict[str, dict[str, tuple]]:
    """{item: {array path: shape}} of the saved `items`, read from their metadata."""
    out = {}
    for name in items:
      path = os.path.join(self.root, stage, str(step), name)
      if os.path.isdir(path):
        out[name] = shapes(_item_metadata(path))
    return out

  def read_meta(self, stage: str, step: int) -> dict:
    restored = self._manager(stage).restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))
    return dict(restored["meta"])

  def restore(self, stage: str, step: int, abstract: dict) -> dict:
    """The items named in `abstract` (name -> abstract tree), each array straight into the
    sharding its abstract leaf carries. An item saved with the decoder's blocks in the other
    form (per layer, or stacked: `model.layers.scan`) is read in its own and converted on the
    devices (train/io/layer_forms.py)."""
    targets = {name: self.saved_like(stage, step, name, tree) for name, tree in abstract.items()}
    args = {name: ocp.args.StandardRestore(self._local(tree)) for name, tree in targets.items()}
    with jax.transfer_guard("allow"):
      restored = self._manager(stage).restore(step, args=ocp.args.Composite(**args))
      if self._one_of_several:  # host arrays onto the shardings
        restored = {name: to_device(restored[name],
                                    jax.tree.map(lambda a: a.sharding, targets[name]))
                    for name in abstract}
      return {name: restored[name] if targets[name] is tree else
              layer_forms.from_disk(restored[name], tree) for name, tree in abstract.items()}

  def saved_like(self, stage: str, step: int, name: str, tree):
    """Abstract `tree` of item `name` as it was saved: itself, or where the decoder's blocks
    are in the other form on disk, the saved structure (`layer_forms.disk_target`)."""
    return _saved_like(os.path.join(self.root, stage, str(step), name), tree)

  @property
  def _one_of_several(self) -> bool:
    return self.processes is not None and len(self.processes) == 1

  def _local(self, tree):
    """`tree` as orbax takes it from these processes: where one process of several saves,
    its arrays (local to it, which orbax refuses in a multi-process job) as host arrays, and
    abstract arrays as host-array targets."""
    if not self._one_of_several:
      return tree
    host = lambda x: (np.empty(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else
                      np.asarray(x) if isinstance(x, jax.Array) else x)
    return jax.tree.map(host, tree)

  def wait(self) -> None:
    for stage in list(self._managers):
      self._finished(stage)

  def close(self) -> None:
    """Finishes the saves in progress (a CheckpointError if one failed) and releases the
    managers either way."""
    try:
      self.wait()
    finally:
      for manager in self._managers.values():
        try:
          manager.close()
        except Exception:  # noqa: BLE001 - the failure, if any, was raised by wait
          pass
      self._managers.clear()


def _saved_like(item_dir: str, tree):
  want = layer_forms.form(tree)
  if not want or not os.path.isdir(item_dir):
    return tree
  metadata = _item_metadata(item_dir)
  have = layer_forms.form(metadata)
  return layer_forms.disk_target(tree, metadata) if have and have != want else tree


def load_actor_params(directory: str, like: nnx.State, *, step: int | None = None,
                      what: str = "config.init_checkpoint") -> tuple[nnx.State, int]:
  """The actor's parameters of a checkpoint under a stage directory (e.g. a run's
  checkpoints/sft; the latest unless `step`), laid out like `like` (abstract arrays with
  shardings); ValueError naming `what` and the directory when there is none or it does not fit
  the model."""
  if not os.path.isdir(directory):
    raise ValueError(f"{what}: no such directory {directory!r}")
  manager = ocp.CheckpointManager(os.path.abspath(directory))
  try:
    step = manager.latest_step() if step is None else step
    if step is None or step not in manager.all_steps():
      raise ValueError(f"{what}: no checkpoint{'' if step is None else f' {step}'} under "
                       f"{directory!r}")
    where = f"{what}: {directory!r} step {step}"
    pure, item = nnx.to_pure_dict(like), os.path.join(manager.directory, str(step), "actor")
    try:
      target = _saved_like(item, pure)  # (the other form of the blocks: model.layers.scan)
    except ValueError as e:
      raise ValueError(f"{where} does not fit this model ({first_line(e)})") from None
    _check_shapes(item, target, where)
    try:
      with jax.transfer_guard("allow"):
        restored = manager.restore(step, args=ocp.args.Composite(
            actor=ocp.args.StandardRestore(target)))["actor"]
        if target is not pure:
          restored = layer_forms.from_disk(restored, pure)
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"{where} does not fit this model ({first_line(e)})") from None
    params = jax.tree.map(lambda x: x, like)
    nnx.replace_by_pure_dict(params, restored)
    return params, step
  finally:
    manager.close()


def saved_actor_shapes(directory: str, step: int | None = None) -> dict[str, tuple]:
  """`shapes` of the actor a stage directory's checkpoint holds (the latest unless `step`;
  {} when there is none)."""
  manager = ocp.CheckpointManager(os.path.abspath(directory))
  try:
    step = manager.latest_step() if step is None else step
    item = os.path.join(manager.directory, str(step), "actor")
    if step is None or not os.path.isdir(item):
      return {}  # (load_actor_params says what is missing)
    return shapes(_item_metadata(item))
  finally:
    manager.close()


def _item_metadata(item_dir: str):
  """The array metadata tree of one saved item (no arrays are read)."""
  from etils import epath
  metadata = ocp.PyTreeCheckpointHandler().metadata(epath.Path(item_dir))
  return getattr(metadata, "tree", metadata)


def shapes(tree) -> dict[str, tuple]:
  """{"decoder/blocks/0/attn/wk": shape, ...} of a pure-dict tree (arrays or their metadata)."""
  flat = jax.tree_util.tree_leaves_with_path(tree)
  return {"/".join(str(getattr(k, "key", k)) for k in path): tuple(x.shape) for path, x in flat}


def _check_shapes(item_dir: str, pure_like: dict, where: str) -> None:
  """Names the first actor parameter whose saved shape differs from the model's."""
  if not os.path.isdir(item_dir):
    raise ValueError(f"{where} holds no actor parameters")
  saved = shapes(_item_metadata(item_dir))
  want = shapes(pure_like)
  for name in sorted(set(saved) | set(want)):
    if saved.get(name) != want.get(name):
      raise ValueError(f"{where} does not fit this model: {name} is "
                       f"{saved.get(name, 'missing')} there, {want.get(name, 'missing')} here")


def params_fingerprint(params: nnx.State, transfers: HostTransfers | None = None) -> str:
  """A hash of the parameters' names, shapes, dtypes and bytes: equal fingerprints mean
  bit-identical weights, whatever their layout (two runs compare without loading checkpoints).
  The parameters' bytes come to the host as `transfers`' "fingerprint"."""
  transfers = HostTransfers() if transfers is None else transfers
  digest = hashlib.sha256()
  for name, x, layer in sorted(_per_layer(params), key=lambda item: item[0]):
    one = x if layer is None else x[layer]  # (sliced on the devices, one at a time)
    value = np.ascontiguousarray(transfers.to_host(one, "fingerprint"))
    digest.update(f"{name}:{value.shape}:{value.dtype}".encode())
    digest.update(value.tobytes())
  return digest.hexdigest()[:16]


def _per_layer(params: nnx.State) -> list[tuple[str, jax.Array, int | None]]:
  """(name, array, layer or None) of each parameter, a scanned decoder's stacked ones per layer
  under the unrolled model's names (jaxrl/models/scan.py): a fingerprint does not depend on
  the form."""
  out = []
  for path, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(params)):
    if not stacked_keys(path_keys(path)):
      out.append((jax.tree_util.keystr(path), x, None))
      continue
    out += [(jax.tree_util.keystr(layer_keys(path, jax.tree_util.DictKey(i))), x, i)
            for i in range(x.shape[0])]
  return out
