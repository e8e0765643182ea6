"""DAPO on the default task: clip-higher (eps 0.2 / 0.28), dynamic sampling (groups whose rewards
are all equal are dropped and more prompts generated, at most 3 extra rounds a step), token-level
loss aggregation, overlong filtering and the soft overlong penalty over the budget's last 2
tokens, no KL term.

Run:  .venv/bin/jaxrl-train --config=configs/dapo_reverse.py
"""
from jaxrl.config_files import sibling

default = sibling(__file__, "default")


def get_config():
  c = default.get_config()
  c.rl.loss.update(eps_low=0.2, eps_high=0.28, aggregation="token_mean")
  c.rl.dapo.update(dynamic_sampling=True, dynamic_sampling_rounds=3, overlong_filter=True,
                   overlong_buffer=2, overlong_penalty=1.0)
  c.rl.kl.update(coef=0.0)
  return c
