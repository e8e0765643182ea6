"""The generator: the sampler engine on the sampler mesh.

`sample` draws `group_size` completions per prompt at the RL temperature and `greedy` decodes
for evaluation; each is jitted once, with the sampler layout's shardings, and its rollouts stay
on the sampler's devices. With `rl.inflight_slots > 0` both decode through in-flight batching
(sampler/inflight.py: row slots refilled as rows finish), which returns the same rollouts. In
async mode the RL controller runs `sample` inside a `sampler.worker.RolloutWorker`; either way
prompt batch i is drawn with `rollout_key(seed, i)`.
"""
from __future__ import annotations

import jax

from jaxrl.config import ConfigError, RLConfig
from sampler.engine import Rollout
from sampler.inflight import jit_inflight
from sampler.methods import SamplingConfig
from sampler.sampler import jit_generate
from sampler.worker import rollout_key
from sharding.mesh import batch_sharding
from sharding.rules import SAMPLER_RULES
from train.cluster import RoleCluster
from train.host_transfers import to_device


def _jit(cluster: RoleCluster, cfg: SamplingConfig, n: int, inflight_slots: int):
  """The static engine (`jit_generate`), or in-flight batching in `inflight_slots` row slots."""
  mesh = cluster.meshes["sampler"]
  if not inflight_slots:
    return jit_generate(cluster.actor.graphdef, cfg, n=n, mesh=mesh,
                        param_shardings=cluster.sampler_shardings)
  if jax.process_count() > 1:
    raise ConfigError("config.rl.inflight_slots: in-flight batching runs in one process; set 0 "
                      "for multi-host runs")
  try:
    return jit_inflight(cluster.actor.graphdef, cfg, slots=inflight_slots, n=n, mesh=mesh)
  except ValueError as e:
    raise ConfigError(f"config.rl.inflight_slots: {e}") from None


class Generator:

  def __init__(self, cluster: RoleCluster, *, max_new_tokens: int, tok, rl: RLConfig):
    """`tok`: the run's tokenizer (its EOS, PAD and further stop tokens such as `<|eot_id|>`)."""
    mesh = cluster.meshes["sampler"]
    ends = dict(max_new_tokens=max_new_tokens, eos_id=tok.eos_id, pad_id=tok.pad_id,
                stop_sequences=tuple((i,) for i in tok.stop_ids if i != tok.eos_id))
    rollout_ends = dict(ends, stop_sequences=()) if rl.ignore_eos else ends
    self.sampling = SamplingConfig(**rollout_ends, method="temperature",
                                   temperature=rl.temperature, top_k=rl.top_k,
                                   ignore_eos=rl.ignore_eos)
    self.greedy_sampling = SamplingConfig(**ends, method="greedy")
    self._sample = _jit(cluster, self.sampling, rl.group_size, rl.inflight_slots)
    self._greedy = _jit(cluster, self.greedy_sampling, 1, rl.inflight_slots)
    self._rows = batch_sharding(mesh, SAMPLER_RULES)

  def put_prompts(self, prompts: dict):
    """A host prompt batch -> (tokens_BP, valid_BP) split over the sampler's data axes."""
    return to_device((prompts["prompt_tokens"], prompts["prompt_valid"]),
                     (self._rows, self._rows), "prompts")

  def sample(self, params, prompts: dict, key: jax.Array) -> Rollout:
    """`group_size` samples per prompt (rows group-major), from `params` in the sampler
    layout; prompt batch i of a run uses `sampler.worker.rollout_key(seed, i)`."""
    return self._sample(params, *self.put_prompts(prompts), key)

  def greedy(self, params, prompts: dict) -> Rollout:
    return self._greedy(params, *self.put_prompts(prompts), rollout_key(0, 0))
