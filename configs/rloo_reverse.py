"""RLOO on the default task: each sample's baseline is the mean reward of the other samples of
its prompt (group of 8), with the PPO clipped loss and k3 KL to the reference.

Run:  .venv/bin/jaxrl-train --config=configs/rloo_reverse.py
"""
from jaxrl.config_files import sibling

default = sibling(__file__, "default")


def get_config():
  c = default.get_config()
  c.rl.advantage.update(name="rloo")
  return c
