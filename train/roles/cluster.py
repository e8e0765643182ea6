"""The cluster: the placement, the RLHF models on their meshes, and the sampler's copy of the actor.

Roles (sharding/placement.py): the actor (trained), the frozen reference, the reward model and
the critic each live on their role's mesh; the sampler holds a copy of the actor in the sampling
layout (`sampler_weights`, train/roles/sampler_weights.py), refreshed after every update. The
reference, reward model and critic exist once a stage has added them (`add`). Batch sizes are
checked here, once, against the real meshes on the real devices.
"""
from __future__ import annotations

import functools
import logging
import os

import jax
from flax import nnx

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.models import lora
from jaxrl.models.dtypes import compute_dtypes, frozen_base_dtypes
from jaxrl.models.value_models import RewardModel, ValueModel
from jaxrl.models.hf import HFError, load_params
from jaxrl.models.transformer import LanguageModel
from sharding.crossing import ProcessSplit, process_split, sampler_apart
from sharding.placement import (ROLES, PlacementError, host_count, host_major_devices,
                                make_placement)
from sharding.rules import SAMPLER_RULES, batch_ways
from train.io.checkpoint import load_actor_params, saved_actor_shapes
from train.io.host_transfers import HostTransfers
from train.roles.role import ModelRole
from train.roles.sampler_weights import SamplerWeights

log = logging.getLogger("jaxrl")
MODEL_CLASSES = {"actor": LanguageModel, "reference": LanguageModel, "reward": RewardModel,
                 "critic": ValueModel}
SCORERS = ("reference", "reward")  # the frozen roles `placement.scorers_apart` moves apart


class RoleCluster:

  def __init__(self, cfg: ExperimentConfig, devices=None, *, initialize: bool = True,
               transfers: HostTransfers | None = None):
    """`initialize=False` leaves the actor abstract (a restore fills it); `transfers`: the
    run's named host transfers (the weight push's)."""
    self.cfg = cfg
    self.devices = host_major_devices() if devices is None else list(devices)
    self._shapes: dict[tuple, tuple] = {}  # traced modules (`_shape`)
    try:  # impossible meshes are user errors, found before anything is allocated
      self.placement = _placement(cfg, self.devices)
      self.meshes = {role: self.placement.mesh(role, self.devices) for role in ROLES}
      self.split = process_split(self.meshes, self.placement.replica_meshes(self.devices))
      if self.split is not None and self.split.generators:  # (the trainer given enough)
        replica = self.split.replica_of(jax.process_index())
        self.meshes["sampler"] = (self.split.mirror if replica is None  # the trainer's copy
                                  else self.split.replicas[replica])  # this generator's
      if self.split is not None and self.split.scorer is not None \
          and self.split.here != "scorer":
        for role in SCORERS:  # the trainer's copies (host memory)
          self.meshes[role] = self.meshes["actor"]
      self.actor = self._actor_role()
      plain = self._shape("actor")[0] if cfg.lora.enabled else None  # without adapters
      self.sampler_weights = SamplerWeights(
          cfg, self.actor, self.meshes["sampler"], plain, transfers,
          mirror=self.split is not None and self.split.generators
          and self.split.here == "trainer")
    except PlacementError as e:
      message = str(e)
      raise ConfigError(f"config.{message}" if message.startswith("placement") else message) \
          from None
    check_processes(cfg, self.split, self.meshes, self.devices)  # (the placement's mode first)
    check_batch_sizes(cfg, self)
    self.roles: dict[str, ModelRole] = {"actor": self.actor}
    self.shared: set[str] = set()  # roles whose parameters are the actor's own arrays
    # roles whose passes run on processes of their own (train/loop/remote_scorers.py)
    self.apart = set(SCORERS) if self.split is not None and self.split.scorer is not None \
        else set()
    if initialize:
      self.initialize_actor()  # the sampler's copy follows on first use (`sampler_weights.fresh`)

  def initialize_actor(self) -> None:
    """The actor's starting weights: `model.hf_path`'s, read slice by slice straight into the
    actor's shardings, or random ones born sharded."""
    if not self.cfg.model.hf_path:
      self.actor.initialize()
      return
    try:
      base = load_params(self.cfg.model.hf_path, self.cfg.model, self.plain(self.actor.abstract()))
    except HFError as e:
      raise ConfigError(str(e)) from None
    self.actor.adopt(self.actor.with_fresh_trained(base) if self.cfg.lora.enabled else base)

  def load_actor(self, directory: str, **kw) -> int:
    """The actor's parameters from a stage checkpoint directory (`load_actor_params`); with
    LoRA, a checkpoint without adapters (a full SFT run's) gives the base, adapters start
    afresh. The checkpoint's step."""
    like = self.actor.abstract()
    saved = (saved_actor_shapes(directory, kw.get("step"))
             if self.cfg.lora.enabled and os.path.isdir(directory) else {})
    fresh = bool(saved) and not any(lora.SUFFIX in k for k in saved)  # saved without adapters
    params, step = load_actor_params(directory, self.plain(like) if fresh else like, **kw)
    self.actor.adopt(self.actor.with_fresh_trained(params) if fresh else params)
    return step

  def model_factory(self, role: str, *, adapters: bool = False):
    """The builder of `role`'s module; `adapters`: with the config's LoRA adapters."""
    extra = {"lora": self.cfg.lora} if adapters else {}
    return lambda: MODEL_CLASSES[role](self.cfg.model, rngs=nnx.Rngs(self.cfg.seed), **extra)

  def _shape(self, role: str, *, adapters: bool = False) -> tuple:
    """(graphdef, abstract state) of `role`'s module, traced once per kind of module: the
    actor's, the reference's and the sampler's plain model are one."""
    key = (MODEL_CLASSES[role], adapters)
    if key not in self._shapes:
      self._shapes[key] = nnx.split(nnx.eval_shape(self.model_factory(role, adapters=adapters)))
    return self._shapes[key]

  def _actor_role(self) -> ModelRole:
    """The actor; with `lora.rank > 0` its adapters are what trains, and its frozen base is
    held in the compute dtype (unless `model.frozen_float32`), as the reference would be."""
    if not self.cfg.lora.enabled:
      return ModelRole("actor", self.model_factory("actor"), self.meshes["actor"],
                       shape=self._shape("actor"))
    stored = None if self.cfg.model.frozen_float32 else functools.partial(frozen_base_dtypes,
                                                                          self.cfg.model)
    return ModelRole("actor", self.model_factory("actor", adapters=True), self.meshes["actor"],
                     stored_dtypes=stored, trainable=lora.TRAINABLE,
                     shape=self._shape("actor", adapters=True))

  def plain(self, params: nnx.State) -> nnx.State:
    """The actor's parameters without its adapters (its frozen base), or all of them."""
    return self.actor.split(params)[1] if self.cfg.lora.enabled else params

  def add(self, name: str, *, initialize: bool = True) -> ModelRole:
    """The `name` role (reference | reward | critic) on its mesh: random weights, or abstract
    when a restore or a `load` fills it."""
    stored = self._reference_dtypes() if name == "reference" else None
    role = ModelRole(name, self.model_factory(name), self.meshes[name], stored_dtypes=stored,
                     shape=self._shape(name))
    if initialize:
      role.initialize()
    self.roles[name] = role
    return role

  def _reference_dtypes(self):
    """The frozen reference in the compute dtype, unless kept float32."""
    if self.cfg.model.frozen_float32:
      return None
    return functools.partial(compute_dtypes, self.cfg.model)

  def add_reference(self, *, restored: bool = False) -> ModelRole:
    """The frozen reference: the actor as it is now, on the reference mesh. With LoRA and
    adapters still at zero (B = 0) that is the actor's frozen base, and where the two layouts
    agree it holds the actor's own arrays (`shared`: no second copy, not saved twice).
    Otherwise a copy of the actor's weights (adapters that earlier stages trained folded in).
    `restored`: a checkpoint without a reference, whose reference was the shared base."""
    role = self.add("reference", initialize=False)
    base = self.plain(self.actor.params)
    is_base = self.cfg.lora.enabled and (restored or self._adapters_at_zero())
    if is_base and self.reference_shares_base(role):
      role.adopt(base)
      self.shared.add("reference")
    else:
      role.load(base if is_base else self.actor_weights())
    return role

  def _adapters_at_zero(self) -> bool:
    """Whether every adapter's B is zero (the adapted model is its base), in one reduction."""
    adapters = self.actor.split(self.actor.params)[0]
    ups = [v[...] for path, v in nnx.to_flat_state(adapters) if path[-1] == "b"]  # B of B A
    return not bool(jax.jit(lambda bs: sum(jax.numpy.any(b != 0) for b in bs))(ups))

  def actor_weights(self) -> nnx.State:
    """The actor's weights as the plain model's (a reference, a critic or a reward model starts
    from them): with LoRA the adapters folded into the base, otherwise its parameters."""
    if not self.cfg.lora.enabled:
      return self.actor.params
    return self.sampler_weights.merge(self.actor.params)

  def reference_shares_base(self, reference: ModelRole) -> bool:
    """Whether `reference` can hold the actor's own base: LoRA, and the same layout (mesh,
    shardings, dtypes)."""
    return (self.cfg.lora.enabled and "reference" not in self.apart
            and jax.tree.leaves(reference.abstract()) == jax.tree.leaves(
                self.plain(self.actor.abstract())))

  def get(self, name: str) -> ModelRole | None:
    return self.roles.get(name)

  def process_group(self) -> tuple[str, frozenset[int]]:
    """This process's group ("trainer", "sampler", or "all" where every process runs every
    program) and its processes."""
    if self.split is None:
      return "all", frozenset(range(jax.process_count()))
    if self.split.here == "scorer":
      return "scorers", self.split.scorer_processes
    replica = self.split.replica_of(jax.process_index())
    if replica is None:
      return "trainer", self.split.trainer_processes
    return ("sampler" if replica == 0 else f"sampler{replica}"), self.split.processes(replica)


def config_split(cfg: ExperimentConfig) -> ProcessSplit | None:
  """The trainer's, the sampler's and the scorers' processes where `cfg`'s placement puts some
  apart (None: together, or a placement that cannot work, which the cluster reports)."""
  devices = host_major_devices()
  try:
    placement = _placement(cfg, devices)
    return process_split({role: placement.mesh(role, devices) for role in ROLES},
                         placement.replica_meshes(devices))
  except PlacementError:
    return None


def check_processes(cfg: ExperimentConfig, split: ProcessSplit | None, meshes: dict,
                    devices) -> None:
  """Async generation on several processes needs the sampler on processes of its own, and there
  a sync step takes one batch."""
  mode, hosts = cfg.rl.schedule.mode, host_count(devices)
  real = (meshes if split is None or not split.generators  # (the sampler's, not a mirror)
          else {**meshes, "sampler": split.replicas[0]})
  if mode == "async" and hosts > 1 and not sampler_apart(real):
    local = len(devices) // hosts
    cpu = (f" (on the CPU, placement.cpu_devices={local} per process)"
           if list(devices)[0].platform == "cpu" else "")
    raise ConfigError(
        f"config.rl.schedule.mode: async on {hosts} processes runs the generator on processes of "
        f"its own: placement.strategy='separate' with placement.train_devices a multiple of "
        f"each process's {local} devices{cpu}, from {local} to {len(devices) - local}; got "
        f"{cfg.placement.strategy!r} with train_devices={cfg.placement.train_devices}")
  if mode == "sync" and split is not None and split.generators and cfg.rl.dapo.dynamic_sampling:
    raise ConfigError(
        "config.rl.dapo.dynamic_sampling: the placement gives the sampler processes of its own, "
        "whose sync generation takes one batch a step; use placement.strategy='colocate'")


def _placement(cfg: ExperimentConfig, devices):
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


def check_batch_sizes(cfg: ExperimentConfig, cluster: RoleCluster) -> None:
  """Each batch must split evenly over the mesh that runs it (ConfigError naming the field)."""
  train = batch_ways(cluster.meshes["actor"], cluster.actor.rules)
  sampler = batch_ways(cluster.meshes["sampler"], SAMPLER_RULES)
  rl = cfg.rl
  if rl.rollouts % (rl.batching.num_minibatches * train):
    raise ConfigError(
        f"config.rl.batching.num_minibatches: prompts_per_step*group_size={rl.rollouts} must "
        f"split into {rl.batching.num_minibatches} minibatches divisible by the trainer's "
        f"{train}-way batch split")
  checks = [("config.sft.batch_size", cfg.sft.batch_size, train),
            ("config.rl.batching.micro_batch_size", rl.batching.micro_batch_size, train),
            ("config.rl.prompts_per_step", rl.prompts_per_step, sampler),
            ("config.eval.batch_size", cfg.eval.batch_size, sampler)]
  if cfg.dpo.steps:
    checks.append(("config.dpo.batch_size", 2 * cfg.dpo.batch_size, train))
  if rl.reward == "reward_model":
    checks.append(("config.reward_model.batch_size", 2 * cfg.reward_model.batch_size, train))
  for role in ("reference", "reward", "critic"):  # trained-model meshes: the train rules
    ways = batch_ways(cluster.meshes[role], cluster.actor.rules)
    checks += [("config.rl.group_size", rl.rollouts, ways),
               ("config.rl.batching.micro_batch_size", rl.batching.micro_batch_size, ways)]
  for path, value, ways in checks:
    if value % ways:
      what = "prompts_per_step*group_size=" if path == "config.rl.group_size" else ""
      raise ConfigError(f"{path}: {what}{value} is not divisible by the {ways}-way batch split "
                        f"of its mesh")
