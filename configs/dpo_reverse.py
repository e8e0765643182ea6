"""SFT, then DPO on verifier pairs (chosen: the answer; rejected: the SFT policy's own mistakes
and near misses), then GRPO from the DPO policy.

Run:  .venv/bin/jaxrl-train --config=configs/dpo_reverse.py
"""
from jaxrl.config_files import sibling

default = sibling(__file__, "default")


def get_config():
  c = default.get_config()
  c.dpo.update(steps=200, batch_size=32, learning_rate=1e-4, beta=0.1, pairs_per_prompt=1)
  return c
