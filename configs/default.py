"""Default experiment: a tiny Llama learns to reverse strings with SFT, then GRPO, on the CPU.

The SFT demonstrations come from an imperfect teacher with an off-by-one bug: 60% of its answers
reverse all but the last character (`rev abcde=` -> `dcbae` instead of `edcba`). SFT copies the
bug; GRPO with the exact-match verifier fixes it. Set `task.teacher_error=0` for clean demos.

The values are the schema's defaults (jaxrl/config.py, one documented field each), so this file,
the dataclasses and `configs/default.gin` can never disagree.

Run:   make run
  or:  .venv/bin/jaxrl-train --config=configs/default.py
Override any field: --config.rl.steps=50 --config.task.name=addition --config.task.num_digits=2
"""
from jaxrl.config import ExperimentConfig, config_dict


def get_config():
  return config_dict(ExperimentConfig())
