"""Multi-host start-up: join `jax.distributed` before anything touches a device.

  auto      on a TPU pod or under Slurm with several tasks, `jax.distributed.initialize()`
            detects the coordinator, the process count and this process's id itself;
  explicit  otherwise from `DistributedConfig` or the environment (JAXRL_COORDINATOR,
            JAXRL_NUM_PROCESSES, JAXRL_PROCESS_ID), e.g. 2 processes on 127.0.0.1 on a CPU, with
            gloo collectives.
A peer that dies is detected by the coordination service's heartbeat, so the survivors stop with
an error after `heartbeat_timeout_s` instead of hanging.
"""
from __future__ import annotations

import dataclasses
import os

import jax


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  coordinator: str = ""  # host:port of process 0; empty = auto-detect or single process
  num_processes: int = 1
  process_id: int = 0
  initialization_timeout_s: int = 120
  heartbeat_timeout_s: int = 30


def _auto_detectable() -> bool:
  slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1
  tpu_pod = len(os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",")) > 1
  return slurm or tpu_pod


def from_env(cfg: DistributedConfig = DistributedConfig()) -> DistributedConfig:
  env = os.environ
  return dataclasses.replace(
      cfg, coordinator=env.get("JAXRL_COORDINATOR", cfg.coordinator),
      num_processes=int(env.get("JAXRL_NUM_PROCESSES", cfg.num_processes)),
      process_id=int(env.get("JAXRL_PROCESS_ID", cfg.process_id)))


def initialize(cfg: DistributedConfig | None = None) -> bool:
  """Joins the job; returns True when more than one process takes part."""
  cfg = from_env(cfg or DistributedConfig())
  timeouts = dict(initialization_timeout=cfg.initialization_timeout_s,
                  heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
  if cfg.coordinator:
    if not 0 <= cfg.process_id < cfg.num_processes:
      raise ValueError(f"distributed.process_id: {cfg.process_id} not in [0, {cfg.num_processes})")
    if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id, **timeouts)
  elif _auto_detectable():
    jax.distributed.initialize(**timeouts)
  return jax.process_count() > 1
