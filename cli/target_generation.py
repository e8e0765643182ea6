"""The generation programs of a run, lowered for a target compile (cli/target_compile.py): as the
Generator (train/rollout/generator.py) builds its samplers, by what the config decodes with.

  static     one program, prefill and the decode loop (sync, and async whole batches)
  slots      in-flight batching of a batch's rows (`rl.rollout.inflight_slots`)
  stream     partial rollouts (`rl.schedule.partial_rollouts`): rows of several batches
  turns      multi-turn conversations (`rl.environment.name`): turns in slots that keep their
             caches, or without them each turn's whole context in a static batch

Each in-flight engine is a host loop over a few programs (sampler/lowering.py); they run one
after another, so the generation phase's peak is the largest of them. A turn's sampler ends also
at the environment's stop strings, which need the environment itself (a process, for a hosted
one): they are left out here, a few token comparisons per step.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.config import ConfigError, ExperimentConfig
from sampler import lowering
from sampler.sampler import BATCH_BUCKETS, LENGTH_BUCKETS, Sampler
from sampler.engine import bucket
from sampler.requests import WIDTH_STEP
from sharding.mesh import batch_sharding
from sharding.rules import SAMPLER_RULES
from train.roles.cluster import RoleCluster
from train.rollout.generator import check_slots, keeps_turn_cache, rl_sampling
from train.rollout.multiturn import pow2_multiple, slots_for
from train.rollout.source import stream_geometry
from train.task.task import load_tokenizer_for

S = jax.ShapeDtypeStruct


def rl_sampler(cfg: ExperimentConfig, cluster: RoleCluster) -> Sampler:
  """The RL sampler as the Generator builds it (the run's tokenizer for its stop tokens when it
  is here; else placeholder ids, which change no shape)."""
  rl = cfg.rl
  try:
    tok = load_tokenizer_for(cfg)
    eos, pad, stops = tok.eos_id, tok.pad_id, tuple((i,) for i in tok.stop_ids if i != tok.eos_id)
  except ConfigError:
    eos, pad, stops = 1, 0, ()
  sampling = rl_sampling(rl.rollout, rl.rollout.max_new_tokens, eos, pad, stops)
  weights = cluster.sampler_weights
  try:
    return Sampler(weights.graphdef, sampling, n=rl.group_size, mesh=cluster.meshes["sampler"],
                   param_shardings=weights.shardings, inflight_slots=rl.rollout.inflight_slots)
  except ValueError as e:
    raise ConfigError(f"config.rl.rollout.inflight_slots: {e}") from None


def _static(sampler: Sampler, params, tokens_BP: S, name: str, budget: bool = False):
  valid = S(tokens_BP.shape, bool, sharding=tokens_BP.sharding)
  key = jax.eval_shape(lambda: jax.random.key(0))
  max_new = S((tokens_BP.shape[0] * sampler.n,), jnp.int32) if budget else None
  return [(name, lambda: sampler.variant(inflight_slots=0).lower(params, tokens_BP, valid, key,
                                                                max_new))]


def _turns(cfg: ExperimentConfig, sampler: Sampler, params) -> lowering.Lowerings:
  """A turn's programs: the RL sampler with one sample per row (each row is a conversation)."""
  rl, turn = cfg.rl, sampler.variant(n=1)
  rows = rl.rollouts
  if rl.rollout.inflight_slots or keeps_turn_cache(rl, cfg.model.sliding_window):
    slots = rl.rollout.inflight_slots or slots_for(turn, rows)
    width = (cfg.data.max_prompt_tokens if rl.schedule.partial_rollouts
             else pow2_multiple(cfg.data.max_prompt_tokens, WIDTH_STEP))
    return lowering.requests(turn.variant(inflight_slots=slots), params, width)
  # each turn its whole conversation, up to the prompt and the rollout's budget, bucketed
  width = bucket(cfg.data.max_prompt_tokens + rl.rollout.max_new_tokens, LENGTH_BUCKETS)
  tokens = S((bucket(rows, BATCH_BUCKETS), width), jnp.int32)
  return _static(turn, params, tokens, "turns: generate (whole contexts)", budget=True)


def generation(cfg: ExperimentConfig, cluster: RoleCluster
               ) -> list[tuple[str, Callable[[], Any], Any]]:
  """(name, lower, state) of each generation program, in the order the run calls them; `state`:
  its arguments that stay on the devices through a step (the sampler's weights)."""
  rl = cfg.rl
  check_slots(rl, cfg.model.sliding_window)
  sampler, weights = rl_sampler(cfg, cluster), cluster.sampler_weights
  params, grid = weights.abstract(), batch_sharding(cluster.meshes["sampler"], SAMPLER_RULES)
  prompts = S((rl.prompts_per_step, cfg.data.max_prompt_tokens), jnp.int32, sharding=grid)
  if rl.environment.name:
    found = _turns(cfg, sampler, params)
  elif rl.schedule.partial_rollouts:
    found = lowering.stream(sampler, params, stream_geometry(rl, cfg.data.max_prompt_tokens),
                            grid)
  elif rl.rollout.inflight_slots:
    found = lowering.rows(sampler, params, prompts)
  else:
    found = _static(sampler, params, prompts, "generate (prefill + decode loop)")
  # the casts and the static engine take the sampler's weights; the others its cast copy
  return [(name, lower, params if i == 0 else None) for i, (name, lower) in enumerate(found)]
