"""Where the pure steps meet the mesh: every hot function is jitted here, once, with shardings."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.config import ExperimentConfig
from jaxrl.models.llama import LanguageModel
from sampler.engine import Rollout, generate
from sampler.methods import SamplingConfig
from sharding.mesh import batch_sharding, init_sharded, param_shardings
from sharding.placement import PlacementError, host_major_devices, make_placement
from sharding.reshard import TransferStats, reshard
from sharding.rules import SAMPLER_RULES, TRAIN_RULES, activation_rules
from train import steps


class Trainer:
  """The actor on its train mesh plus its shadow copy on the sampler mesh (see placement).

  After every update `sync_sampler()` reshards the weights into the sampler's layout: across
  devices for `separate`, in place (fsdp -> tensor parallel) for `colocate`.
  """

  def __init__(self, cfg: ExperimentConfig, *, prompt_len: int, max_new_tokens: int, eos_id: int,
               pad_id: int):
    self.cfg = cfg
    self.prompt_len = prompt_len
    devices = host_major_devices()
    pl = cfg.placement
    self.placement = make_placement(pl.strategy, len(devices), train_devices=pl.train_devices,
                                    sampler_tensor=pl.sampler_tensor,
                                    n_hosts=jax.process_count())
    self.mesh, self.rules = self.placement.mesh("actor", devices), TRAIN_RULES
    self.sampler_mesh = self.placement.mesh("sampler", devices)
    make_model = lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(cfg.seed))
    abstract = nnx.state(nnx.eval_shape(make_model))
    shardings = {}
    for role, mesh, rules in [("actor", self.mesh, TRAIN_RULES),
                              ("sampler", self.sampler_mesh, SAMPLER_RULES)]:
      try:  # checked on abstract shapes, before anything is allocated or compiled
        shardings[role] = param_shardings(abstract, rules, mesh)
      except ValueError as e:
        raise PlacementError(f"{role}: {e}") from None
    self.graphdef, params, self.param_shardings = init_sharded(make_model, self.rules, self.mesh)
    self.sampler_shardings = shardings["sampler"]
    self.batch_sharding = batch_sharding(self.mesh, self.rules)
    self.sampler_batch = batch_sharding(self.sampler_mesh, SAMPLER_RULES)
    self.sft_optimizer = steps.make_optimizer(
        cfg.sft.learning_rate, warmup_steps=cfg.sft.warmup_steps, total_steps=cfg.sft.steps,
        weight_decay=cfg.sft.weight_decay)
    rl_updates = cfg.rl.steps * cfg.rl.num_minibatches
    self.rl_optimizer = steps.make_optimizer(
        cfg.rl.learning_rate, warmup_steps=min(10, rl_updates // 10), total_steps=rl_updates,
        max_grad_norm=cfg.rl.max_grad_norm)
    self.state = self.new_state(params, self.sft_optimizer)

    sample_cfg = SamplingConfig(max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                                method="temperature", temperature=cfg.rl.temperature,
                                top_k=cfg.rl.top_k)
    greedy_cfg = SamplingConfig(max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                                method="greedy")
    self._sample = self._jit_generate(sample_cfg, n=cfg.rl.group_size)
    self._greedy = self._jit_generate(greedy_cfg)
    self._logprobs = self._jit(
        functools.partial(steps.completion_logprobs, self.graphdef, prompt_len=prompt_len),
        in_shardings=(self.param_shardings, self.batch_sharding, self.batch_sharding))
    self._advantages = jax.jit(functools.partial(steps.advantages, cfg=cfg.rl))
    self._sft_step = None
    self._rl_step = None
    self.sampler_params = None
    self.sync_sampler()

  def _jit(self, fn, *, mesh=None, rules=None, **kwargs):
    """jit whose trace runs under a mesh's activation rules (default: the train mesh)."""
    mesh, rules = (self.mesh, self.rules) if mesh is None else (mesh, rules)

    def traced(*args):
      with activation_rules(mesh, rules):
        return fn(*args)

    return jax.jit(traced, **kwargs)

  def _jit_generate(self, sample_cfg: SamplingConfig, n: int = 1):
    return self._jit(functools.partial(generate, self.graphdef, cfg=sample_cfg, n=n),
                     mesh=self.sampler_mesh, rules=SAMPLER_RULES,
                     in_shardings=(self.sampler_shardings, self.sampler_batch,
                                   self.sampler_batch, None))

  def sync_sampler(self) -> TransferStats:
    """Refreshes the sampler's copy of the actor (the old copy is donated)."""
    old = self.sampler_params
    self.sampler_params, stats = reshard(self.state.params, self.sampler_shardings,
                                         bucket_bytes=self.cfg.placement.reshard_bucket_mb << 20)
    if old is not None:
      jax.tree.map(lambda x: x.delete(), old)
    return stats

  def new_state(self, params, optimizer) -> steps.TrainState:
    replicated = NamedSharding(self.mesh, PartitionSpec())
    # Moments take their parameter's sharding; scalars (counts) are replicated over the mesh.
    opt_shardings = optax.tree_map_params(
        optimizer, lambda _, sharding: sharding, jax.eval_shape(optimizer.init, params),
        self.param_shardings, transform_non_params=lambda _: replicated)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    return steps.TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), replicated),
                            params=params, opt_state=opt_state)

  def _state_shardings(self):
    return jax.tree.map(lambda x: x.sharding, self.state)

  def put_batch(self, batch: dict) -> dict:
    """Host arrays -> device arrays split over the mesh's batch axes (leading dimension)."""
    return {k: jax.device_put(v, batch_sharding(self.mesh, self.rules, np.ndim(v)))
            for k, v in batch.items()}

  # -- SFT ----------------------------------------------------------------------------------
  def sft_step(self, batch: dict) -> dict:
    if self._sft_step is None:
      sh = self._state_shardings()
      self._sft_step = self._jit(
          functools.partial(steps.sft_update, graphdef=self.graphdef, optimizer=self.sft_optimizer),
          in_shardings=(sh, None), out_shardings=(sh, None), donate_argnums=0)
    self.state, metrics = self._sft_step(self.state, self.put_batch(batch))
    return metrics

  # -- RL -----------------------------------------------------------------------------------
  def start_rl(self) -> nnx.State:
    """Freezes a reference copy of the current actor and resets the optimizer for RL."""
    reference = jax.tree.map(jnp.copy, self.state.params)
    self.state = self.new_state(self.state.params, self.rl_optimizer)
    return reference

  def rl_step(self, batch: dict) -> dict:
    if self._rl_step is None:
      sh = self._state_shardings()
      self._rl_step = self._jit(
          functools.partial(steps.rl_update, graphdef=self.graphdef, optimizer=self.rl_optimizer,
                            cfg=self.cfg.rl, prompt_len=self.prompt_len),
          in_shardings=(sh, None), out_shardings=(sh, None), donate_argnums=0)
    self.state, metrics = self._rl_step(self.state, batch)
    return metrics

  def sample(self, prompts: dict, key) -> Rollout:
    """`group_size` samples per prompt, group-major, on the sampler mesh (host arrays out)."""
    return jax.device_get(self._sample(self.sampler_params, *self._prompts(prompts), key))

  def greedy(self, prompts: dict) -> Rollout:
    return jax.device_get(self._greedy(self.sampler_params, *self._prompts(prompts),
                                       jax.random.key(0)))

  def _prompts(self, prompts: dict):
    return (jax.device_put(prompts["prompt_tokens"], self.sampler_batch),
            jax.device_put(prompts["prompt_valid"], self.sampler_batch))

  def completion_logprobs(self, params, rollout: Rollout) -> jax.Array:
    """Trainer-side log-probs of a (host) rollout on the train mesh."""
    batch = self.put_batch({"tokens": rollout.tokens_BT, "valid": rollout.valid_BT})
    return self._logprobs(params, batch["tokens"], batch["valid"])[0]

  def advantages(self, rewards_B: np.ndarray, mask_BN: np.ndarray) -> jax.Array:
    return self._advantages(jnp.asarray(rewards_B, jnp.float32), jnp.asarray(mask_BN))
