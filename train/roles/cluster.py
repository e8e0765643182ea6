"""The cluster: the placement, the RLHF models on their meshes, and the sampler's copy of the actor.

Roles (sharding/placement.py): the actor (trained), the frozen reference, the reward model and
the critic each live on their role's mesh; the sampler holds a copy of the actor in the sampling
layout (`sampler_weights`, train/roles/sampler_weights.py), refreshed after every update. The
reference, reward model and critic exist once a stage has added them (`add`). Batch sizes are
checked here, once, against the real meshes on the real devices.
"""
from __future__ import annotations

import functools
import os

import jax
from flax import nnx

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.models import lora
from jaxrl.models.dtypes import compute_dtypes, frozen_base_dtypes
from jaxrl.models.value_models import RewardModel, ValueModel
from jaxrl.models.hf import HFError, load_params
from jaxrl.models.transformer import LanguageModel
from sharding.placement import PlacementError
from sharding.rules import SAMPLER_RULES, batch_ways
from train.io.checkpoint import load_actor_params, saved_actor_shapes
from train.io.host_transfers import HostTransfers
from train.roles.layout import Layout, config_error, layout as make_layout
from train.roles.role import ModelRole
from train.roles.sampler_weights import SamplerWeights

MODEL_CLASSES = {"actor": LanguageModel, "reference": LanguageModel, "reward": RewardModel,
                 "critic": ValueModel}
SCORERS = ("reference", "reward", "critic")  # the roles `placement.scorers_apart` moves apart


class RoleCluster:

  def __init__(self, cfg: ExperimentConfig, devices=None, *, layout: Layout | None = None,
               initialize: bool = True, transfers: HostTransfers | None = None):
    """On `layout` (default: `cfg`'s on `devices`, this job's by default); `initialize=False`
    leaves the actor abstract (a restore fills it); `transfers`: the run's named host transfers
    (the weight push's)."""
    self.layout = make_layout(cfg, devices) if layout is None else layout
    self.cfg = cfg = self.layout.cfg  # (the planner's choice filled in)
    self.placement, self.split = self.layout.placement, self.layout.split
    self.devices = list(self.layout.devices)
    self._shapes: dict[tuple, tuple] = {}  # traced modules (`_shape`)
    self.meshes = self._role_meshes()
    try:  # (a mesh axis that does not divide a parameter)
      self.actor = self._actor_role()
      plain = self._shape("actor")[0] if cfg.lora.enabled else None  # without adapters
      self.sampler_weights = SamplerWeights(
          cfg, self.actor, self.meshes["sampler"], plain, transfers,
          mirror=self.split is not None and self.split.generators
          and self.split.here == "trainer")
    except PlacementError as e:
      raise config_error(e) from None
    check_batch_sizes(cfg, self)
    self.roles: dict[str, ModelRole] = {"actor": self.actor}
    self.shared: set[str] = set()  # roles whose parameters are the actor's own arrays
    # roles whose passes run on processes of their own (train/loop/remote_scorers.py)
    self.apart = set(SCORERS) if self.split is not None and self.split.scorer is not None \
        else set()
    if initialize:
      self.initialize_actor()  # the sampler's copy follows on first use (`sampler_weights.fresh`)

  def _role_meshes(self) -> dict:
    """Each role's mesh on this process: the placement's, but where groups stand apart the
    sampler's is this generator's own, or on the trainer's processes its mirror (the trainer's
    copy), and the scorers apart (the critic too) are the trainer's host copies on the actor's
    mesh."""
    meshes, split = self.layout.meshes(), self.split
    if split is not None and split.generators:
      replica = split.replica_of(jax.process_index())
      meshes["sampler"] = split.mirror if replica is None else split.replicas[replica]
    if split is not None and split.scorer is not None and split.here != "scorers":
      for role in SCORERS:
        meshes[role] = meshes["actor"]
    return meshes

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
    """This process's group ("trainer", "sampler", "sampler1", ..., "scorers", or "all" where
    every process runs every program) and its processes."""
    if self.split is None:
      return "all", frozenset(range(jax.process_count()))
    return self.split.here, self.split.groups[self.split.here]


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
