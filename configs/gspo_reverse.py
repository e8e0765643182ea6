"""GSPO on the default task: one length-normalised importance ratio per sequence, clipped at the
sequence level (eps 3e-4 / 4e-4, as the GSPO paper), each sequence's loss averaged over its
tokens and then over the sequences.

Run:  .venv/bin/jaxrl-train --config=configs/gspo_reverse.py
"""
from jaxrl.config_files import sibling

default = sibling(__file__, "default")


def get_config():
  c = default.get_config()
  c.rl.loss.update(name="gspo", eps_low=3e-4, eps_high=4e-4, aggregation="seq_mean_token_mean")
  return c
