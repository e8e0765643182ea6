"""The experiment schema: frozen dataclasses whose defaults ARE the default experiment.

`configs/default.py` is `config_dict(ExperimentConfig())`; every other config file overrides
fields of it, and gin bindings (`rl.steps = 5`) address the same fields. `from_mapping` turns a
(nested) mapping into the dataclasses, raising `ConfigError` naming the first unknown, ill-typed
or out-of-range field as `config.section.field`. Each section checks its own fields in
`__post_init__`; `ExperimentConfig` checks what spans sections. What depends on the devices
(mesh sizes dividing batch sizes) is checked against the real placement (train/roles/cluster.py).
"""
from __future__ import annotations

import dataclasses

from jaxrl.config_checks import (ConfigError, at_least_zero, choice, first_line,  # noqa: F401
                                 positive, sections_agree, unit)
from jaxrl.config_rl import RLConfig
from jaxrl.data.sources import ANSWER_FORMATS
from jaxrl.data.tasks import TASKS
from jaxrl.models.config import ModelConfig
from jaxrl.models.lora import LoRAConfig

# Placement presets (sharding/placement.py builds them); "plan" asks the planner for one.
STRATEGIES = ("colocate", "interleave", "separate")
OFFLOADS = ("optimizer", "frozen", "sampler")  # placement.offload's items (train/roles/offload.py)


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """A synthetic verifiable task (jaxrl/data/tasks.py): `rev abcde=` -> `edcba`."""
  name: str = "reverse"
  num_digits: int = 5
  n_train: int = 4096
  n_heldout: int = 256
  # Chance that an SFT demonstration is the teacher's systematic mistake instead of the answer.
  teacher_error: float = 0.6

  def __post_init__(self):
    choice(self, "name", TASKS)
    positive(self, "num_digits", "n_train", "n_heldout")
    unit(self, "teacher_error")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Prompts, reference answers and SFT targets from jsonl / parquet files (docs/data.md);
  without `train_path` the synthetic task (config.task) supplies them."""
  train_path: str = ""
  # empty: `heldout_size` rows split off the training file (or the synthetic task's own)
  heldout_path: str = ""
  heldout_size: int = 256
  prompt_field: str = "question"
  answer_field: str = "answer"
  messages_field: str = ""  # chat messages as the prompt (SFT: the last assistant turn the target)
  completion_field: str = ""  # SFT target; empty: the answer field's whole text (a worked solution)
  answer_format: str = "gsm8k"  # gsm8k ("#### 42") | boxed (the last \boxed{}) | plain
  prompt_template: str = "{prompt}"  # str.format over the row's fields; {prompt} = prompt_field
  chat: bool = False  # render prompts with the tokenizer's chat template
  system_prompt: str = ""  # with chat: a system message first
  tokenizer_path: str = ""  # empty: model.hf_path's tokenizer when set, else the byte tokenizer
  # Longer prompts are bad rows; RL batches are padded to their bucket (rl.batching.length_buckets).
  max_prompt_tokens: int = 12
  on_bad_row: str = "skip"  # skip (and count in the metrics) | error (stop, naming file and row)

  def __post_init__(self):
    choice(self, "answer_format", ANSWER_FORMATS)
    choice(self, "on_bad_row", ("skip", "error"))
    positive(self, "heldout_size", "max_prompt_tokens")


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
  """Roles on devices (sharding/placement.py). Default: the trainer fsdp-shards the actor over
  devices 0-3, the sampler decodes on devices 4-7 ({data: 2, tensor: 2}) from a shadow copy
  resharded after every update."""
  strategy: str = "separate"  # colocate | interleave | separate | plan (the planner chooses)
  train_devices: int = 4  # devices (over all hosts) for the trainer roles; ignored by colocate
  # Tensor-parallel degree of the sampler mesh; 0: 2 where the model's heads, KV heads, MLP and
  # vocabulary split 2 ways, else 1 (ExperimentConfig.sampler_tensor)
  sampler_tensor: int = 0
  train_fsdp: int = 0  # trainer's fsdp degree (rest data-parallel); 0: TPU slice all, GPU a host
  reshard_bucket_mb: int = 256  # cap on the extra memory of one train -> sampler transfer
  cpu_devices: int = 8  # fake host devices when running on the CPU (XLA_FLAGS)
  device_memory_gb: float = 0.0  # the target accelerator's memory, checked by --dry_run (0: none)
  # Share of each accelerator's memory JAX preallocates (XLA_PYTHON_CLIENT_MEM_FRACTION; 0: on
  # demand, XLA_PYTHON_CLIENT_PREALLOCATE=false), set before JAX starts (sharding/host.py).
  device_memory_fraction: float = 0.9
  # Idle-role offload in sync RL (train/roles/offload.py): comma-separated optimizer (Adam moments
  # on the devices only for the update), frozen (reference, reward model only for scoring),
  # sampler (its copy dropped for the update); all; empty: none
  offload: str = ""
  # strategy="plan": a calibration JSON (`jaxrl-plan --calibrate FILE`); empty: the built-in
  # factors of the device kind (planner/devices.py)
  calibration: str = ""

  def __post_init__(self):
    choice(self, "strategy", STRATEGIES + ("plan",))
    positive(self, "train_devices", "reshard_bucket_mb", "cpu_devices")
    at_least_zero(self, "device_memory_gb", "sampler_tensor", "train_fsdp")
    unit(self, "device_memory_fraction")
    offload_items(self.offload)


def offload_items(spec: str) -> tuple[str, ...]:
  """`placement.offload`'s items ("all": every one); ValueError naming an unknown one."""
  items = tuple(s.strip() for s in spec.split(",") if s.strip())
  if items == ("all",):
    return OFFLOADS
  if any(s not in OFFLOADS for s in items):
    raise ValueError(f"offload: expected a comma-separated subset of {','.join(OFFLOADS)} "
                     f"(or all), got {spec!r}")
  return items


def usable_memory_gb(placement: PlacementConfig) -> float:
  """Memory of one device the run may use: `device_memory_fraction` of `device_memory_gb`, or
  all of it when allocated on demand (fraction 0)."""
  fraction = placement.device_memory_fraction
  return placement.device_memory_gb * (fraction if fraction > 0 else 1.0)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """Supervised warm start on the task's (imperfect) demonstrations."""
  steps: int = 800
  batch_size: int = 64
  learning_rate: float = 1e-3
  warmup_steps: int = 20
  weight_decay: float = 0.0
  pack_length: int = 0  # > 0: pack several examples into rows of this many tokens

  def __post_init__(self):
    positive(self, "batch_size", "learning_rate")
    at_least_zero(self, "steps", "warmup_steps", "pack_length", "weight_decay")


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
  """Bradley-Terry training of the reward model (runs when `rl.reward == "reward_model"`).

  The trunk starts from the SFT actor. Pairs come from `pairs_path` (jsonl of {"prompt",
  "chosen", "rejected"}) or, when empty, are generated from the task's verifier."""
  steps: int = 300
  batch_size: int = 32  # pairs per step
  learning_rate: float = 3e-4
  warmup_steps: int = 20
  pairs_path: str = ""
  pairs_per_prompt: int = 2  # synthetic pairs per training prompt
  policy_negatives: bool = True  # synthetic rejected answers include the SFT policy's mistakes

  def __post_init__(self):
    positive(self, "batch_size", "pairs_per_prompt", "learning_rate")
    at_least_zero(self, "steps", "warmup_steps")


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

  def __post_init__(self):
    positive(self, "batch_size", "beta", "pairs_per_prompt", "learning_rate")
    at_least_zero(self, "steps", "warmup_steps")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  every: int = 10  # RL steps between held-out greedy evaluations
  batch_size: int = 256

  def __post_init__(self):
    positive(self, "every", "batch_size")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
  """Views of the metrics rows besides metrics.jsonl (train/io/tracking.py; process 0 only)."""
  tensorboard: bool = True  # event files under RUN/tensorboard/STAGE
  wandb: bool = False  # Weights & Biases (pip install wandb; WANDB_MODE=offline works offline)
  wandb_project: str = "jaxrl"


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """The default experiment: a 0.5M-parameter Llama learns to reverse 5-letter strings, SFT on
  an imperfect teacher's demonstrations, then GRPO with an exact-match verifier, on 8 fake CPU
  devices (README, "What `make run` does")."""
  seed: int = 0
  run_dir: str = "runs"  # runs go to run_dir/run_name
  run_name: str = ""  # empty -> a timestamp
  checkpoint_every: int = 50  # steps of any stage between run-state checkpoints
  checkpoint_minutes: float = 30.0  # and at least this often (0: off)
  keep_checkpoints: int = 3  # per stage: the last K, plus the best by held-out accuracy
  # Optimizer updates (one per minibatch) with a NaN or Inf in their gradients are skipped; this
  # many in a row stop the run.
  max_skipped_updates: int = 5
  progress: bool = True
  # JAX's persistent compilation cache (train/io/compilation.py): empty: JAXRL_COMPILATION_CACHE,
  # else $XDG_CACHE_HOME/jaxrl/xla (~/.cache/jaxrl/xla); a directory; "off"
  compilation_cache_dir: str = ""
  # A run's stage checkpoints (e.g. runs/NAME/checkpoints/sft) to start the actor from.
  init_checkpoint: str = ""
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)  # adapters on the actor
  task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
  sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
  dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)
  reward_model: RewardModelConfig = dataclasses.field(default_factory=RewardModelConfig)
  rl: RLConfig = dataclasses.field(default_factory=RLConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

  def __post_init__(self):
    positive(self, "checkpoint_every", "keep_checkpoints", "max_skipped_updates")
    at_least_zero(self, "checkpoint_minutes", "seed")
    sections_agree(self)

  @property
  def sampler_tensor(self) -> int:
    """The sampler mesh's tensor degree: `placement.sampler_tensor`, or for 0 (auto) 2 where the
    model's heads, KV heads, MLP and experts' widths and vocabulary all split 2 ways, else 1."""
    m = self.model
    dims = (m.n_heads, m.n_kv_heads, m.d_ff, m.moe.d_ff, m.vocab_size)
    return self.placement.sampler_tensor or (2 if all(x % 2 == 0 for x in dims) else 1)


def to_dict(cfg) -> dict:
  return dataclasses.asdict(cfg)


def config_dict(cfg: ExperimentConfig):
  """The config as an ml_collections ConfigDict (what `configs/*.py` files return)."""
  import ml_collections
  return ml_collections.ConfigDict(to_dict(cfg))
