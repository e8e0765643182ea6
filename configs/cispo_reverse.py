"""CISPO on the default task: every token's log-prob gradient weighted by its importance ratio
pi / pi_old, clipped to at most 3 (eps_high 2; no lower clip) and held constant, so no token loses
its gradient to clipping.

Run:  .venv/bin/jaxrl-train --config=configs/cispo_reverse.py
"""
from jaxrl.config_files import sibling

default = sibling(__file__, "default")


def get_config():
  c = default.get_config()
  c.rl.loss.update(name="cispo", eps_low=1.0, eps_high=2.0)
  return c
