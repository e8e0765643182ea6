"""Config sources -> the one schema (jaxrl/config.py).

An experiment is an `ExperimentConfig`, or anything that resolves to one: the ConfigDict of a
`configs/NAME.py` file, a plain (nested) mapping such as a run's config.json, or gin bindings.
For gin, every section is a configurable of its own dotted name (`rl.steps = 5`,
`rl.loss.name = "cispo"`, `model.d_model = 64`) and the top-level fields belong to `experiment`
(`experiment.seed = 1`); bindings apply on top of
a base config (the schema's defaults unless a config file is given too) and the result goes
through the same checks as an ml_collections config, so `--gin_param=rl.steps=5` and
`--config.rl.steps=5` resolve to the same config.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import gin

from jaxrl.config import ConfigError, ExperimentConfig, first_line, to_dict
from jaxrl.config_checks import unknown_field
from jaxrl.config_rl import RLConfig
from jaxrl.models.config import ModelConfig
from jaxrl.models.hf_config import HFError, check_config, model_config_from_hf

TOP_LEVEL = "experiment"
_registered = False


def _sections(cls, prefix: str = "") -> dict[str, type]:
  """Dotted section name -> its dataclass, for `cls`'s sections and theirs ("rl.loss")."""
  out = {}
  for f in dataclasses.fields(cls):
    if f.default_factory is not dataclasses.MISSING:
      out[prefix + f.name] = f.default_factory
      out.update(_sections(f.default_factory, f"{prefix}{f.name}."))
  return out


SECTIONS = _sections(ExperimentConfig)
# config.json's `rl` fields before the RL settings were split by concern (issue 53): old name ->
# (section, field). Read so that older run dirs still resume, evaluate and export.
OLD_RL_FIELDS = {
    "mode": ("schedule", "mode"), "max_staleness": ("schedule", "max_staleness"),
    "partial_rollouts": ("schedule", "partial_rollouts"), "async_schedule": ("schedule", "name"),
    "num_minibatches": ("batching", "num_minibatches"),
    "micro_batch_size": ("batching", "micro_batch_size"),
    "length_buckets": ("batching", "length_buckets"), "pack_length": ("batching", "pack_length"),
    "advantage": ("advantage", "name"), "gamma": ("advantage", "gamma"),
    "lam": ("advantage", "lam"), "whiten_advantages": ("advantage", "whiten"),
    "policy_loss": ("loss", "name"), "loss_aggregation": ("loss", "aggregation"),
    "clip_eps_low": ("loss", "eps_low"), "clip_eps_high": ("loss", "eps_high"),
    "aipo_rho": ("loss", "rho"), "entropy_coef": ("loss", "entropy_coef"),
    "kl_coef": ("kl", "coef"), "kl_estimator": ("kl", "estimator"), "kl_mode": ("kl", "mode"),
    "tis_cap": ("correction", "tis_cap"), "rollout_mask": ("correction", "mask"),
    "rollout_mask_low": ("correction", "mask_low"),
    "rollout_mask_high": ("correction", "mask_high"),
    "critic_learning_rate": ("critic", "learning_rate"), "value_clip_eps": ("critic", "clip_eps"),
    **{name: ("dapo", name) for name in ("dynamic_sampling", "dynamic_sampling_rounds",
                                         "overlong_filter", "overlong_buffer",
                                         "overlong_penalty")},
    **{name: ("rollout", name) for name in ("max_new_tokens", "temperature", "top_k",
                                            "ignore_eos", "inflight_slots")},
    "environment": ("environment", "name"),
    **{name: ("environment", name) for name in ("max_turns", "max_turn_tokens",
                                                "keep_turn_cache")},
    "user_code_timeout_s": ("user_code", "timeout_s"),
    "on_user_code_error": ("user_code", "on_error"),
    "user_code_workers": ("user_code", "workers"),
    "user_code_memory_gb": ("user_code", "memory_gb"),
}
# config.json's `model` fields before the model's settings were split by concern (issue 63):
# old name -> (section, field), read so that older run dirs still resume, evaluate and export.
OLD_MODEL_FIELDS = {
    **{f"rope_{name}": ("rope", name) for name in (
        "theta", "scaling", "factor", "low_freq_factor", "high_freq_factor",
        "original_max_positions", "local_theta")},
    "attention": ("attention", "impl"),  # (a string then, a section now)
    **{name: ("attention", name) for name in ("sliding_window", "global_every", "query_scale")},
    "n_experts": ("moe", "experts"), "experts_per_token": ("moe", "per_token"),
    "expert_d_ff": ("moe", "d_ff"), "norm_topk": ("moe", "norm_topk"), "moe_impl": ("moe", "impl"),
    "router_aux_loss": ("moe", "aux_loss"), "router_z_loss": ("moe", "z_loss"),
    "routing_replay": ("moe", "routing_replay"),
    "scan_layers": ("layers", "scan"), "remat": ("layers", "remat"),
}


def moved(dotted: str) -> str | None:
  """Where a field that moved into a section lives now (`config.rl.num_minibatches` ->
  `config.rl.batching.num_minibatches`), or None."""
  *parents, name = dotted.split(".")
  old = {"rl": OLD_RL_FIELDS, "model": OLD_MODEL_FIELDS}.get(parents[-1] if parents else "", {})
  if name not in old:
    return None
  return ".".join([*parents, *old[name]])


def _check_type(path: str, value: Any, typ: Any) -> Any:
  if typ is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if typ is float and isinstance(value, float) and not math.isfinite(value):
    raise ConfigError(f"{path}: expected a finite number, got {value!r}")
  if typ in (int, float) and (isinstance(value, bool) or not isinstance(value, typ)):
    raise ConfigError(f"{path}: expected {typ.__name__}, got {value!r}")
  if typ in (str, bool) and not isinstance(value, typ):
    raise ConfigError(f"{path}: expected {typ.__name__}, got {value!r}")
  return value


def _family_of_flags(values: Mapping[str, Any], path: str) -> dict:
  """A model section written before model families (a run's config.json from before issue 37)
  named Qwen2's and Qwen3's blocks by flag: `qkv_bias` true is the family "qwen2", `qk_norm` true
  "qwen3", neither the family the section names (default "llama"). Read so that older run dirs
  still resume, evaluate and export."""
  values = dict(values)
  qkv, qk = bool(values.pop("qkv_bias", False)), bool(values.pop("qk_norm", False))
  if qkv and qk:
    raise ConfigError(f"{path}.qkv_bias: qkv_bias with qk_norm is no model family; set "
                      f"{path}.family (one of llama, qwen2, qwen3)")
  if qkv or qk:
    values.setdefault("family", "qwen2" if qkv else "qwen3")
  return values


def _by_concern(values: Mapping[str, Any], old: dict[str, tuple[str, str]]) -> dict:
  """A section written before its settings were split by concern (a run's config.json from
  before issue 53's `rl` sections or issue 63's `model` ones: flat fields, `old`), nested into
  today's sections."""
  out = {name: dict(value) if isinstance(value, Mapping) else value
         for name, value in values.items() if not (name in old and not isinstance(value, Mapping))}
  for name, value in values.items():  # (a field its new section sets too keeps the new value)
    if name in old and not isinstance(value, Mapping):
      section, field = old[name]
      out.setdefault(section, {}).setdefault(field, value)
  return out


def from_mapping(cls: type, values: Mapping[str, Any], path: str = "config"):
  """Builds dataclass `cls` from a (nested) mapping, naming the first bad field in the error."""
  if cls is ModelConfig and ("qkv_bias" in values or "qk_norm" in values):
    values = _family_of_flags(values, path)
  if cls in (ModelConfig, RLConfig):
    values = _by_concern(values, OLD_MODEL_FIELDS if cls is ModelConfig else OLD_RL_FIELDS)
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls)}
  kwargs = {}
  for name, value in values.items():
    where = f"{path}.{name}"
    if name not in fields:
      raise ConfigError(unknown_field(where, name, fields))
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
    return cls(**kwargs)
  except ValueError as e:
    raise ConfigError(f"{path}.{e}") from None


def resolve(config, *, hf: bool = True) -> ExperimentConfig:
  """An ExperimentConfig from an ExperimentConfig, a ConfigDict or a mapping (validated), its
  model section completed from `model.hf_path`'s config.json when one is given (unless `hf` is
  False: a base that overrides still change)."""
  if hasattr(config, "to_dict"):  # ml_collections.ConfigDict
    config = config.to_dict()
  if isinstance(config, Mapping):
    config = from_mapping(ExperimentConfig, config)
  if not isinstance(config, ExperimentConfig):
    raise TypeError(f"expected an ExperimentConfig, a ConfigDict or a mapping, got {type(config)}")
  return with_hf_model(config) if hf else config


def with_hf_model(cfg: ExperimentConfig) -> ExperimentConfig:
  """The model's dimensions from `model.hf_path`'s config.json; a field the config sets to
  something else is a ConfigError naming both values."""
  path = cfg.model.hf_path
  if not path:
    return cfg
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise ConfigError(f"config.model.hf_path: {path!r} is not a Hugging Face model directory "
                      f"(no config.json)")
  try:
    model = check_config(cfg.model, model_config_from_hf(path), ModelConfig())
  except HFError as e:
    raise ConfigError(str(e)) from None
  # Absolute, so that a restore from another working directory finds the weights again.
  return dataclasses.replace(cfg, model=dataclasses.replace(model, hf_path=os.path.abspath(path)))


def _register() -> None:
  global _registered
  if _registered:
    return
  for name, cls in SECTIONS.items():
    gin.external_configurable(cls, name=name, module="jaxrl")
  scalars = [(f.name, f.type, dataclasses.field(default=f.default))
             for f in dataclasses.fields(ExperimentConfig) if f.name not in SECTIONS]
  gin.external_configurable(dataclasses.make_dataclass(TOP_LEVEL, scalars), name=TOP_LEVEL,
                            module="jaxrl")
  _registered = True


def _gin_error(e: Exception) -> str:
  """One line for gin's error: a value it cannot read names the binding (or file and line) and
  the value, not Python's `malformed node or string: <ast.Name object ...>`."""
  token = re.search(r"Failed to parse token '([^']*)'", str(e))
  where = e.args[1] if isinstance(e, SyntaxError) and len(e.args) > 1 else None
  if token and hasattr(where, "line_content"):
    at = (f"{where.filename}:{where.line_num}" if where.filename
          else f"--gin_param {where.line_content.strip()!r}")
    return (f"gin: {at}: cannot read the value {token[1]!r} (a string is quoted in gin: "
            f"'{token[1]}'; a number, True/False, a list [..] are written as in Python)")
  param = re.search(r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'", str(e))
  now = param and moved(f"{param[1]}.{param[2]}")
  if now:
    return f"gin: {param[1]}.{param[2]} has moved to {now}"
  return f"gin: {first_line(e)}"


def gin_overrides(files: Sequence[str] = (), bindings: Sequence[str] = ()) -> dict:
  """The fields that gin files and bindings set, as a nested dict of overrides."""
  _register()
  gin.clear_config()
  try:
    with gin.unlock_config():
      gin.parse_config_files_and_bindings(list(files), list(bindings), skip_unknown=False)
  except (ValueError, SyntaxError, OSError, KeyError) as e:
    raise ConfigError(_gin_error(e)) from None
  out = dict(gin.get_bindings(f"jaxrl.{TOP_LEVEL}"))
  for name in SECTIONS:  # (sections before their own sections: "rl" before "rl.loss")
    fields = gin.get_bindings(f"jaxrl.{name}")
    if fields:
      *parents, last = name.split(".")
      node = out
      for parent in parents:
        node = node.setdefault(parent, {})
      node.setdefault(last, {}).update(fields)
  gin.clear_config()
  return out


def merge(base: Mapping, overrides: Mapping) -> dict:
  """`base` with `overrides` applied field by field (sections merge, values replace)."""
  out = dict(base)
  for key, value in overrides.items():
    if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
      out[key] = merge(out[key], value)
    else:
      out[key] = value
  return out


def with_gin(base, files: Sequence[str] = (), bindings: Sequence[str] = ()) -> ExperimentConfig:
  """`base` (anything `resolve` takes) with gin files and bindings on top."""
  return resolve(merge(to_dict(resolve(base, hf=False)), gin_overrides(files, bindings)))


def config_module(path: str) -> types.ModuleType:
  """The experiment file at `path`, loaded as a module of its own (anew at each call): configs
  are files found by path, not an installed package, and one builds on another with `sibling`."""
  name = "_jaxrl_config_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# configs/ of the checkout jaxrl runs from: found by path, never installed as a package
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def shipped(name: str) -> types.ModuleType:
  """The experiment file configs/`name`.py of jaxrl's checkout, loaded (a notebook's way to the
  shipped configs, from any directory)."""
  return config_module(os.path.join(CONFIGS, f"{name}.py"))


def sibling(file: str, name: str) -> types.ModuleType:
  """The experiment file `name`.py beside `file` (a config file's `__file__`), loaded: how a
  config builds on another wherever it is run from (`default = sibling(__file__, "default")`)."""
  return config_module(os.path.join(os.path.dirname(os.path.abspath(file)), f"{name}.py"))
