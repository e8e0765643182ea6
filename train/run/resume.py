"""The run state of an Experiment: what a checkpoint saves, and putting it back.

`snapshot` gathers every model's parameters, the current stage's learners and arrays, and the
JSON meta. `latest_good` restores the newest checkpoint that reads back whole and returns it as a
`Resumed` value, which the Experiment takes; one that does not read back (a truncated file, a
partial write) is reported in one line, moved aside to `run_dir/checkpoints_unreadable/` (so
later saves at its step are not refused and no later resume tries it again) and the one before
it is used. A checkpoint that reads back but does not fit the config (another model size, a
learner the config no longer has) is a ConfigError, not a reason to start over. Models restore
first, straight into their roles' shardings; then the stage starts in the abstract (it may read
data that depends on the restored models, e.g. DPO's pairs) and its learners, arrays and
progress restore into it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import jax
from flax import nnx

from jaxrl.config import ConfigError, first_line
from train.io.checkpoint import RunCheckpointer, shapes
from train.stages import Stage
from train.stages.context import RunContext

log = logging.getLogger("jaxrl")


@dataclasses.dataclass(frozen=True)
class Resumed:
  """What a checkpoint puts back, for the Experiment to take."""
  stages: dict[str, Stage]  # the run's stages: the checkpoint's restored into, the others new
  position: int  # the index of the stage to run next
  summary: dict  # the run summary as saved (the stages before the checkpoint's hold theirs)
  metrics_rows: int  # how many metrics rows the checkpoint covers


def snapshot(ctx: RunContext, stage: Stage, summary: dict,
             metrics_rows: int) -> tuple[dict, dict, dict | None]:
  """(orbax items, meta, metrics for keep-the-best) at `stage`'s current step; `summary`: the run
  summary so far."""
  p = stage.progress
  roles = {name: role for name, role in ctx.cluster.roles.items()
           if name not in ctx.cluster.shared}  # a shared role is the actor's: rebuilt from it
  items = {name: nnx.to_pure_dict(role.params) for name, role in roles.items()}
  learners = {} if p.finished else stage.learners()
  items.update({f"learner_{name}": l.checkpoint_state() for name, l in learners.items()})
  arrays = {} if p.finished else stage.arrays()
  if arrays:
    items["stage"] = arrays
  saved = p.snapshot()
  # A copy: orbax writes the JSON later, on its own thread, while the run goes on.
  meta = json.loads(json.dumps({
      "stage": stage.name, "done": saved["done"], "finished": saved["finished"],
      "state": {} if p.finished else stage.state(), "models": sorted(roles),
      "learners": sorted(learners), "last_eval": saved["last_eval"],
      "last_eval_step": saved["last_eval_step"], "summary": summary,
      "metrics_rows": metrics_rows}))
  metrics = None
  if p.last_eval_step == p.done and "heldout_acc" in p.last_eval:
    metrics = {"heldout_acc": p.last_eval["heldout_acc"]}
  return items, meta, metrics


def _check_models_fit(ckpt, where: str, stage_name: str, step: int, abstract: dict) -> None:
  """ConfigError naming the first model array whose saved shape this config does not have."""
  saved = ckpt.item_shapes(stage_name, step, abstract)
  for name, tree in abstract.items():
    if name not in saved:  # damage, not another config: the meta lists the models it saved
      raise FileNotFoundError(f"{where}: its {name} item is missing")
    have, want = saved[name], shapes(ckpt.saved_like(stage_name, step, name, tree))
    for path in sorted(set(have) | set(want)):
      if have.get(path) != want.get(path):
        raise ConfigError(f"{where} does not fit this config: {name}/{path} is "
                          f"{have.get(path, 'missing')} there, {want.get(path, 'missing')} here")


def _restore(ckpt: RunCheckpointer, ctx: RunContext, stages: dict[str, Stage], stage_name: str,
             step: int) -> Resumed:
  cluster, where = ctx.cluster, f"checkpoints/{stage_name}/{step}"
  meta = ckpt.read_meta(stage_name, step)
  roles = {name: cluster.get(name) or cluster.add(name, initialize=False)
           for name in meta["models"]}
  abstract = {name: nnx.to_pure_dict(role.abstract()) for name, role in roles.items()}
  _check_models_fit(ckpt, where, stage_name, step, abstract)
  restored = ckpt.restore(stage_name, step, abstract)
  for name, role in roles.items():  # (a failed attempt makes them abstract again: _reset)
    params = role.abstract()
    nnx.replace_by_pure_dict(params, restored[name])
    role.adopt(params)
  stage = stages[stage_name]
  if not meta["finished"]:
    stage.start(restoring=True)  # may read data that depends on the models (DPO's pairs)
    learners = stage.learners()
    if sorted(learners) != meta["learners"]:
      raise ConfigError(f"{where} holds learners {meta['learners']}, this config's "
                        f"{stage_name} stage has {sorted(learners)}")
    abstract = {f"learner_{name}": l.abstract_state() for name, l in learners.items()}
    arrays = stage.abstract_arrays(meta["state"])
    if arrays:
      abstract["stage"] = arrays
    restored = ckpt.restore(stage_name, step, abstract)
    for name, learner in learners.items():
      learner.load_state(restored[f"learner_{name}"])
    stage.restore(meta["state"], restored.get("stage", {}))
  stage.load_progress(meta)
  at = list(stages).index(stage_name)
  return Resumed(stages, at + 1 if meta["finished"] else at, meta["summary"],
                 meta["metrics_rows"])


def _reset(ctx: RunContext, stages: dict[str, Stage]) -> None:
  """Undoes a failed restore attempt: its stages closed, no roles beyond an abstract actor."""
  for stage in stages.values():
    stage.close()
  cluster = ctx.cluster
  for name in list(cluster.roles):
    if name != "actor":
      del cluster.roles[name]
  cluster.shared.clear()
  cluster.sampler_weights.drop()
  cluster.actor.release()


def _move_aside(ckpt: RunCheckpointer, run_dir: str, stage_name: str, step: int) -> str:
  """Moves an unreadable checkpoint out of its stage's directory (process 0; kept for a look)."""
  ckpt.close()  # its managers list the steps once; they reopen on next use
  target = os.path.join(run_dir, "checkpoints_unreadable",
                        f"{stage_name}-{step}-{time.strftime('%Y%m%d-%H%M%S')}")
  if jax.process_index() == 0:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.replace(os.path.join(ckpt.root, stage_name, str(step)), target)
  return target


def latest_good(ckpt: RunCheckpointer, ctx: RunContext, kinds: dict[str, type[Stage]],
                saved: list[tuple[str, int]]) -> Resumed | None:
  """The newest of `saved` that reads back, restored into new stages of `kinds` (the run's,
  in order); None when none does (the actor is then abstract)."""
  for stage_name, step in saved:
    stages = {name: kind(ctx) for name, kind in kinds.items()}
    try:
      resumed = _restore(ckpt, ctx, stages, stage_name, step)
    except ConfigError:
      raise
    except Exception as e:  # noqa: BLE001 - any failure to read back marks the checkpoint bad
      _reset(ctx, stages)
      target = _move_aside(ckpt, ctx.run_dir, stage_name, step)
      log.warning("checkpoints/%s/%d cannot be restored (%s: %s); moved to %s, trying the one "
                  "before it", stage_name, step, type(e).__name__, first_line(e), target)
      continue
    log.info("resumed from checkpoints/%s/%d", stage_name, step)
    return resumed
  log.warning("no checkpoint could be restored: starting the run afresh")
  return None
