"""Multi-host start-up: join `jax.distributed` before anything touches a device.

  auto      on a TPU pod or under Slurm with several tasks, `jax.distributed.initialize()`
            detects the coordinator, the process count and this process's id itself;
  explicit  otherwise from `DistributedConfig` or the environment (JAXRL_COORDINATOR,
            JAXRL_NUM_PROCESSES, JAXRL_PROCESS_ID), e.g. 2 processes on 127.0.0.1 on a CPU, with
            gloo collectives. JAXRL_HEARTBEAT_S sets the heartbeat timeout.
A peer that dies is detected by the coordination service's heartbeat, so the survivors stop with
an error after `heartbeat_timeout_s` instead of hanging.

Arrays cross between meshes on disjoint processes (sharding/crossing.py) through the backend's
transfer server; on the CPU it needs a socket of its own per process: JAXRL_TRANSFER_ADDRESS
(host:port), by default this host's address at the coordinator's port + 1 + the process id.
`agree` gives every caller process 0's value of a small decision (save now? stop? the run's
timestamp) through the coordination service's key-value store: no device takes part, so the
processes of another role group, busy with their own programs, never have to join.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import socket
import threading

import jax


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  coordinator: str = ""  # host:port of process 0; empty = auto-detect or single process
  num_processes: int = 1
  process_id: int = 0
  initialization_timeout_s: int = 120
  heartbeat_timeout_s: int = 30
  transfer_address: str = ""  # host:port of this process's transfer server (CPU); "" = derived


def _auto_detectable() -> bool:
  slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1
  tpu_pod = len(os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",")) > 1
  return slurm or tpu_pod


def from_env(cfg: DistributedConfig = DistributedConfig()) -> DistributedConfig:
  env = os.environ
  return dataclasses.replace(
      cfg, coordinator=env.get("JAXRL_COORDINATOR", cfg.coordinator),
      num_processes=int(env.get("JAXRL_NUM_PROCESSES", cfg.num_processes)),
      process_id=int(env.get("JAXRL_PROCESS_ID", cfg.process_id)),
      transfer_address=env.get("JAXRL_TRANSFER_ADDRESS", cfg.transfer_address),
      heartbeat_timeout_s=int(env.get("JAXRL_HEARTBEAT_S", cfg.heartbeat_timeout_s)))


def transfer_address(cfg: DistributedConfig) -> str:
  """This process's transfer-server socket: the configured one, or this host's address (the
  loopback where the coordinator is on it) at the coordinator's port + 1 + the process id."""
  if cfg.transfer_address:
    return cfg.transfer_address
  host, port = cfg.coordinator.rsplit(":", 1)
  if host not in ("127.0.0.1", "localhost"):
    host = socket.gethostbyname(socket.gethostname())
  return f"{host}:{int(port) + 1 + cfg.process_id}"


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
      jax.config.update("jax_cross_host_transfer_socket_address", transfer_address(cfg))
    jax.distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id, **timeouts)
  elif _auto_detectable():
    jax.distributed.initialize(**timeouts)
  return jax.process_count() > 1


def kv_client():
  """The coordination service's key-value store (this job's; None on one process)."""
  from jax._src import distributed  # the client jax.distributed.initialize made
  return distributed.global_state.client


class Job:
  """The job this process joined, as jaxrl uses its coordination service: the key-value store
  and the sequences every process of the job counts alike, in the same order: each name's
  `agree` calls, and the sessions of async generator workers (train/rollout/remote.py). Its
  lifetime is JAX's coordination client's, which is the process's: `job()` gives the one of the
  current client (a new one after jax.distributed restarts)."""

  def __init__(self, client):
    self.client = client
    self._agreed: collections.Counter = collections.Counter()  # per name: calls so far
    self._sessions = itertools.count()
    self._lock = threading.Lock()

  def agree(self, value, name: str, *, timeout_s: int = 3600):
    """Process 0's `value` (JSON) on every process that calls this, in the same order."""
    with self._lock:
      n = self._agreed[name]
      self._agreed[name] += 1
    key = f"jaxrl/agree/{name}/{n}"
    if jax.process_index() == 0:
      self.client.key_value_set(key, json.dumps(value))
      if n >= 64:  # (taken long ago: every caller takes them in order, between the same steps)
        self.client.key_value_delete(f"jaxrl/agree/{name}/{n - 64}")
      return value
    return json.loads(self.client.blocking_key_value_get(key, timeout_s * 1000))

  def next_session(self) -> int:
    """The number of the next worker session (both process groups start them in one order)."""
    with self._lock:
      return next(self._sessions)


_JOINED: list[Job] = []  # the current client's Job, the one process-wide holder (`job`)
_JOINING = threading.Lock()


def job() -> Job | None:
  """The job of the current coordination client (None on one process)."""
  client = kv_client() if jax.process_count() > 1 else None
  if client is None:
    return None
  with _JOINING:  # (two threads asking first make one Job: its counts are the job's)
    if not _JOINED or _JOINED[0].client is not client:
      _JOINED[:] = [Job(client)]
    return _JOINED[0]


def agree(value, name: str, *, timeout_s: int = 3600):
  """Process 0's `value` (JSON) on every process that calls this, in the same order (the job's
  `agree`); on one process, `value`."""
  joined = job()
  return value if joined is None else joined.agree(value, name, timeout_s=timeout_s)


def loopback_port(processes: int) -> int:
  """A coordinator port on 127.0.0.1 whose `processes` following ports (the transfer servers'
  sockets, `transfer_address`) are free as well."""
  for _ in range(100):
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    try:
      for p in range(port, port + processes + 1):
        with socket.socket() as s:
          s.bind(("127.0.0.1", p))
      return port
    except OSError:
      continue
  raise RuntimeError(f"no {processes + 1} free consecutive ports on 127.0.0.1")
