"""Multi-host start-up: join `jax.distributed` before anything touches a device.

  auto      on a TPU pod or under Slurm with several tasks, `jax.distributed.initialize()`
            detects the coordinator, the process count and this process's id itself;
  explicit  otherwise from `DistributedConfig` or the environment (JAXRL_COORDINATOR,
            JAXRL_NUM_PROCESSES, JAXRL_PROCESS_ID), e.g. 2 processes on 127.0.0.1 on a CPU, with
            gloo collectives. JAXRL_HEARTBEAT_S sets the heartbeat timeout.
A peer that dies is detected by the coordination service's heartbeat. The job is joined
recoverable (`jax_enable_recoverability`: the service no longer aborts every survivor with a C++
check failure), and `PeerWatch` asks the service every half second which processes are alive:
one that is gone without having said it leaves (`leave`, at a normal end) is reported by the
caller's `lost(process)` (the CLI's line names it and the --resume command) and the survivor
exits, within `heartbeat_timeout_s` of the death instead of hanging, unless the dead processes
are one generator replica's of several: the others drop it and go on (`Job.drop`).

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
import functools
import itertools
import json
import os
import random
import socket
import sys
import threading
import time
from collections.abc import Callable

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


def initialize(cfg: DistributedConfig | None = None, resume: str = "") -> bool:
  """Joins the job; returns True when more than one process takes part. `resume`: the command
  that continues the run, for a survivor's line when a peer is gone (`said_lost`)."""
  cfg = from_env(cfg or DistributedConfig())
  timeouts = dict(initialization_timeout=cfg.initialization_timeout_s,
                  heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
  if cfg.coordinator or _auto_detectable():
    jax.config.update("jax_enable_recoverability", True)  # (PeerWatch stops the survivors)
  if cfg.coordinator:
    if not 0 <= cfg.process_id < cfg.num_processes:
      raise ValueError(f"distributed.process_id: {cfg.process_id} not in [0, {cfg.num_processes})")
    if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
      jax.config.update("jax_cross_host_transfer_socket_address", transfer_address(cfg))
    jax.distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id, **timeouts)
  elif _auto_detectable():
    jax.distributed.initialize(**timeouts)
  if jax.process_count() == 1:
    return False
  job().watch = PeerWatch(kv_client(), jax.process_count(),
                          functools.partial(said_lost, resume=resume))
  return True


LOST_EXIT = 1  # a survivor's exit code
LOST_KEY = "jaxrl/lost"  # the dead process the first survivor to notice named


def said_lost(process: int, resume: str = "") -> None:
  """A survivor's one line: the dead process, its role group where known, and the command that
  continues the run."""
  joined = job()
  group = joined.groups.get(process) if joined is not None else None
  print(f"jaxrl: error: process {process}" + (f" ({group})" if group else "")
        + " of the job stopped answering (it died, or its host was lost); this process stops too"
        + (f". Saved checkpoints are intact; continue with the same command on every process: "
           f"{resume}" if resume else ""), file=sys.stderr, flush=True)


class PeerWatch:
  """The job's processes watched from a thread: every `poll_s` the coordination service says
  which are alive; the first one gone that did not `leave` is passed to `lost`, and this process
  exits at once (its main thread may be stuck in a collective with the dead one)."""

  def __init__(self, client, processes: int, lost: Callable[[int], None], poll_s: float = 0.5):
    self.client, self.processes, self.lost, self.poll_s = client, processes, lost, poll_s
    self._done = threading.Event()
    self._lost = threading.Event()
    self._waited = False  # (lost_within)
    threading.Thread(target=self._watch, name="jaxrl-peer-watch", daemon=True).start()

  def _left(self) -> set[int]:
    return {int(key.rsplit("/", 1)[1]) for key, _ in self.client.key_value_dir_get("jaxrl/left/")}

  def _gone(self) -> list[int]:
    """The processes gone without leaving, the one a survivor named first (`LOST_KEY`) first."""
    live = self.client.get_live_nodes(list(range(self.processes)))
    gone = [p for p in range(self.processes) if p not in live]
    if not gone:
      return []
    gone = [p for p in gone if p not in self._left()]
    named = [int(v) for _, v in self.client.key_value_dir_get(LOST_KEY + "/")]
    return sorted(gone, key=lambda p: p not in named)

  def _watch(self) -> None:
    while not self._done.wait(self.poll_s):
      try:
        gone = self._gone()
      except Exception:  # noqa: BLE001 - the service itself is gone (process 0 died) or closing
        gone = [] if self._done.is_set() else [0]
      joined = job()
      if joined is not None:  # (a dropped generator's processes are no longer watched)
        gone = [p for p in gone if joined.replicas.get(p, -1) not in joined.dropped]
        if gone and joined.drop(gone):
          continue  # a generator replica of several: the others take its batches over
      if gone and not self._done.is_set():
        self._lost.set()
        try:
          self.lost(gone[0])
          self.client.key_value_set(LOST_KEY + "/first", str(gone[0]), allow_overwrite=True)
          self.leave(wait_s=self.poll_s * 8)  # (process 0: the others read the service first)
        except Exception:  # noqa: BLE001 - the service is gone too: nothing left to tell
          pass
        finally:
          os._exit(LOST_EXIT)

  def leave(self, wait_s: float = 120.0) -> None:
    """This process ends (normally, or after a lost peer): the others are not to take its going
    for a death. It waits (at most `wait_s`) until every other process has left or is gone, as
    JAX's shutdown barrier would (which a recoverable job skips): process 0 holds the
    coordination service, and a peer may still be pulling arrays this one sent."""
    if self._done.is_set() and not self._lost.is_set():
      return
    self._done.set()
    deadline, me, said = time.monotonic() + wait_s, jax.process_index(), False
    while time.monotonic() < deadline:
      try:
        if not said:
          self.client.key_value_set(f"jaxrl/left/{me}", "1", allow_overwrite=True)
          said = True
        live = set(self.client.get_live_nodes(list(range(self.processes))))
        left = self._left()
      except Exception:  # noqa: BLE001 - the service is gone (process 0 went): nobody to wait for
        return
      # (process 0 goes last, once the others have shut their clients down: its service's end
      # would abort a peer still saying goodbye to it)
      if live <= left and (me != 0 or live <= {0}):
        return
      time.sleep(self.poll_s / 2)

  def lost_within(self, seconds: float) -> None:
    """Returns if no peer's loss is noticed within `seconds`; else the watch ends this process
    (this call does not return): for a main thread whose collective failed, to tell a dead
    peer from a bug. Waits once: an error passed up through several callers is not waited
    for again."""
    if self._waited:
      return
    self._waited = True
    if self._lost.wait(seconds):
      time.sleep(60)  # (the watch's exit comes first)
      os._exit(LOST_EXIT)


STOP_KEY = "jaxrl/stop"


def post_stop(name: str) -> None:
  """Any process's stop request (its SIGTERM) where the trainer's first process looks for it
  (`posted_stop`); a no-op on one process."""
  if kv_client() is not None:
    kv_client().key_value_set(STOP_KEY, name, allow_overwrite=True)


def posted_stop() -> str | None:
  """The signal's name another process of the job posted (None: none, or one process)."""
  if kv_client() is None:
    return None
  try:
    return kv_client().key_value_try_get(STOP_KEY)
  except Exception:  # noqa: BLE001 - NOT_FOUND: no process asked
    return None


def explained_by_a_lost_peer() -> None:
  """For an error in a job of several processes (a collective that failed: gloo's "Connection
  reset by peer"): waits as long as the heartbeat takes to notice a dead peer, in which case
  this process exits with the watch's line instead of the error's traceback."""
  joined = job() if kv_client() is not None else None
  if joined is not None and joined.watch is not None:
    joined.watch.lost_within(from_env().heartbeat_timeout_s + 5)


def from_the_runtime(error: BaseException) -> bool:
  """Whether `error`, or one that caused it, is the runtime's (a collective or a transfer that
  failed: gloo's "Connection reset by peer"), which a dead peer explains."""
  while error is not None:
    if isinstance(error, jax.errors.JaxRuntimeError):
      return True
    error = error.__cause__ or error.__context__
  return False


def leave() -> None:
  """This process of the job ends normally (a no-op on one process)."""
  joined = job()
  if joined is not None and joined.watch is not None:
    joined.watch.leave()


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
    self.watch: PeerWatch | None = None  # (set where the job is joined: `initialize`)
    self.groups: dict[int, str] = {}  # process -> its role group, once the placement is known
    self.replicas: dict[int, int] = {}  # process -> its generator replica, where several
    self.dropped: set[int] = set()  # the generator replicas this process saw die (`drop`)

  def drop(self, gone: list[int]) -> bool:
    """Whether the processes `gone` (dead) are those of one generator replica of several that
    others survive, this process not among them: the replica is dropped (once, with a line),
    its processes no longer watched, and the run goes on (train/rollout/replicas.py deals its
    batches to the others)."""
    with self._lock:
      replicas = {self.replicas.get(p) for p in gone}
      replica = replicas.pop() if len(replicas) == 1 else None
      if replica is not None and replica in self.dropped:
        return True
      left = set(self.replicas.values()) - self.dropped - {replica}
      if replica is None or not left or self.replicas.get(jax.process_index()) == replica:
        return False
      self.dropped.add(replica)
    mates = sorted(p for p, r in self.replicas.items() if r == replica)
    print(f"jaxrl: warning: process {gone[0]} (generator {replica}'s) of the job stopped "
          f"answering; generator {replica} (processes {', '.join(map(str, mates))}) is dropped "
          f"and its batches are dealt to generators {', '.join(map(str, sorted(left)))}",
          file=sys.stderr, flush=True)
    return True

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


def _ephemeral_ports() -> tuple[int, int]:
  """The range the kernel takes a connection's own port from (Linux's; the usual elsewhere)."""
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
      low, high = map(int, f.read().split())
    return low, high
  except (OSError, ValueError):
    return 32768, 60999


def loopback_port(processes: int) -> int:
  """A coordinator port on 127.0.0.1 whose `processes` following ports (the transfer servers'
  sockets, `transfer_address`) are free as well, below the ephemeral range: a port free when
  asked must stay free while the job starts, and its many connections take their own ports
  from that range."""
  low, _ = _ephemeral_ports()
  rng = random.Random()
  for _ in range(200):
    port = rng.randrange(10000, max(10001, low - processes - 1))
    try:
      for p in range(port, port + processes + 1):
        with socket.socket() as s:
          s.bind(("127.0.0.1", p))
      return port
    except OSError:
      continue
  raise RuntimeError(f"no {processes + 1} free consecutive ports on 127.0.0.1")
