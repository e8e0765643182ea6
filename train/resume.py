"""The run state of an Experiment: what a checkpoint saves, and putting it back.

`snapshot` gathers every model's parameters, the current stage's learners and arrays, and the
JSON meta. `latest_good` restores the newest checkpoint that reads back whole; one that does not
(a truncated file, a partial write) is reported in one line and the one before it is used.
Models restore first, straight into their roles' shardings; then the stage starts in the
abstract (it may read data that depends on the restored models, e.g. DPO's pairs) and its
learners and arrays restore into it.
"""
from __future__ import annotations

import logging

from flax import nnx

log = logging.getLogger("jaxrl")


def snapshot(exp, stage) -> tuple[dict, dict, dict | None]:
  """(orbax items, meta, metrics for keep-the-best) of `exp` at `stage`'s current step."""
  ctx = exp.ctx
  ctx.summary[f"{stage.name}_checkpoint_step"] = stage.done
  items = {name: nnx.to_pure_dict(role.params) for name, role in ctx.cluster.roles.items()}
  learners = {} if stage.finished else stage.learners()
  items.update({f"learner_{name}": l.checkpoint_state() for name, l in learners.items()})
  arrays = {} if stage.finished else stage.arrays()
  if arrays:
    items["stage"] = arrays
  meta = {"stage": stage.name, "done": stage.done, "finished": stage.finished,
          "state": stage.state() if not stage.finished else {}, "models": sorted(ctx.cluster.roles),
          "learners": sorted(learners), "summary": ctx.summary,
          "metrics_rows": len(ctx.writer.rows)}
  metrics = None
  if stage.last_eval_step == stage.done and "heldout_acc" in stage.last_eval:
    metrics = {"heldout_acc": stage.last_eval["heldout_acc"]}
  return items, meta, metrics


def _restore(exp, stage_name: str, step: int) -> None:
  ckpt, cluster = exp.checkpointer, exp.ctx.cluster
  meta = ckpt.read_meta(stage_name, step)
  roles = {name: cluster.get(name) or cluster.add(name, initialize=False)
           for name in meta["models"]}
  restored = ckpt.restore(stage_name, step, {name: nnx.to_pure_dict(role.abstract())
                                             for name, role in roles.items()})
  for name, role in roles.items():
    params = role.abstract()
    nnx.replace_by_pure_dict(params, restored[name])
    role.params = params
  stage = exp.stages[stage_name]
  if not meta["finished"]:
    stage.start(restoring=True)
    abstract = {f"learner_{name}": l.abstract_state() for name, l in stage.learners().items()}
    arrays = stage.abstract_arrays(meta["state"])
    if arrays:
      abstract["stage"] = arrays
    restored = ckpt.restore(stage_name, step, abstract)
    for name, learner in stage.learners().items():
      learner.load_state(restored[f"learner_{name}"])
    stage.restore(meta["state"], restored.get("stage", {}))
  stage.started, stage.done, stage.finished = True, meta["done"], meta["finished"]
  exp.ctx.summary = dict(meta["summary"])
  exp.ctx.writer.resume(meta["metrics_rows"])
  at = exp.stage_names.index(stage_name)
  exp.position = at + 1 if stage.finished else at
  exp._last_save = (stage_name, step)


def _reset(exp) -> None:
  """Undoes a failed restore attempt: fresh stage objects, no roles beyond the actor."""
  for stage in exp.stages.values():
    stage.close()
  for name in list(exp.ctx.cluster.roles):
    if name != "actor":
      del exp.ctx.cluster.roles[name]
  exp.stages = {name: type(stage)(exp.ctx) for name, stage in exp.stages.items()}


def latest_good(exp, saved: list[tuple[str, int]]) -> bool:
  """Restores the newest of `saved` that reads back; False when none does."""
  for stage_name, step in saved:
    try:
      _restore(exp, stage_name, step)
    except Exception as e:  # noqa: BLE001 - any failure to read back marks the checkpoint bad
      first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
      log.warning("checkpoints/%s/%d cannot be restored (%s: %s); trying the one before it",
                  stage_name, step, type(e).__name__, first)
      _reset(exp)
      continue
    log.info("resumed from checkpoints/%s/%d", stage_name, step)
    return True
  log.warning("no checkpoint could be restored: starting the run afresh")
  return False
