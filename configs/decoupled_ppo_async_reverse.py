"""Decoupled PPO (AReaL) with asynchronous generation two policy versions ahead: the clip is
around the proximal policy (the trainer's weights before each update) and the behaviour policy
(the sampler's, up to 2 versions older) enters as the weight pi_old / mu, with tokens whose weight
exceeds 5 dropped (the token rejection mask, band [0, 5]).

Run:  .venv/bin/jaxrl-train --config=configs/decoupled_ppo_async_reverse.py
Against AIPO at the same staleness: add --config.rl.loss.name=aipo --config.rl.correction.mask=none
"""
from jaxrl.config_files import sibling

default = sibling(__file__, "default")


def get_config():
  c = default.get_config()
  c.rl.schedule.update(mode="async", max_staleness=2)
  c.rl.loss.update(name="decoupled_ppo")
  c.rl.correction.update(mask="token", mask_low=0.0, mask_high=5.0)
  return c
