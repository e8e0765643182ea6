"""The generator: the RL's two samplers on the sampler mesh, and the prompts' way onto it.

`sample` draws `group_size` completions per prompt at the RL temperature and `greedy` decodes
for evaluation; each is a `sampler.sampler.Sampler` compiled once for the sampler layout's
shardings, and its rollouts stay on the sampler's devices. With `rl.inflight_slots > 0` both
decode through in-flight batching (row slots refilled as rows finish), which returns the same
rollouts. In async mode the RL controller runs `sample` inside a `sampler.worker.RolloutWorker`;
either way prompt batch i is drawn with `rollout_key(seed, i)`.
"""
from __future__ import annotations

import jax

from jaxrl.config import ConfigError, RLConfig
from sampler.engine import Rollout
from sampler.methods import SamplingConfig
from sampler.sampler import Sampler
from sampler.worker import rollout_key
from sharding.mesh import batch_sharding
from sharding.rules import SAMPLER_RULES
from train.cluster import RoleCluster
from train.host_transfers import to_device


def _sampler(cluster: RoleCluster, cfg: SamplingConfig, n: int, inflight_slots: int) -> Sampler:
  """The actor's sampler on the sampler mesh; what cannot run is a ConfigError on the field."""
  try:
    return Sampler(cluster.actor.graphdef, cfg, n=n, mesh=cluster.meshes["sampler"],
                   param_shardings=cluster.sampler_shardings, inflight_slots=inflight_slots)
  except ValueError as e:
    raise ConfigError(f"config.rl.inflight_slots: {e}") from None


class Generator:

  def __init__(self, cluster: RoleCluster, *, max_new_tokens: int, tok, rl: RLConfig):
    """`tok`: the run's tokenizer (its EOS, PAD and further stop tokens such as `<|eot_id|>`)."""
    ends = dict(max_new_tokens=max_new_tokens, eos_id=tok.eos_id, pad_id=tok.pad_id,
                stop_sequences=tuple((i,) for i in tok.stop_ids if i != tok.eos_id))
    rollout_ends = dict(ends, stop_sequences=()) if rl.ignore_eos else ends
    sampling = SamplingConfig(**rollout_ends, method="temperature", temperature=rl.temperature,
                              top_k=rl.top_k, ignore_eos=rl.ignore_eos)
    self.sampler = _sampler(cluster, sampling, rl.group_size, rl.inflight_slots)
    self.greedy_sampler = _sampler(cluster, SamplingConfig(**ends, method="greedy"), 1,
                                   rl.inflight_slots)
    self._rows = batch_sharding(cluster.meshes["sampler"], SAMPLER_RULES)

  def put_prompts(self, prompts: dict):
    """A host prompt batch -> (tokens_BP, valid_BP) split over the sampler's data axes."""
    return to_device((prompts["prompt_tokens"], prompts["prompt_valid"]),
                     (self._rows, self._rows), "prompts")

  def sample(self, params, prompts: dict, key: jax.Array) -> Rollout:
    """`group_size` samples per prompt (rows group-major), from `params` in the sampler
    layout; prompt batch i of a run uses `sampler.worker.rollout_key(seed, i)`."""
    return self.sampler.generate(params, *self.put_prompts(prompts), key)

  def greedy(self, params, prompts: dict) -> Rollout:
    return self.greedy_sampler.generate(params, *self.put_prompts(prompts), rollout_key(0, 0))
