"""REINFORCE++ on the default task: the KL to the reference folded into per-token rewards (k1),
returns-to-go normalised over the whole batch (no per-prompt baseline, no critic).

Run:  .venv/bin/jaxrl-train --config=configs/reinforce_pp_reverse.py
"""
from jaxrl.config_files import sibling

default = sibling(__file__, "default")


def get_config():
  c = default.get_config()
  c.rl.advantage.update(name="reinforce_pp")
  c.rl.kl.update(mode="reward", estimator="k1", coef=0.02)
  return c
