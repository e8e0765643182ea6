"""`placement.strategy = "plan"`: the planner picks the placement a run uses.

The search runs over what `sharding/placement.make_placement` builds, in the config's RL mode
(async changes the algorithm's data, so the planner never switches it), keeping a micro-batch
size and a remat (`model.layers.remat` other than "none") the user set; otherwise the plan sets
both.
The device's factors come from `placement.calibration` (a JSON file written by `jaxrl-plan
--calibrate`) or else the built-in table for the device kind.
"""
from __future__ import annotations

import dataclasses
import logging

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.models.config import from_fields
from planner.calibrate import Calibration
from planner.cost import Mesh, Plan, Workload, forward_s, update_s
from planner.devices import CPU_EFFICIENCY, DEVICES, Efficiency
from planner.search import Ranked, search

log = logging.getLogger("jaxrl")

# Substrings of `jax.Device.device_kind` -> DEVICES keys, most specific first.
DEVICE_KINDS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("v6", "tpu_v6e"),
                ("v5 lite", "tpu_v5e"), ("v5e", "tpu_v5e"), ("v5", "tpu_v5p"), ("v4", "tpu_v4"))


def device_key(device) -> str:
  """The DEVICES entry for a jax device ('' when there is none)."""
  if device.platform == "cpu":
    return "cpu"
  kind = device.device_kind.lower()
  return next((key for sub, key in DEVICE_KINDS if sub in kind), "")


def builtin_calibration(key: str) -> Calibration:
  """A DEVICES entry with its default factors: fitted on this project's CPU, public figures
  for accelerators (planner/devices.py)."""
  return Calibration(DEVICES[key], CPU_EFFICIENCY if key == "cpu" else Efficiency())


def calibration_for(cfg: ExperimentConfig, device, local_devices: int,
                    slice_devices: int = 0) -> Calibration:
  path = cfg.placement.calibration
  if path:
    try:
      cal = Calibration.load(path)
    except (OSError, ValueError, TypeError, KeyError) as e:
      raise ConfigError(f"config.placement.calibration: cannot read {path!r} ({e})") from None
  else:
    key = device_key(device)
    if not key:
      raise ConfigError(
          f"config.placement.strategy: 'plan' has no device table for {device.device_kind!r}; "
          f"write one with `jaxrl-plan --calibrate FILE` and set placement.calibration=FILE")
    cal = builtin_calibration(key)
  try:
    return dataclasses.replace(cal, device=dataclasses.replace(
        cal.device, devices_per_node=local_devices, slice_devices=slice_devices))
  except ValueError as e:
    raise ConfigError(f"config.placement.strategy: 'plan' on several slices: {e}") from None


def slice_devices(devices) -> int:
  """Devices per TPU slice where `devices` span several (Multislice: `slice_index`), else 0."""
  slices = {getattr(d, "slice_index", 0) for d in devices}
  return len(devices) // len(slices) if len(slices) > 1 else 0


def choose(cfg: ExperimentConfig, devices, hosts: int = 1) -> tuple[ExperimentConfig, Ranked]:
  """`cfg` with the best plan's placement, micro-batch size and remat filled in, and that
  plan."""
  cal = calibration_for(cfg, devices[0], len(devices) // hosts, slice_devices(devices))
  workload = Workload.from_config(cfg, cal.device.platform)
  ranked = search(workload, len(devices), cal.device, cal.efficiency, modes=(cfg.rl.schedule.mode,),
                  top=None, staleness=cfg.rl.schedule.max_staleness)
  if cfg.rl.batching.micro_batch_size:
    ranked = [r for r in ranked if r.plan.micro_batch_size == cfg.rl.batching.micro_batch_size]
  if cfg.model.layers.remat != "none":
    ranked = [r for r in ranked if r.plan.remat == cfg.model.layers.remat]
  if not ranked:
    raise ConfigError(f"config.placement.strategy: 'plan' found no placement of this model on "
                      f"{len(devices)} {cal.device.name} devices that fits in memory and splits "
                      f"the batches; choose colocate, interleave or separate")
  best = ranked[0]
  log.info("placement plan: %s, predicted %.3g s per RL step (%s)", best.plan.describe(),
           best.step_s, best.reason)
  return applied(cfg, best.plan), best


def applied(cfg: ExperimentConfig, plan: Plan) -> ExperimentConfig:
  """`cfg` with `plan`'s placement, micro-batch size, remat and offload."""
  placement = dataclasses.replace(cfg.placement, strategy=plan.strategy,
                                  train_devices=plan.trainer.size if plan.strategy != "colocate"
                                  else cfg.placement.train_devices,
                                  sampler_tensor=plan.sampler.tensor,
                                  offload="all" if plan.offload else cfg.placement.offload)
  rl = dataclasses.replace(cfg.rl, batching=dataclasses.replace(
      cfg.rl.batching, micro_batch_size=plan.micro_batch_size))
  model = from_fields({"layers.remat": plan.remat}, base=cfg.model)
  return dataclasses.replace(cfg, placement=placement, rl=rl, model=model)


def share_prefix(cfg: ExperimentConfig, device) -> ExperimentConfig:
  """`cfg` with `rl.batching.share_prefix="auto"` decided: "on" where the cost model prices the
  step's scoring passes (reference, old log-probs) and update faster with each prompt run once
  for its rows (planner/cost.py, on one device of the run's kind: the FLOPs against the
  passes' fixed costs), else "off"."""
  key = device_key(device) or "cpu"
  cal = calibration_for(cfg, device, 1) if cfg.placement.calibration else builtin_calibration(key)
  def seconds(choice: str) -> float:
    rl = dataclasses.replace(cfg.rl, batching=dataclasses.replace(cfg.rl.batching,
                                                                  share_prefix=choice))
    w = Workload.from_config(dataclasses.replace(cfg, rl=rl), cal.device.platform)
    return (2 * forward_s(w, cal.device, cal.efficiency, Mesh())
            + update_s(w, cal.device, cal.efficiency, Mesh()))
  on, off = seconds("on"), seconds("off")
  choice = "on" if on < off else "off"
  log.info("rl.batching.share_prefix=auto: %s (the scoring passes and update priced %.3g s "
           "shared, %.3g s not, on %s)", choice, on, off, cal.device.name)
  return dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, batching=dataclasses.replace(
      cfg.rl.batching, share_prefix=choice)))
