"""The run's layout, worked out once at start-up and passed down: the config with the planner's
choice filled in (`placement.strategy="plan"`), the placement on this job's devices (each role's
devices, mesh and process group: sharding/placement.py) and, where some groups stand on
processes of their own, those processes (sharding/crossing.py `ProcessSplit`). The CLI reads it
to know what this process serves (train/run/apart.py), the experiment to know which processes
save checkpoints, and the cluster builds the roles on its meshes.
"""
from __future__ import annotations

import dataclasses
import logging

from jax.sharding import Mesh

from jaxrl.config import ConfigError, ExperimentConfig
from sharding.crossing import ProcessSplit, process_split
from sharding.placement import (ROLES, Placement, PlacementError, host_count,
                                host_major_devices, make_placement)

log = logging.getLogger("jaxrl")


@dataclasses.dataclass(frozen=True)
class Layout:
  cfg: ExperimentConfig  # the planner's choice filled in
  placement: Placement
  devices: tuple  # host-major: this job's, or a target topology's
  split: ProcessSplit | None  # None: every process runs every program
  plan: object = None  # planner/search.py `Ranked` where the planner chose

  def meshes(self) -> dict[str, Mesh]:
    """Each role's mesh as placed (the sampler's: its first generator's)."""
    return {role: self.placement.mesh(role, self.devices) for role in ROLES}

  def describe(self) -> str:
    """The placement in one line, with the planner's reasons where it chose."""
    placement = self.placement.describe()
    if self.plan is None:
      return placement
    return (f"{placement} (planner: {self.plan.plan.describe()}, predicted "
            f"{self.plan.step_s:.3g} s per RL step: {self.plan.reason})")


def layout(cfg: ExperimentConfig, devices=None) -> Layout:
  """`cfg`'s layout on `devices` (default: this job's); a ConfigError, naming the field, for a
  placement that cannot work or a mode it cannot run."""
  devices = tuple(host_major_devices(devices))
  plan = None
  if cfg.placement.strategy == "plan":  # (a fixed table: every process chooses alike)
    from planner.plan import choose
    cfg, plan = choose(cfg, list(devices), host_count(devices))
  if cfg.rl.batching.share_prefix == "auto":  # (priced alike on every process)
    from planner.plan import share_prefix
    cfg = share_prefix(cfg, devices[0])
  try:
    placement = placement_for(cfg, devices)
    out = Layout(cfg, placement, devices, process_split(placement, list(devices)), plan)
  except PlacementError as e:
    raise config_error(e) from None
  check_processes(out)
  if out.split is not None:
    log.info("process groups: %s; this process serves the %s group", ", ".join(
        f"{g} on processes {sorted(p)}" for g, p in out.split.groups.items()), out.split.here)
  return out


def config_error(e: PlacementError) -> ConfigError:
  """A placement that cannot work, as the user's error naming the config field."""
  message = str(e)
  return ConfigError(f"config.{message}" if message.startswith("placement") else message)


def check_processes(layout: Layout) -> None:
  """Async generation on several processes needs the sampler on processes of its own, and there
  a sync step takes one batch."""
  cfg, devices, split = layout.cfg, layout.devices, layout.split
  mode, hosts = cfg.rl.schedule.mode, host_count(devices)
  if mode == "async" and hosts > 1 and layout.placement.roles["sampler"].group == "trainer":
    local = len(devices) // hosts
    cpu = (f" (on the CPU, placement.cpu_devices={local} per process)"
           if devices[0].platform == "cpu" else "")
    raise ConfigError(
        f"config.rl.schedule.mode: async on {hosts} processes runs the generator on processes of "
        f"its own: placement.strategy='separate' with placement.train_devices a multiple of "
        f"each process's {local} devices{cpu}, from {local} to {len(devices) - local}; got "
        f"{cfg.placement.strategy!r} with train_devices={cfg.placement.train_devices}")
  if mode == "sync" and split is not None and split.generators and cfg.rl.dapo.dynamic_sampling:
    raise ConfigError(
        "config.rl.dapo.dynamic_sampling: the placement gives the sampler processes of its own, "
        "whose sync generation takes one batch a step; use placement.strategy='colocate'")


def placement_for(cfg: ExperimentConfig, devices) -> Placement:
  """The placement preset on `devices` (of as many hosts as they name processes: a target
  topology's, or this job's), its sampler `cfg.sampler_tensor` ways tensor-parallel; with
  `placement.sampler_tensor=0` (auto), 1 way where the model or the sampler's devices do not
  split 2 ways, said in the log."""
  pl, tensor = cfg.placement, cfg.sampler_tensor
  one_network = {(d.platform, getattr(d, "slice_index", 0)) for d in devices} == {("tpu", 0)}
  build = lambda t: make_placement(pl.strategy, len(devices), train_devices=pl.train_devices,
                                   sampler_tensor=t, n_hosts=host_count(devices),
                                   train_fsdp=pl.train_fsdp, one_network=one_network,
                                   replicas=pl.sampler_replicas,
                                   scorers_apart=pl.scorers_apart)
  if pl.sampler_tensor or tensor == 1:
    if not pl.sampler_tensor:
      m = cfg.model
      log.info("placement: the sampler decodes without tensor parallelism (the model's %d "
               "heads, %d KV heads, MLP %d, vocabulary %d do not all split 2 ways; "
               "placement.sampler_tensor sets it)", m.n_heads, m.n_kv_heads, m.d_ff,
               m.vocab_size)
    return build(tensor)
  try:
    return build(tensor)
  except PlacementError:
    placement = build(1)  # (raises what is wrong besides the tensor degree)
    log.info("placement: the sampler decodes without tensor parallelism (its devices do not "
             "split 2 ways; placement.sampler_tensor sets it)")
    return placement
