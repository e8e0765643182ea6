"""Dr. GRPO on the default task: advantages r - group mean (no std), length-free aggregation.

Run:  .venv/bin/jaxrl-train --config=configs/dr_grpo_reverse.py
"""
from jaxrl.config_files import sibling

default = sibling(__file__, "default")


def get_config():
  c = default.get_config()
  c.rl.advantage.update(name="dr_grpo")
  c.rl.loss.update(aggregation="seq_mean_token_sum_norm")
  return c
