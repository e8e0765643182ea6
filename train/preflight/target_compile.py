"""`--dry_run --target=v5p-64`: the run's programs compiled by the target's own compiler before a
chip is rented, allocating nothing.

JAX describes a TPU slice that is not here (`jax.experimental.topologies`, libtpu's compiler on
this CPU); the run's roles are built abstractly on its devices (`RoleCluster(initialize=False)`,
the placement over its hosts) and every program of an RL step is lowered from
ShapeDtypeStructs and compiled for them (the programs' platform choices follow the target:
jaxrl/platform.py). Per program XLA reports, for each device, its argument, output,
temporary and code bytes and its FLOPs and bytes accessed; the device's peak during the program
adds what else stays there through a step (the dry run's table: train/preflight/dry_run.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.compilation_cache.compilation_cache import reset_cache

from train.preflight import compile_guard, dry_run, hlo_flops
from jaxrl import platform
from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.models import flops
from jaxrl.models.attention import attention_impl
from planner.targets import Target
from train.preflight.target_generation import generation
from train.preflight.target_push import push_bucket
from sampler.engine import Rollout
from sharding.host import tpu_chips_here
from sharding.placement import host_count, host_major_devices
from sharding.rules import batch_ways
from train.loop.experience import Experience
from train.loop.scoring import Scoring
from train.roles.cluster import RoleCluster
from train.stages.rl import learners

GIB = 1 << 30
S = jax.ShapeDtypeStruct


@dataclasses.dataclass
class Program:
  """One program of an RL step: `lower()` gives it lowered for the target; `state`: its
  arguments that stay on the devices through a step (already in the dry run's table)."""
  name: str
  phase: str  # the dry run's phase it runs in (programs of one phase run at the same time)
  mesh: Any
  lower: Callable[[], Any]
  state: Any = None
  kernel_flops: float = 0.0  # per device and piece, in Pallas kernels XLA's count misses
  jaxrl_flops: float = 0.0  # jaxrl's count of the rest, per device and piece (0: not counted)
  pieces: int = 1  # pieces of `rl.pass_rows` rows one call runs (a scoring pass, an update)
  # Programs of one phase and step run at the same time; a phase's steps one after another
  step: int = 0


@dataclasses.dataclass
class Compiled:
  program: Program
  memory: Any  # jax's CompiledMemoryStats, per device
  cost: dict  # XLA's cost analysis (a loop's body counted once)
  seconds: float  # compiling it, on this machine
  products: float  # matrix-product FLOPs per device of one call, each loop as often as it runs
  unknown_loops: int  # loops of data-dependent length among them (counted once: a decode loop)

  @property
  def bytes(self) -> int:
    """What the program holds on one device at its peak: arguments, outputs not aliased to
    them, temporaries, code."""
    m = self.memory
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes + m.generated_code_size_in_bytes)

  @property
  def flops(self) -> float:
    """FLOPs per device of one call: its matrix products and the Pallas kernels' (jaxrl's
    count: XLA sees nothing inside a kernel)."""
    return self.products + self.program.kernel_flops * self.program.pieces

  @property
  def jaxrl_flops(self) -> float:
    """jaxrl's count of the same (0: not counted)."""
    p = self.program
    return (p.jaxrl_flops + p.kernel_flops) * p.pieces if p.jaxrl_flops else 0.0


def topology_devices(target: Target) -> list:
  """The target slice's devices, host-major, from the TPU compiler installed here."""
  if importlib.util.find_spec("libtpu") is None:
    raise ConfigError('--target: compiling for a TPU needs libtpu here: pip install -e ".[tpu]" '
                      '(it is in the test extras)')
  if not tpu_chips_here():  # no TPU VM metadata to ask: libtpu is told so, and stays quiet;
    # no chip to guard, so other processes (tests, a second compile) may load libtpu too
    for name, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                        ("TPU_WORKER_ID", "0"), ("TPU_ACCELERATOR_TYPE", "v5litepod-4"),
                        ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
      os.environ.setdefault(name, value)
  from jax.experimental import topologies
  kwargs = {"chip_config_name": "megacore"} if target.generation == "v4" else {}
  desc = topologies.get_topology_desc(platform="tpu", topology_name=target.topology_name,
                                      **kwargs)
  return host_major_devices(desc.devices)


def _per_piece(cfg: ExperimentConfig, role, total: float) -> float:
  """`total` FLOPs of one piece (`rl.pass_rows` rows: a loop body of a scoring pass or an
  update) per device of `role`'s mesh."""
  return total / (batch_ways(role.mesh, role.rules) * role.mesh.shape.get("tensor", 1))


def _splash_flops(cfg: ExperimentConfig, role, passes: int, shared: bool = True) -> float:
  """Attention FLOPs per device of one piece of a pass, in the splash kernel: XLA's cost
  analysis counts a Pallas kernel as nothing. `passes`: forward 1, update 3 (its backward
  twice the forward), 4 under remat=full (the forward recomputed); `shared`: a pass that runs
  each prompt once for `rl.share_group` rows (flops.shared_attention_flops) where > 1."""
  if attention_impl(cfg.model) != "splash":
    return 0.0
  p, n, m, g = cfg.data.max_prompt_tokens, cfg.rl.rollout.max_new_tokens, cfg.model, \
      cfg.rl.share_group
  if shared and g > 1:
    attention = flops.shared_attention_flops(m, cfg.rl.pass_rows // g, p, g, n)
  else:
    attention = flops.attention_flops(m, cfg.rl.pass_rows * (p + n), (p + n + 1) / 2,
                                      flops.causal_keys(p + n, m.attention.sliding_window))
  return _per_piece(cfg, role, passes * attention)


def _counted(cfg: ExperimentConfig, role, kernel: float, adapters: int, update: bool) -> float:
  """jaxrl's FLOPs (jaxrl/models/flops.py) of one piece per device, less the kernel's
  `kernel`. `adapters`: LoRA parameters the role's forward runs (trained in an update)."""
  rows, n = cfg.rl.pass_rows, cfg.rl.rollout.max_new_tokens
  t = cfg.data.max_prompt_tokens + n
  total = (flops.executed_train_flops(cfg.model, rows, t, n, lora_params=adapters) if update
           else flops.forward_flops(cfg.model, rows, t, n) + 2.0 * adapters * rows * t)
  return _per_piece(cfg, role, total) - kernel


def _adapters(cfg: ExperimentConfig, role) -> int:
  """The LoRA parameters of `role` (0 without LoRA; its trained part is the adapters)."""
  if not cfg.lora.enabled or role.trainable is None:  # (a reference has no adapters)
    return 0
  return sum(x.size for x in jax.tree.leaves(role.split(role.abstract())[0]))


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: S(x.shape, x.dtype, sharding=s), tree, shardings)


def _shapes(cfg: ExperimentConfig) -> tuple[int, int, int]:
  """(rows B, completion slots N, sequence T) of a step's batch at its longest (no trimming)."""
  n = cfg.rl.rollout.max_new_tokens
  return cfg.rl.rollouts, n, cfg.data.max_prompt_tokens + n


def abstract_experience(cfg: ExperimentConfig, role) -> Experience:
  """The abstract batch an RL update gets, split over the mesh's batch axes."""
  b, n, t = _shapes(cfg)
  rl, f32 = cfg.rl, S((b, n), jnp.float32)
  gae = rl.trains_critic
  masked = rl.dapo.overlong_filter or rl.environment.name  # a loss mask beside the completions'
  exp = Experience(tokens_BT=S((b, t), jnp.int32), valid_BT=S((b, t), bool),
                   completion_mask_BN=S((b, n), bool), sampler_logprobs_BN=f32,
                   ref_logprobs_BN=f32, advantages_BN=f32,
                   old_logprobs_BN=f32 if rl.carries_old_logprobs else None,
                   old_values_BN=f32 if gae else None, returns_BN=f32 if gae else None,
                   loss_mask_BN=S((b, n), bool) if masked else None)
  return _abstract(exp, role.batch_shardings(exp))


def _pieces(rl, name: str) -> int:
  """The pieces of rows a scoring pass runs in: the update's, or the decode loop's where the
  actor's old log-probs replay it (`rl.rollout.exact="replay"`)."""
  replays = name == "old log-probs" and rl.rollout.exact == "replay"
  return rl.replay_pieces if replays else rl.rollouts // rl.pass_rows


def _scoring(cfg: ExperimentConfig, cluster: RoleCluster, actor, critic) -> list[Program]:
  """The scoring passes, as Scoring jits them, and the experience they make."""
  rl, b = cfg.rl, cfg.rl.rollouts
  _, n, t = _shapes(cfg)
  scoring = Scoring(rl, cluster, actor, critic, judge=None, executors=None)
  programs = []

  def batch(role):
    arrays = (S((b, t), jnp.int32), S((b, t), bool), S((b, n), bool))
    return _abstract(arrays, role.batch_shardings(arrays))
  # (the [B, T] passes: a packed pass's rows depend on the lengths a rollout has)
  ref_fn, old_fn = scoring.logprob_fns[False]
  passes = [("reference log-probs", cluster.get("reference"), ref_fn)]
  # (exact sync rollouts: to check, before evaluations; a replay of the engine's schedule runs
  # the generator's in-flight programs, lowered with the generation)
  if rl.carries_old_logprobs and not rl.replays_engine:
    passes.append(("old log-probs", actor.role, old_fn))
  if critic is not None:
    passes.append(("values", critic.role, scoring.values_fn))
  for name, role, fn in passes:
    kernel = _splash_flops(cfg, role, 1)
    counted = 0.0 if name == "values" else _counted(cfg, role, kernel, _adapters(cfg, role),
                                                    update=False)
    programs.append(Program(name, "scoring", role.mesh,
                            lambda fn=fn, role=role: fn.lower(role.abstract(), *batch(role)),
                            role.abstract(), kernel, counted, _pieces(rl, name)))
  if scoring.reward_model is not None:
    rm = scoring.reward_model
    programs.append(Program("reward-model scores", "scoring", rm.mesh, lambda: scoring.scores_fn
                            .lower(rm.abstract(), *batch(rm)), rm.abstract(),
                            _splash_flops(cfg, rm, 1, shared=False)))
  role, f32 = actor.role, S((b, n), jnp.float32)
  rollout = Rollout(tokens_BT=S((b, t), jnp.int32), valid_BT=S((b, t), bool),
                    completion_mask_BN=S((b, n), bool), logprobs_BN=f32,
                    lengths_B=S((b,), jnp.int32))
  per_row = _abstract((rollout, S((b,), jnp.float32), f32, f32, f32),
                      role.batch_shardings((rollout, S((b,), jnp.float32), f32, f32, f32)))
  rollout, rewards, old, ref, values = per_row
  args = (rollout, rewards, old if rl.carries_old_logprobs else None, ref,
          values if critic is not None else None)
  programs.append(Program("experience", "experience", role.mesh,
                          lambda: scoring.experience_fn.lower(*args)))
  return programs


def _updates(cfg: ExperimentConfig, actor, critic) -> list[Program]:
  """The RL update (micro-batches, remat, LoRA as configured) and the critic's."""
  programs = []
  for name, learner in (("actor update", actor), ("critic update", critic)):
    if learner is not None:
      batch = abstract_experience(cfg, learner.role)
      role = learner.role
      kernel = _splash_flops(cfg, role, 4 if cfg.model.layers.remat == "full" else 3)
      counted = (_counted(cfg, role, kernel, _adapters(cfg, role), update=True)
                 if name == "actor update" else 0.0)
      programs.append(Program(name, name, role.mesh,
                              lambda learner=learner, batch=batch: learner.lower(batch),
                              (role.abstract(), learner.abstract_state()), kernel, counted,
                              cfg.rl.rollouts // cfg.rl.pass_rows))
  return programs


def rl_programs(cfg: ExperimentConfig, cluster: RoleCluster) -> list[Program]:
  """Every program of one sync RL step, to lower for the cluster's devices."""
  for name in ("reference",) + ("critic",) * cfg.rl.trains_critic + (
      ("reward",) if cfg.rl.reward == "reward_model" else ()):
    if cluster.get(name) is None:
      cluster.add(name, initialize=False)
  actor, critic = learners(cfg.rl, cluster.actor, cluster.get("critic"), initialize=False)
  mesh = cluster.meshes["sampler"]
  programs = [Program(name, "generation", mesh, lower, state, step=i)
              for i, (name, lower, state) in enumerate(generation(cfg, cluster))]
  programs += _scoring(cfg, cluster, actor, critic)
  programs += _updates(cfg, actor, critic)
  weights = cluster.sampler_weights
  if weights.merging:  # LoRA, lora.sampler=merged: the adapters folded in before the push
    programs.append(Program("LoRA merge (weight push)", "weight push", cluster.actor.mesh,
                            lambda: weights.merge.lower(cluster.actor.abstract()),
                            cluster.actor.abstract()))
  if dry_run.pushed_mirror(cluster) is not None and (push := push_bucket(cfg, cluster)):
    name, lower, sources = push  # (after the LoRA merge, whose output it moves)
    programs.append(Program(name, "weight push", cluster.actor.mesh, lower, sources, step=1))
  return programs


def compile_program(program: Program, memo: dict | None = None) -> Compiled:
  """`program` compiled by the target's compiler; a program it refuses is a ConfigError naming
  the program and the compiler's first line. `memo`: programs compiled before, by their lowered
  text and devices (plans that differ only in the update compile the rest once)."""
  start = time.perf_counter()
  try:
    with no_persistent_cache():  # (a lowering may compile the programs it takes outputs of)
      lowered = program.lower()
      if memo is not None:
        key = (hashlib.sha256(lowered.as_text().encode()).hexdigest(),
               tuple(d.id for d in program.mesh.devices.flat))
        if key in memo:
          return dataclasses.replace(memo[key], program=program)
      compiled = lowered.compile()
  except Exception as e:  # noqa: BLE001  (XlaRuntimeError, Mosaic errors, ...)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    hosts = host_count(program.mesh.devices.flat)
    if "replica group" in first and hosts > 1:  # seen with part of each of several hosts
      first += (f" (its mesh spans {hosts} hosts: this compiler refuses collectives over part "
                f"of each of several hosts' chips; a placement giving the role whole hosts "
                f"compiles)")
    raise ConfigError(f"--target: the compiler refused {program.name}: {first}") from None
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  products, unknown = hlo_flops.executed_flops(compiled.as_text())
  out = Compiled(program, compiled.memory_analysis(), dict(cost), time.perf_counter() - start,
                 products, unknown)
  if memo is not None:
    memo[key] = out
  return out


def phase_peaks(compiled: list[Compiled], resident: dict, phases: dict) -> dict[str, dict]:
  """{phase: {device id: bytes}}: on each device of a phase's programs, what stays through the
  step, what `placement.offload` brings back for the phase and the mirror a push makes (the
  dry run's tables, less the programs' own arguments, which they count) plus the programs of
  the phase's step together (they run at the same time); of a phase's steps, which run in turn,
  the largest."""
  stays, steps = dry_run.summed(resident), {}
  onloaded = {p: dry_run.summed({k: v for k, v in items.items()  # (data the phase holds)
                                 if k.endswith("(onloaded)") or k == dry_run.PUSHED})
              for p, items in phases.items()}
  for c in compiled:
    state = dry_run.shard_bytes(c.program.state) if c.program.state is not None else {}
    per_device = steps.setdefault((c.program.phase, c.program.step), {})
    for d in c.program.mesh.devices.flat:
      own, held = per_device.get(d.id, (0, 0))
      per_device[d.id] = (own + c.bytes, held + state.get(d.id, 0))
  back = lambda phase, d: stays.get(d, 0) + onloaded.get(phase, {}).get(d, 0)
  out = {}
  for (phase, _), v in steps.items():
    peak = out.setdefault(phase, {})
    for d, (own, held) in v.items():
      peak[d] = max(peak.get(d, 0), max(0, back(phase, d) - held) + own)
  return out


@contextlib.contextmanager
def no_persistent_cache():
  """The persistent compilation cache off: its entries are this host's executables, which a
  compiler without a client (a target's) can neither load nor usefully store."""
  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  reset_cache()  # whether the cache is used is decided once per process: decided again
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", before)
    reset_cache()


@dataclasses.dataclass
class TargetRun:
  """A run's programs compiled for a target, with the dry run's tables for the same placement."""
  cfg: ExperimentConfig
  target: Target
  hosts: int
  meshes: dict  # {role: {axis: size}} (axes of size 1 left out)
  compiled: list[Compiled]
  peaks: dict  # {phase: {device id: bytes}}: the compiler's (phase_peaks)
  estimate: dict  # {phase: {device id: bytes}}: the dry run's, for the same devices
  cluster: Any
  resident: dict

  def worst(self) -> tuple[str, int]:
    """(phase, bytes) of the busiest device of the worst phase, the compiler's."""
    return max(((p, max(v.values())) for p, v in self.peaks.items()), key=lambda x: x[1])


def compile_run(cfg: ExperimentConfig, target: Target, memo: dict | None = None) -> TargetRun:
  """Every program of the run compiled for `target`, each said on stderr as it starts and ends
  (minutes each at a real size: a later one may not finish); `memo` as for compile_program."""
  devices = topology_devices(target)
  with platform.building_for("tpu"):
    cluster, resident, phases = dry_run.tables(cfg, devices)
    programs = rl_programs(cfg, cluster)
    compiled = []
    size = lambda n: f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"
    for p in programs:  # (the supervisor names the one it was on if the compiler dies)
      print(f"{compile_guard.PROGRESS}{p.name}", file=sys.stderr, flush=True)
      compiled.append(c := compile_program(p, memo))
      m = c.memory
      print(f"jaxrl: dry run: compiled {p.name} in {c.seconds:.0f} s: per device "
            f"{size(m.argument_size_in_bytes)} of arguments, {size(m.temp_size_in_bytes)} of "
            f"temporaries", file=sys.stderr, flush=True)
  meshes = {role: {a: n for a, n in mesh.shape.items() if n > 1} or {"data": 1}
            for role, mesh in cluster.meshes.items()}
  return TargetRun(cfg, target, host_count(devices), meshes, compiled,
                   phase_peaks(compiled, resident, phases), estimates(resident, phases), cluster,
                   resident)


def estimates(resident: dict, phases: dict) -> dict[str, dict]:
  """{phase: {device id: bytes}}: the dry run's, what stays plus the phase's items."""
  stays = dry_run.summed(resident)
  return {p: {d: stays.get(d, 0) + v for d, v in dry_run.summed(items).items()}
          for p, items in phases.items()}
