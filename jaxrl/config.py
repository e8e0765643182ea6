"""Frozen, validated experiment config: the boundary between ml_collections files and the code.

`from_mapping(ExperimentConfig, config_dict)` raises `ConfigError` naming the first unknown,
missing-typed or out-of-range field as `config.section.field`.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from jaxrl.algos import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from jaxrl.data.tasks import TASKS
from jaxrl.models.llama import ModelConfig
from sharding.placement import STRATEGIES


REWARDS = ("verifier", "reward_model")
MODES = ("sync", "async")
KL_MODES = ("loss", "reward")  # KL(pi || ref) as a loss term, or folded into per-token rewards


class ConfigError(ValueError):
  """A user error in the config: reported in one line, exit code 2."""


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  name: str = "addition"
  num_digits: int = 2
  n_train: int = 4096
  n_heldout: int = 256
  # Chance that an SFT demonstration is the teacher's systematic mistake instead of the answer.
  teacher_error: float = 0.0
  verifier: str = "exact_match"


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
  strategy: str = "separate"  # colocate | interleave | separate (sharding/placement.py)
  train_devices: int = 4  # devices (over all hosts) for the trainer roles; ignored by colocate
  sampler_tensor: int = 1  # tensor-parallel degree of the sampler mesh
  reshard_bucket_mb: int = 256  # cap on the extra memory of one train -> sampler transfer
  cpu_devices: int = 8  # fake host devices when running on the CPU (XLA_FLAGS)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  steps: int = 200
  batch_size: int = 64
  learning_rate: float = 1e-3
  warmup_steps: int = 20
  weight_decay: float = 0.0
  pack_length: int = 0  # > 0: pack several examples into rows of this many tokens


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
  """Bradley-Terry training of the reward model (used when `rl.reward == "reward_model"`).

  The trunk starts from the SFT actor. Pairs come from `pairs_path` (jsonl of {"prompt",
  "chosen", "rejected"}) or, when empty, are generated from the task's verifier."""
  steps: int = 300
  batch_size: int = 32  # pairs per step
  learning_rate: float = 3e-4
  warmup_steps: int = 20
  pairs_path: str = ""
  pairs_per_prompt: int = 2  # synthetic pairs per training prompt
  policy_negatives: bool = True  # synthetic rejected answers include the SFT policy's mistakes


@dataclasses.dataclass(frozen=True)
class DPOConfig:
  """Direct preference optimisation of the actor after SFT; `steps == 0` skips it."""
  steps: int = 0
  batch_size: int = 32
  learning_rate: float = 1e-4
  warmup_steps: int = 10
  beta: float = 0.1
  pairs_path: str = ""  # empty: synthetic pairs from the verifier, as for the reward model
  pairs_per_prompt: int = 1
  policy_negatives: bool = True


@dataclasses.dataclass(frozen=True)
class RLConfig:
  steps: int = 100
  mode: str = "sync"  # sync | async (generation runs ahead; needs placement.strategy="separate")
  max_staleness: int = 1  # async: how many policy versions a consumed batch may lag
  prompts_per_step: int = 16
  group_size: int = 8
  num_minibatches: int = 2
  learning_rate: float = 3e-4
  advantage: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp | gae (gae trains a critic)
  reward: str = "verifier"  # verifier | reward_model
  policy_loss: str = "ppo_clip"  # ppo_clip | aipo
  aipo_rho: float = 4.0
  tis_cap: float = 0.0  # > 0: truncated IS weight min(pi_old / mu, cap) on the PPO loss
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  kl_coef: float = 0.02
  kl_estimator: str = "k3"
  kl_mode: str = "loss"  # loss | reward (REINFORCE++ and PPO fold it into the rewards)
  entropy_coef: float = 0.0
  gamma: float = 1.0
  lam: float = 0.95
  whiten_advantages: bool = False
  critic_learning_rate: float = 1e-4
  value_clip_eps: float = 0.2
  loss_aggregation: str = "token_mean"
  temperature: float = 1.0
  top_k: int = 0
  max_grad_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  every: int = 20  # RL steps between held-out greedy evaluations
  batch_size: int = 256


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  seed: int = 0
  run_dir: str = "runs"  # a fresh timestamped subdirectory is made per run
  run_name: str = ""  # subdirectory name; empty -> timestamp
  checkpoint_every: int = 50  # RL steps
  keep_checkpoints: int = 3
  progress: bool = True
  # An orbax checkpoint directory (e.g. runs/NAME/checkpoints/sft) to start the actor from.
  init_checkpoint: str = ""
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
  placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
  sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
  dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)
  reward_model: RewardModelConfig = dataclasses.field(default_factory=RewardModelConfig)
  rl: RLConfig = dataclasses.field(default_factory=RLConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)


def _check_type(path: str, value: Any, typ: Any) -> Any:
  if typ is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if typ in (int, float) and (isinstance(value, bool) or not isinstance(value, typ)):
    raise ConfigError(f"{path}: expected {typ.__name__}, got {value!r}")
  if typ in (str, bool) and not isinstance(value, typ):
    raise ConfigError(f"{path}: expected {typ.__name__}, got {value!r}")
  return value


def from_mapping(cls: type, values: Mapping[str, Any], path: str = "config"):
  """Builds dataclass `cls` from a (nested) mapping, naming the first bad field in the error."""
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls)}
  kwargs = {}
  for name, value in values.items():
    where = f"{path}.{name}"
    if name not in fields:
      raise ConfigError(f"{where}: unknown field; expected one of {sorted(fields)}")
    typ = hints[name]
    if dataclasses.is_dataclass(typ):
      if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a section (dict), got {value!r}")
      kwargs[name] = from_mapping(typ, value, where)
    elif isinstance(typ, types.UnionType):
      kwargs[name] = value
    else:
      kwargs[name] = _check_type(where, value, typ)
  try:
    obj = cls(**kwargs)
  except ValueError as e:
    raise ConfigError(f"{path}.{e}") from None
  return obj


def _choice(path: str, value: str, options) -> None:
  if value not in options:
    raise ConfigError(f"{path}: expected one of {sorted(options)}, got {value!r}")


def _positive(path: str, value) -> None:
  if value <= 0:
    raise ConfigError(f"{path}: expected > 0, got {value!r}")


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
  """Cross-field checks that a single dataclass cannot do alone."""
  from jaxrl.rewards.verifier import VERIFIERS
  _choice("config.task.name", cfg.task.name, TASKS)
  _choice("config.task.verifier", cfg.task.verifier, VERIFIERS)
  _choice("config.rl.advantage", cfg.rl.advantage, ADVANTAGES)
  _choice("config.rl.reward", cfg.rl.reward, REWARDS)
  _choice("config.rl.mode", cfg.rl.mode, MODES)
  if cfg.rl.mode == "async" and cfg.placement.strategy != "separate":
    raise ConfigError(
        f"config.rl.mode: async needs the sampler on devices of its own "
        f"(placement.strategy='separate'); with {cfg.placement.strategy!r} generation and training "
        f"share devices and cannot overlap, use mode='sync'")
  if cfg.rl.max_staleness < 0:
    raise ConfigError(f"config.rl.max_staleness: expected >= 0, got {cfg.rl.max_staleness}")
  _choice("config.rl.policy_loss", cfg.rl.policy_loss, POLICY_LOSSES)
  _choice("config.rl.kl_estimator", cfg.rl.kl_estimator, KL_ESTIMATORS)
  _choice("config.rl.kl_mode", cfg.rl.kl_mode, KL_MODES)
  if cfg.rl.advantage == "reinforce_pp" and cfg.rl.kl_mode != "reward":
    raise ConfigError("config.rl.kl_mode: reinforce_pp folds the KL into the rewards; "
                      "expected 'reward', got 'loss'")
  if cfg.rl.reward == "reward_model" and cfg.reward_model.steps <= 0:
    raise ConfigError("config.reward_model.steps: rl.reward='reward_model' needs a trained "
                      f"reward model, expected > 0, got {cfg.reward_model.steps}")
  _choice("config.rl.loss_aggregation", cfg.rl.loss_aggregation, AGGREGATIONS)
  for path, value in [("config.sft.batch_size", cfg.sft.batch_size),
                      ("config.rl.prompts_per_step", cfg.rl.prompts_per_step),
                      ("config.rl.group_size", cfg.rl.group_size),
                      ("config.rl.num_minibatches", cfg.rl.num_minibatches),
                      ("config.rl.temperature", cfg.rl.temperature),
                      ("config.eval.every", cfg.eval.every),
                      ("config.eval.batch_size", cfg.eval.batch_size),
                      ("config.task.num_digits", cfg.task.num_digits),
                      ("config.task.n_train", cfg.task.n_train),
                      ("config.task.n_heldout", cfg.task.n_heldout),
                      ("config.rl.aipo_rho", cfg.rl.aipo_rho),
                      ("config.reward_model.batch_size", cfg.reward_model.batch_size),
                      ("config.reward_model.pairs_per_prompt", cfg.reward_model.pairs_per_prompt),
                      ("config.dpo.batch_size", cfg.dpo.batch_size),
                      ("config.dpo.beta", cfg.dpo.beta),
                      ("config.dpo.pairs_per_prompt", cfg.dpo.pairs_per_prompt)]:
    _positive(path, value)
  _choice("config.placement.strategy", cfg.placement.strategy, STRATEGIES)
  pl = cfg.placement
  if pl.strategy != "colocate" and not 0 < pl.train_devices < pl.cpu_devices:
    raise ConfigError(f"config.placement.train_devices: {pl.train_devices} must be in "
                      f"(0, {pl.cpu_devices})")
  train_ways = pl.cpu_devices if pl.strategy == "colocate" else pl.train_devices
  sampler_devices = {"colocate": pl.cpu_devices, "interleave": pl.train_devices,
                     "separate": pl.cpu_devices - pl.train_devices}[pl.strategy]
  sampler_ways = max(sampler_devices // max(pl.sampler_tensor, 1), 1)
  rollouts = cfg.rl.prompts_per_step * cfg.rl.group_size
  if rollouts % (cfg.rl.num_minibatches * train_ways):
    raise ConfigError(
        f"config.rl.num_minibatches: prompts_per_step*group_size={rollouts} must split into "
        f"{cfg.rl.num_minibatches} minibatches divisible by the trainer's {train_ways} devices")
  for path, value, ways in [("config.sft.batch_size", cfg.sft.batch_size, train_ways),
                            ("config.reward_model.batch_size", 2 * cfg.reward_model.batch_size,
                             train_ways),
                            ("config.dpo.batch_size", 2 * cfg.dpo.batch_size, train_ways),
                            ("config.rl.prompts_per_step", cfg.rl.prompts_per_step, sampler_ways),
                            ("config.eval.batch_size", cfg.eval.batch_size, sampler_ways)]:
    if value % ways:
      raise ConfigError(f"{path}: {value} is not divisible by the {ways}-way batch split of its mesh")
  for path, value in [("config.rl.gamma", cfg.rl.gamma), ("config.rl.lam", cfg.rl.lam)]:
    if not 0.0 <= value <= 1.0:
      raise ConfigError(f"{path}: expected in [0, 1], got {value}")
  if not 0.0 <= cfg.task.teacher_error <= 1.0:
    raise ConfigError(f"config.task.teacher_error: expected in [0, 1], got {cfg.task.teacher_error}")
  return cfg
