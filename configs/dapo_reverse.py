"""DAPO on the default task: clip-higher (eps 0.2 / 0.28), dynamic sampling (groups whose rewards
are all equal are dropped and more prompts generated, at most 3 extra rounds a step), token-level
loss aggregation, overlong filtering and the soft overlong penalty over the budget's last 2
tokens, no KL term.

Run:  .venv/bin/python -m cli.train --config=configs/dapo_reverse.py
"""
from configs import default


def get_config():
  c = default.get_config()
  c.rl.update(clip_eps_low=0.2, clip_eps_high=0.28, dynamic_sampling=True,
              dynamic_sampling_rounds=3, loss_aggregation="token_mean", overlong_filter=True,
              overlong_buffer=2, overlong_penalty=1.0, kl_coef=0.0)
  return c
