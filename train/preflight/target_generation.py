"""The generation programs of a run, lowered for a target compile (target_compile.py): the
run's own `Generator` (train/rollout/generator.py) built on the target's abstract roles, and its
`lowerings`, which lower what `sample` and `stream` run by the decisions they make (the static
engine, in-flight slots, the partial rollouts' stream, or multi-turn turns in slots that keep
their caches or as whole contexts).

Each in-flight engine is a host loop over a few programs (sampler/lowering.py); they run one
after another, so the generation phase's peak is the largest of them. A turn's sampler ends also
at the environment's stop strings, which need the environment itself (a process, for a hosted
one): none is made here, so they are left out, a few token comparisons per step.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.data.tokenizer import ByteTokenizer
from train.roles.cluster import RoleCluster
from train.rollout.generator import Generator
from train.rollout.source import stream_geometry
from train.task.data import load_tokenizer_for


class _Unstepped:
  """The run's environment as a target compile has it: its turns' programs are lowered, never
  run (module docstring: no stop strings)."""
  stop_strings = ()

  def reset(self, example):
    raise RuntimeError("a target compile steps no environment")

  step = reset


def generator(cfg: ExperimentConfig, cluster: RoleCluster) -> Generator:
  """The run's Generator on `cluster`, with the run's tokenizer when it is here (its stop
  tokens), else the byte tokenizer's ids, which change no shape."""
  try:
    tok = load_tokenizer_for(cfg)
  except ConfigError:
    tok = ByteTokenizer()
  return Generator(cluster, max_new_tokens=cfg.rl.rollout.max_new_tokens, tok=tok, rl=cfg.rl,
                   environment=_Unstepped if cfg.rl.environment.name else None)


def generation(cfg: ExperimentConfig, cluster: RoleCluster
               ) -> list[tuple[str, Callable[[], Any], Any]]:
  """(name, lower, state) of each generation program, in the order the run calls them; `state`:
  its arguments that stay on the devices through a step (the sampler's weights)."""
  width = cfg.data.max_prompt_tokens
  made = generator(cfg, cluster)
  try:
    params = cluster.sampler_weights.abstract()
    found = made.lowerings(params, cfg.rl.prompts_per_step, width, stream_geometry(cfg.rl, width))
  finally:
    made.close()
  # the casts and the static engine take the sampler's weights; the others its cast copy
  return [(name, lower, params if i == 0 else None) for i, (name, lower) in enumerate(found)]
