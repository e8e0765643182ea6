"""A policy from disk, for a look (`jaxrl-sample`) or for export (`jaxrl-export`).

`load_policy(path)` takes a Hugging Face model directory (config.json + safetensors) or a jaxrl
checkpoint: a run's stage directory `RUN/checkpoints/STAGE` (its latest step) or one step of it
`RUN/checkpoints/STAGE/STEP` (a LoRA run's with its adapters folded in). The model config comes from config.json (HF) or the run's
config.json (jaxrl), the tokenizer from the HF directory, or from the run's `data.tokenizer_path`
/ `model.hf_path` (the byte tokenizer when neither is set). Parameters land on this process's
first device (a `ModelRole` on a one-device mesh), read straight into place.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
from flax import nnx

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.config_files import from_mapping
from jaxrl.data.tokenizer import load_tokenizer
from jaxrl.models import lora
from jaxrl.models.config import ModelConfig
from jaxrl.models.hf import HFError, load_params, model_config_from_hf
from jaxrl.models.lora import LoRAConfig
from jaxrl.models.transformer import LanguageModel
from sharding.mesh import make_mesh
from train.io.checkpoint import load_actor_params
from train.roles.role import ModelRole


@dataclasses.dataclass
class Policy:
  cfg: ModelConfig
  graphdef: nnx.GraphDef
  params: nnx.State
  tok: object  # jaxrl.data.tokenizer.Tokenizer
  tokenizer_dir: str  # "" for the byte tokenizer
  source: str  # what was loaded, for messages
  # A LoRA run's checkpoint: `params` have the adapters folded in; these are the adapters
  # (PEFT's tensor names) and their config, for an adapter export. None otherwise.
  adapters: dict | None = None
  lora: LoRAConfig | None = None
  base_model: str = ""  # the run's model.hf_path (an adapter's base)


def _role(cfg: ModelConfig, lora_cfg: LoRAConfig | None = None) -> ModelRole:
  mesh = make_mesh({}, devices=[jax.local_devices()[0]])
  return ModelRole("actor", lambda: LanguageModel(cfg, rngs=nnx.Rngs(0), lora=lora_cfg), mesh)


def split_checkpoint_path(path: str, what: str = "--checkpoint") -> tuple[str, str, int | None]:
  """(run dir, stage dir, step or None) of `RUN/checkpoints/STAGE[/STEP]` (a ConfigError naming
  the flag `what` when it is not one)."""
  path = os.path.abspath(path.rstrip("/"))
  step = None
  if os.path.basename(path).isdigit():
    path, step = os.path.dirname(path), int(os.path.basename(path))
  run_dir = os.path.dirname(os.path.dirname(path))
  if os.path.basename(os.path.dirname(path)) != "checkpoints":
    hf = "a Hugging Face directory or " if what == "--model" else ""
    raise ConfigError(f"{what}: expected {hf}RUN/checkpoints/STAGE[/STEP], got {path!r}")
  return run_dir, path, step


def refuse_run_dir(path: str, what: str) -> None:
  """A ConfigError naming the flag when `path` is a run directory (its config.json is a jaxrl
  config, not a Hugging Face one): the stages a checkpoint of it can be taken from."""
  root = os.path.join(path, "checkpoints")
  if os.path.isdir(root):
    stages = sorted(e.name for e in os.scandir(root) if e.is_dir()) or ["none saved yet"]
    raise ConfigError(f"{what}: {path} is a jaxrl run directory, not a checkpoint: pass "
                      f"{os.path.join(path.rstrip('/'), 'checkpoints', 'STAGE')} (its stages: "
                      f"{', '.join(stages)})")


def run_config(run_dir: str) -> ExperimentConfig:
  """The config a run saved (its model section already resolved from any HF config.json)."""
  path = os.path.join(run_dir, "config.json")
  try:
    with open(path, encoding="utf-8") as f:
      return from_mapping(ExperimentConfig, json.load(f))
  except OSError:
    raise ConfigError(f"{path}: not found; is {run_dir!r} a jaxrl run directory?") from None


def load_policy(path: str, *, dtype: str | None = None, what: str = "--model",
                merge: bool = True) -> Policy:
  """A Hugging Face directory or a jaxrl checkpoint (see the module docstring); errors name
  the flag `what`. `merge=False`: a LoRA checkpoint's `params` stay adapted (an adapter
  export needs no merged copy)."""
  refuse_run_dir(path, what)
  if os.path.isfile(os.path.join(path, "config.json")):
    try:
      cfg = model_config_from_hf(path)
      cfg = dataclasses.replace(cfg, dtype=dtype or cfg.dtype)
      role = _role(cfg)
      params = load_params(path, cfg, role.abstract())
    except HFError as e:
      raise ConfigError(str(e)) from None
    return Policy(cfg, role.graphdef, params, load_tokenizer(path), path, path)
  run_dir, stage_dir, step = split_checkpoint_path(path, what)
  run = run_config(run_dir)
  cfg = dataclasses.replace(run.model, dtype=dtype or run.model.dtype)
  role = _role(cfg, run.lora if run.lora.enabled else None)
  try:
    params, step = load_actor_params(stage_dir, role.abstract(), step=step, what=what)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  tokenizer_dir = run.data.tokenizer_path or run.model.hf_path
  policy = Policy(cfg, role.graphdef, params, load_tokenizer(tokenizer_dir), tokenizer_dir,
                  f"{stage_dir} step {step}")
  if run.lora.enabled:  # the adapters, and the plain model with them folded in
    policy = dataclasses.replace(policy, adapters=lora.peft_tensors(role.graphdef, params),
                                 lora=run.lora, base_model=run.model.hf_path)
    if merge:
      policy = dataclasses.replace(policy, graphdef=_role(cfg).graphdef,
                                   params=lora.merged(role.graphdef, params))
  return policy
