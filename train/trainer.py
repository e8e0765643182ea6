"""Where the pure steps meet the meshes: every hot function is jitted here, once, with shardings.

The four RLHF models are `ModelRole`s on their placement role's mesh: the actor (trained, with a
shadow copy on the sampler mesh), the frozen reference, the reward model and the critic.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.config import ExperimentConfig
from jaxrl.models.heads import RewardModel, ValueModel
from jaxrl.models.llama import LanguageModel
from sampler.engine import Rollout
from sampler.methods import SamplingConfig
from sampler.sampler import jit_generate
from sharding.mesh import batch_sharding
from sharding.placement import host_major_devices, make_placement
from sharding.reshard import TransferStats, reshard
from sharding.rules import SAMPLER_RULES
from train import steps
from train.roles import ModelRole, role_shardings


class Trainer:
  """The actor on its train mesh plus its shadow copy on the sampler mesh (see placement), and
  the reference / reward / critic roles once `start_rl` / `init_reward_model` create them.

  After every update `sync_sampler()` reshards the weights into the sampler's layout: across
  devices for `separate`, in place (fsdp -> tensor parallel) for `colocate`.
  """

  def __init__(self, cfg: ExperimentConfig, *, prompt_len: int, max_new_tokens: int, eos_id: int,
               pad_id: int):
    self.cfg = cfg
    self.prompt_len = prompt_len
    self.devices = host_major_devices()
    pl = cfg.placement
    self.placement = make_placement(pl.strategy, len(self.devices), train_devices=pl.train_devices,
                                    sampler_tensor=pl.sampler_tensor,
                                    n_hosts=jax.process_count())
    self.sampler_mesh = self.placement.mesh("sampler", self.devices)
    abstract = nnx.state(nnx.eval_shape(self.model_factory("actor")))
    self.sampler_shardings = role_shardings("sampler", abstract, SAMPLER_RULES, self.sampler_mesh)
    self.actor = ModelRole("actor", self.model_factory("actor"),
                           self.placement.mesh("actor", self.devices))
    self.reference: ModelRole | None = None
    self.reward: ModelRole | None = None
    self.critic: ModelRole | None = None
    self.sampler_batch = batch_sharding(self.sampler_mesh, SAMPLER_RULES)
    self._jitted: dict = {}
    self.actor.set_optimizer(self._sft_optimizer())

    sample_cfg = SamplingConfig(max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                                method="temperature", temperature=cfg.rl.temperature,
                                top_k=cfg.rl.top_k)
    greedy_cfg = SamplingConfig(max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                                method="greedy")
    self._sample = self._jit_generate(sample_cfg, n=cfg.rl.group_size)
    self._greedy = self._jit_generate(greedy_cfg)
    self._advantages = jax.jit(functools.partial(steps.advantages, cfg=cfg.rl))
    self.sampler_params = None
    self.sync_sampler()

  # Back-compat views of the actor.
  @property
  def state(self) -> steps.TrainState:
    return self.actor.state

  @property
  def graphdef(self):
    return self.actor.graphdef

  def model_factory(self, role: str):
    model_cls = {"actor": LanguageModel, "reference": LanguageModel, "reward": RewardModel,
                 "critic": ValueModel}[role]
    return lambda: model_cls(self.cfg.model, rngs=nnx.Rngs(self.cfg.seed))

  def _optimizer(self, lr: float, warmup: int, total: int, max_grad_norm: float = 1.0,
                 weight_decay: float = 0.0):
    return steps.make_optimizer(lr, warmup_steps=warmup, total_steps=total,
                                max_grad_norm=max_grad_norm, weight_decay=weight_decay)

  def _cached(self, key, build):
    if key not in self._jitted:
      self._jitted[key] = build()
    return self._jitted[key]

  def _jit_generate(self, sample_cfg: SamplingConfig, n: int = 1):
    return jit_generate(self.graphdef, sample_cfg, n=n, mesh=self.sampler_mesh,
                        param_shardings=self.sampler_shardings)

  def sampler_copy(self) -> tuple[nnx.State, TransferStats]:
    """The actor's current weights resharded into the sampler's layout (bucketed, timed)."""
    return reshard(self.actor.params, self.sampler_shardings,
                   bucket_bytes=self.cfg.placement.reshard_bucket_mb << 20)

  def sync_sampler(self) -> TransferStats:
    """Refreshes the sampler's copy of the actor (the old copy is donated)."""
    old = self.sampler_params
    self.sampler_params, stats = self.sampler_copy()
    if old is not None:
      jax.tree.map(lambda x: x.delete(), old)
    return stats

  def put_batch(self, batch: dict) -> dict:
    return self.actor.put_batch(batch)

  # -- SFT and DPO (actor) --------------------------------------------------------------------
  def sft_step(self, batch: dict) -> dict:
    update = self._cached("sft", lambda: self.actor.jit_update(functools.partial(
        steps.sft_update, graphdef=self.graphdef, optimizer=self._sft_optimizer())))
    self.actor.state, metrics = update(self.actor.state, self.put_batch(batch))
    return metrics

  def _sft_optimizer(self):
    sft = self.cfg.sft
    return self._cached("sft_opt", lambda: self._optimizer(
        sft.learning_rate, sft.warmup_steps, sft.steps, weight_decay=sft.weight_decay))

  def start_dpo(self, prompt_len: int) -> None:
    """Fresh optimizer for DPO on pair batches whose prompts are padded to `prompt_len`."""
    d = self.cfg.dpo
    self._dpo_optimizer = self._optimizer(d.learning_rate, d.warmup_steps, d.steps)
    self._dpo_prompt_len = prompt_len
    self.actor.set_optimizer(self._dpo_optimizer)

  def dpo_step(self, batch: dict) -> dict:
    """`batch` is a pair batch with `ref_logprobs` [2B] from `sequence_logprobs` (reference)."""
    update = self._cached("dpo", lambda: self.actor.jit_update(functools.partial(
        steps.dpo_update, graphdef=self.graphdef, optimizer=self._dpo_optimizer,
        beta=self.cfg.dpo.beta, prompt_len=self._dpo_prompt_len)))
    self.actor.state, metrics = update(self.actor.state, self.put_batch(batch))
    return metrics

  def sequence_logprobs(self, role: ModelRole, batch: dict, prompt_len: int) -> jax.Array:
    fn = self._cached(("seq_logp", role.name, prompt_len), lambda: role.jit(functools.partial(
        steps.sequence_logprobs, role.graphdef, prompt_len=prompt_len)))
    b = role.put_batch({k: batch[k] for k in ("tokens", "valid", "completion_mask")})
    return fn(role.params, b["tokens"], b["valid"], b["completion_mask"])

  # -- reward model ---------------------------------------------------------------------------
  def init_reward_model(self) -> ModelRole:
    """The reward model on its role's mesh, its trunk copied from the (SFT) actor."""
    rm = self.cfg.reward_model
    self.reward = ModelRole("reward", self.model_factory("reward"),
                            self.placement.mesh("reward", self.devices))
    self.reward.load(self.actor.params, subtree="decoder")
    self._rm_optimizer = self._optimizer(rm.learning_rate, rm.warmup_steps, rm.steps)
    self.reward.set_optimizer(self._rm_optimizer)
    return self.reward

  def reward_model_step(self, batch: dict) -> dict:
    update = self._cached("rm", lambda: self.reward.jit_update(functools.partial(
        steps.reward_model_update, graphdef=self.reward.graphdef, optimizer=self._rm_optimizer)))
    self.reward.state, metrics = update(self.reward.state, self.reward.put_batch(batch))
    return metrics

  def reward_scores(self, tokens_BT, valid_BT) -> jax.Array:
    fn = self._cached("scores", lambda: self.reward.jit(functools.partial(
        steps.sequence_scores, self.reward.graphdef)))
    b = self.reward.put_batch({"tokens": tokens_BT, "valid": valid_BT})
    return fn(self.reward.params, b["tokens"], b["valid"])

  # -- RL -------------------------------------------------------------------------------------
  def start_rl(self) -> None:
    """Freezes the reference (a copy of the current actor on its mesh), resets the actor's
    optimizer for RL and, for `gae`, builds the critic (from the reward model when there is one,
    else from the actor's trunk)."""
    rl = self.cfg.rl
    self.reference = self.actor.frozen_copy(
        "reference", self.placement.mesh("reference", self.devices),
        self.model_factory("reference"))
    updates = rl.steps * rl.num_minibatches
    self._rl_optimizer = self._optimizer(rl.learning_rate, min(10, updates // 10), updates,
                                         rl.max_grad_norm)
    self.actor.set_optimizer(self._rl_optimizer)
    if rl.advantage == "gae":
      self.critic = ModelRole("critic", self.model_factory("critic"),
                              self.placement.mesh("critic", self.devices))
      if self.reward is not None:
        self.critic.load(self.reward.params)
      else:
        self.critic.load(self.actor.params, subtree="decoder")
      self._critic_optimizer = self._optimizer(rl.critic_learning_rate, min(10, updates // 10),
                                               updates, rl.max_grad_norm)
      self.critic.set_optimizer(self._critic_optimizer)

  def rl_step(self, batch: dict) -> dict:
    """One minibatch update of the actor (and of the critic when there is one)."""
    update = self._cached("rl", lambda: self.actor.jit_update(functools.partial(
        steps.rl_update, graphdef=self.graphdef, optimizer=self._rl_optimizer, cfg=self.cfg.rl,
        prompt_len=self.prompt_len)))
    actor_keys = ("tokens", "valid", "completion_mask", "old_logprobs", "ref_logprobs",
                  "sampler_logprobs", "advantages")
    self.actor.state, metrics = update(self.actor.state,
                                       self.put_batch({k: batch[k] for k in actor_keys}))
    if self.critic is not None:
      critic_update = self._cached("critic", lambda: self.critic.jit_update(functools.partial(
          steps.critic_update, graphdef=self.critic.graphdef, optimizer=self._critic_optimizer,
          cfg=self.cfg.rl, prompt_len=self.prompt_len)))
      keys = ("tokens", "valid", "completion_mask", "old_values", "returns")
      self.critic.state, critic_metrics = critic_update(
          self.critic.state, self.critic.put_batch({k: batch[k] for k in keys}))
      metrics = {**metrics, **critic_metrics}
    return metrics

  def sample(self, prompts: dict, key, params=None) -> Rollout:
    """`group_size` samples per prompt, group-major, on the sampler mesh (host arrays out), from
    `params` in the sampler layout (default: the sampler's copy of the actor)."""
    params = self.sampler_params if params is None else params
    return jax.device_get(self._sample(params, *self._prompts(prompts), key))

  def greedy(self, prompts: dict, params=None) -> Rollout:
    params = self.sampler_params if params is None else params
    return jax.device_get(self._greedy(params, *self._prompts(prompts), jax.random.key(0)))

  def _prompts(self, prompts: dict):
    return (jax.device_put(prompts["prompt_tokens"], self.sampler_batch),
            jax.device_put(prompts["prompt_valid"], self.sampler_batch))

  def completion_logprobs(self, role: ModelRole, rollout: Rollout) -> jax.Array:
    """Log-probs of a (host) rollout's completion under `role` (actor or reference), on its mesh."""
    fn = self._cached(("logp", role.name), lambda: role.jit(functools.partial(
        steps.completion_logprobs, role.graphdef, prompt_len=self.prompt_len)))
    b = role.put_batch({"tokens": rollout.tokens_BT, "valid": rollout.valid_BT})
    return fn(role.params, b["tokens"], b["valid"])[0]

  def critic_values(self, rollout: Rollout) -> jax.Array:
    fn = self._cached("values", lambda: self.critic.jit(functools.partial(
        steps.completion_values, self.critic.graphdef, prompt_len=self.prompt_len)))
    b = self.critic.put_batch({"tokens": rollout.tokens_BT, "valid": rollout.valid_BT})
    return fn(self.critic.params, b["tokens"], b["valid"])

  def advantages(self, rewards_B, mask_BN, kl_BN=None, values_BN=None) -> jax.Array:
    return self._advantages(jnp.asarray(rewards_B, jnp.float32), jnp.asarray(mask_BN), kl_BN,
                            values_BN)
