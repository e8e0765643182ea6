"""The default experiment with asynchronous RL: the sampler (devices 4-7) generates the next batch
while the trainer (devices 0-3) updates on the previous one, at most one policy version behind
(`max_staleness=1`). The lag is corrected by a token-level truncated importance weight
min(pi_old / mu, 2) on the PPO loss (`tis_cap`), mu being the sampler's own log-prob.

Run:  .venv/bin/jaxrl-train --config=configs/async_reverse.py
"""
from jaxrl.config_files import sibling

default = sibling(__file__, "default")


def get_config():
  c = default.get_config()
  c.rl.schedule.update(mode="async", max_staleness=1)
  c.rl.correction.update(tis_cap=2.0)
  return c
