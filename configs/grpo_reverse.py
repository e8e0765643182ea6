"""GRPO on the default task: group-normalised advantages, clipped loss, k3 KL to the reference.

This is `configs/default.py` (what `make run` runs), named for the algorithm; see
docs/algorithms.md for its measured numbers next to the other algorithms'.

Run:  .venv/bin/jaxrl-train --config=configs/grpo_reverse.py
"""
from jaxrl.config_files import sibling

default = sibling(__file__, "default")


def get_config():
  c = default.get_config()
  c.rl.advantage.update(name="grpo")
  c.rl.kl.update(mode="loss", estimator="k3", coef=0.02)
  return c
