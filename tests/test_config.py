import glob
import os
import subprocess
import sys

import pytest

from train.cli.flags import parse_args
from jaxrl.config_files import shipped
from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.config_files import from_mapping, resolve, with_gin

default = shipped("default")

ROOT = __file__.rsplit("/tests/", 1)[0]


def _cfg(**overrides):
  raw = default.get_config().to_dict()
  for dotted, value in overrides.items():
    *path, leaf = dotted.split("__")
    node = raw
    for p in path:
      node = node[p]
    node[leaf] = value
  return from_mapping(ExperimentConfig, raw)


def test_default_config_is_the_schema_defaults():
  cfg = _cfg()
  assert cfg == ExperimentConfig()
  assert cfg.task.name == "reverse" and cfg.placement.strategy == "separate" and cfg.task.teacher_error == 0.6
  assert cfg.rl.steps == 150 and cfg.sft.steps == 800


@pytest.mark.parametrize("gin_file", sorted(glob.glob(os.path.join(ROOT, "configs", "*.gin"))))
def test_gin_twin_resolves_to_the_same_config(gin_file):
  module = shipped(os.path.basename(gin_file)[:-4])
  assert with_gin(default.get_config(), [gin_file]) == from_mapping(
      ExperimentConfig, module.get_config().to_dict())


def test_gin_and_ml_collections_command_lines_agree():
  gin_line = ["x", f"--gin_file={ROOT}/configs/tiny.gin", "--gin_param=rl.steps=5",
              "--gin_param=experiment.seed=3", "--gin_param=rl.schedule.mode='async'"]
  ml_line = ["x", f"--config={ROOT}/configs/tiny.py", "--config.rl.steps=5", "--config.seed=3",
             "--config.rl.schedule.mode=async"]
  resolved = []
  for argv in (gin_line, ml_line):
    raw, files, params, resume = parse_args(argv)
    resolved.append(with_gin(raw, files, params))
  assert resolved[0] == resolved[1] and resolved[0].rl.steps == 5 and resolved[0].seed == 3


@pytest.mark.parametrize("binding,message", [
    ("rl.stepz = 3", "gin: Configurable 'rl' doesn't have a parameter named 'stepz'"),
    ("chess.steps = 3", "gin: No configurable matching 'chess'"),
    ("rl.steps = 'ten'", "config.rl.steps: expected int, got 'ten'"),
    ("rl.steps = ", "gin: Unable to parse value"),
])
def test_bad_gin_bindings_are_named(binding, message):
  with pytest.raises(ConfigError) as e:
    with_gin(default.get_config(), [], [binding])
  assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides,message", [
    ({"rl__stepz": 3}, "config.rl.stepz: unknown field"),
    ({"rl__steps": "ten"}, "config.rl.steps: expected int, got 'ten'"),
    ({"rl__steps": 2.5}, "config.rl.steps: expected int"),
    ({"sft__learning_rate": True}, "config.sft.learning_rate: expected float"),
    ({"task__name": "chess"}, "config.task.name: expected one of"),
    ({"rl__advantage__name": "ppo2"}, "config.rl.advantage.name: expected one of"),
    ({"model__dtype": "fp8"}, "config.model.dtype: expected one of"),
    ({"rl__group_size": 0}, "config.rl.group_size: expected > 0"),
    ({"model": 3}, "config.model: expected a section"),
    ({"model__n_kv_heads": 3}, "config.model.n_heads: 4 must be a multiple of n_kv_heads=3"),
    ({"task__teacher_error": 1.5}, "config.task.teacher_error: expected in [0, 1]"),
    ({"rl__advantage__name": "reinforce_pp"}, "config.rl.kl.mode: reinforce_pp folds the KL"),
    ({"rl__reward": "human"}, "config.rl.reward: expected one of"),
    ({"rl__loss__name": "ppo2"}, "config.rl.loss.name: expected one of"),
    ({"rl__correction__mask": "band"}, "config.rl.correction.mask: expected one of"),
    ({"rl__correction__mask_low": 3.0}, "config.rl.correction.mask_low: at most mask_high (2.0)"),
    ({"rl__dapo__overlong_buffer": 9},
     "config.rl.dapo.overlong_buffer: at most rollout.max_new_tokens (8), got 9"),
    ({"rl__dapo__dynamic_sampling": True, "rl__reward": "reward_model", "reward_model__steps": 5},
     "config.rl.dapo.dynamic_sampling: needs reward='verifier'"),
    ({"rl__schedule__partial_rollouts": True},
     "config.rl.schedule.partial_rollouts: needs mode='async'"),
    ({"rl__schedule__partial_rollouts": True, "rl__schedule__mode": "async"},
     "config.rl.schedule.partial_rollouts: rows continue across weight swaps in in-flight slots; "
     "set rollout.inflight_slots > 0"),
    ({"rl__schedule__name": "fixed", "rl__dapo__dynamic_sampling": True},
     "config.rl.schedule.name: 'fixed' ties batch i to version i - max_staleness"),
    ({"rl__schedule__name": "exact"}, "config.rl.schedule.name: expected one of ['fixed', 'free']"),
    ({"rl__advantage__lam": 1.5}, "config.rl.advantage.lam: expected in [0, 1]"),
    ({"rl__reward": "reward_model", "reward_model__steps": 0}, "config.reward_model.steps"),
    ({"dpo__beta": 0.0}, "config.dpo.beta: expected > 0"),
    ({"rl__schedule__mode": "async", "placement__strategy": "colocate"},
     "config.rl.schedule.mode: async needs the sampler on devices of its own"),
    ({"rl__schedule__mode": "async", "placement__strategy": "interleave"}, "use mode='sync'"),
    ({"rl__schedule__mode": "later"}, "config.rl.schedule.mode: expected one of"),
    ({"rl__schedule__max_staleness": -1}, "config.rl.schedule.max_staleness: expected >= 0"),
])
def test_bad_fields_are_named(overrides, message):
  with pytest.raises(ConfigError) as e:
    _cfg(**overrides)
  assert message in str(e.value)
  assert "\n" not in str(e.value)


def test_a_run_dir_from_before_model_families_still_reads():
  """A config.json written when Qwen blocks were flags (`qkv_bias`, `qk_norm`) reads as the family
  they were; both at once were never a family and are refused naming the field."""
  old = {"model": {"qkv_bias": True, "qk_norm": False, "d_model": 64, "n_heads": 4,
                   "head_dim": 16}}
  assert from_mapping(ExperimentConfig, old).model.family == "qwen2"
  assert from_mapping(ExperimentConfig, {"model": {"qk_norm": True}}).model.family == "qwen3"
  assert from_mapping(ExperimentConfig, {"model": {"qkv_bias": False}}).model.family == "llama"
  with pytest.raises(ConfigError, match="config.model.qkv_bias"):
    from_mapping(ExperimentConfig, {"model": {"qkv_bias": True, "qk_norm": True}})


_FLAT_SECTIONS = {  # section -> (its golden file, a flat field it had, a typo of that field)
    "rl": ("rl_config_before_issue_53.json", "clip_eps_low", "clip_eps_lo"),
    "model": ("model_config_before_issue_63.json", "rope_theta", "rope_thet"),
}


@pytest.mark.parametrize("section,name", [
    *[("rl", n) for n in ["default", "partial_reverse", "ppo_rlhf_tiny", "dapo_reverse",
                          "gsm8k_tools", "decoupled_ppo_async_reverse"]],
    *[("model", n) for n in ["default", "qwen3_30b_a3b_gsm8k", "gemma3_4b_gsm8k",
                             "llama3_1_8b_gsm8k_lora"]]])
def test_a_run_dir_from_before_the_sections_still_reads(section, name):
  """A section of config.json as runs wrote it before its fields were split by concern (the
  golden files under tests/golden/: written by the commit before each split, from these config
  files; `rl` flat before issue 53, `model` before issue 63: `rope_theta`, `n_experts`, `remat`,
  ...) reads as today's config of the same file, every field in its new section."""
  import json
  golden, flat, typo = _FLAT_SECTIONS[section]
  with open(os.path.join(ROOT, "tests", "golden", golden)) as f:
    old = json.load(f)[name]
  assert flat in old and ("loss" if section == "rl" else "rope") not in old  # (the flat form)
  today = resolve(shipped(name).get_config(), hf=False)
  assert getattr(from_mapping(ExperimentConfig, {section: old}), section) == getattr(today, section)
  with pytest.raises(ConfigError, match=f"config.{section}.{typo}: unknown field"):
    from_mapping(ExperimentConfig, {section: {typo: 0.1}})  # (a typo stays an error)


def test_int_is_accepted_for_float():
  assert _cfg(rl__learning_rate=1).rl.learning_rate == 1.0


@pytest.mark.parametrize("arg,message", [  # tests/faults/ checks 60 others in this process
    ("--config.rl.stepz=3", "rl.stepz"),
    ("--config.placement.train_devices=9", "placement.train_devices: 9 does not split the 8 devices"),
])
def test_cli_user_error_exits_2_with_one_line(arg, message, tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "train.cli.train", "--config=configs/tiny.py", *arg.split(),
       f"--config.run_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("jaxrl: error:"), proc.stderr
  assert message in lines[0]
  assert "Traceback" not in proc.stderr
