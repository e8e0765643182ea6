"""Partial rollouts on a long tail of response lengths: reverse strings of 2-32 letters with
P(length L) ~ L^-2 (`task.name="reverse_tail"`: most answers are a few letters, each 512-row
batch has one of ~30), asynchronous GRPO one policy version ahead with a truncated IS weight
(as configs/async_reverse.py). The sampler decodes in 128 in-flight slots; with
`rl.schedule.partial_rollouts` its slots stay busy across prompt batches, rows already in flight
take each new policy version between decode segments, and every token keeps the version and the
log-prob it was drawn with (docs/algorithms.md, "Partial rollouts").

Run:  .venv/bin/jaxrl-train --config=configs/partial_reverse.py
Without partial rollouts (whole batches, the same slots):
  --config.rl.schedule.partial_rollouts=False
Reproducible (batch i from version i - 1, resumable bit for bit): --config.rl.schedule.name=fixed
"""
from jaxrl.config_files import sibling

default = sibling(__file__, "default")


def get_config():
  c = default.get_config()
  c.task.update(name="reverse_tail", num_digits=32)
  c.data.max_prompt_tokens = 40
  c.sft.steps = 1500
  c.rl.update(steps=60)
  c.rl.schedule.update(mode="async", max_staleness=1, partial_rollouts=True)
  c.rl.correction.update(tis_cap=2.0)
  c.rl.rollout.update(max_new_tokens=40, inflight_slots=128)
  return c
