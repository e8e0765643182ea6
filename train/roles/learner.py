"""A learner: one trained model in one stage, its optimizer state and its ONE jitted update.

The update is a pure step from train/updates/, `update(state, batch) -> (state, metrics)`, jitted
here, once, on the model's mesh with the state's shardings and the state donated. The parameters
stay in the `ModelRole` (other roles copy them: the sampler, a reference); the learner keeps the
optimizer state and the step counter, sharded like the parameters they belong to.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl import platform
from train.roles.offload import moved
from train.roles.role import ModelRole, abstract_like
from train.updates.policy import critic_update
from train.updates.state import Frozen, TrainState, make_optimizer


def compiler_options(role: ModelRole) -> dict | None:
  """XLA options of `role`'s update. XLA:CPU drops optimization barriers (`jax.checkpoint`'s
  guard against common-subexpression elimination) before its last CSE pass, which then merges
  each block's recomputation in the backward with its forward: `model.layers.remat` would keep every
  activation and save nothing. With a remat model, a CPU update keeps its barriers to the end,
  as GPU and TPU compilers do (tests/test_remat.py measures the saving); so does a LoRA update,
  whose adapted projections' sums are barriers too (jaxrl/models/lora.adapted)."""
  cfg = nnx.merge(role.graphdef, role.abstract()).decoder.cfg  # abstract: allocates nothing
  if (cfg.layers.remat == "none" and role.trainable is None) or platform.backend() != "cpu":
    return None
  return {"xla_disable_hlo_passes": "cse_barrier_expander"}


class Learner:

  def __init__(self, role: ModelRole, update_fn, optimizer: optax.GradientTransformation, *,
               initialize: bool = True):
    """`update_fn(state, batch, *, graphdef, optimizer)`; `initialize=False` leaves the state
    abstract for a restore (`load_state`). Only the role's trainable parameters
    (`role.split`) are in the state, its gradients and its optimizer moments; the frozen rest
    (LoRA's base) is an argument of the update, never donated, reached through a
    `train.updates.state.Frozen` graph."""
    self.role, self.optimizer = role, optimizer
    trained, _ = role.split(role.abstract())
    self._trained_shardings, self._frozen_shardings = role.split(role.shardings)
    abstract_opt = jax.eval_shape(optimizer.init, trained)
    self._opt_shardings = optax.tree_map_params(
        optimizer, lambda _, sharding: sharding, abstract_opt, self._trained_shardings,
        transform_non_params=lambda _: role.replicated)
    self._abstract_opt = abstract_opt
    shardings = TrainState(step=role.replicated, params=self._trained_shardings,
                           opt_state=self._opt_shardings)

    def step(state, frozen, batch):
      graphdef = role.graphdef if frozen is None else Frozen(role.graphdef, frozen)
      return update_fn(state, batch, graphdef=graphdef, optimizer=optimizer)
    self._update = role.jit(step, in_shardings=(shardings, self._frozen_shardings, None),
                            out_shardings=(shardings, None), donate_argnums=0,
                            compiler_options=compiler_options(role))
    self.step = self.opt_state = None
    if initialize:
      self.step = jax.device_put(jnp.zeros((), jnp.int32), role.replicated)
      self.opt_state = jax.jit(optimizer.init, out_shardings=self._opt_shardings)(
          role.split(role.params)[0])

  @property
  def state(self) -> TrainState:
    return TrainState(step=self.step, params=self.role.split(self.role.params)[0],
                      opt_state=self.opt_state)

  def update(self, batch) -> dict:
    """One update on `batch` (already on this mesh, or host arrays); metrics stay on device."""
    frozen = self.role.split(self.role.params)[1]
    state, metrics = self._update(self.state, frozen, batch)
    self.role.set_trained(state.params)
    self.opt_state, self.step = state.opt_state, state.step
    return metrics

  def move_state(self, kind: str) -> int:
    """The optimizer state moved to memory `kind` (idle-role offload); the bytes moved."""
    self.opt_state, size = moved(self.opt_state, kind)
    return size

  def lower(self, batch):
    """The update lowered for `batch` (arrays or ShapeDtypeStructs) and this learner's state,
    abstract: `.compile().memory_analysis()` is what one update needs, allocating nothing."""
    trained, frozen = self.role.split(self.role.abstract())
    state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=self.role.replicated),
                       params=trained,
                       opt_state=abstract_like(self._abstract_opt, self._opt_shardings))
    return self._update.lower(state, frozen, batch)

  def checkpoint_state(self) -> dict:
    """What a run-state checkpoint keeps of this learner (the parameters are the role's)."""
    return {"step": self.step, "opt_state": self.opt_state}

  def abstract_state(self) -> dict:
    return {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=self.role.replicated),
            "opt_state": abstract_like(self._abstract_opt, self._opt_shardings)}

  def load_state(self, restored: dict) -> None:
    self.step, self.opt_state = restored["step"], restored["opt_state"]


def rl_optimizer(rl, learning_rate: float) -> optax.GradientTransformation:
  """An RL learner's optimizer: `learning_rate` with RL's warmup, schedule and clipping."""
  return make_optimizer(learning_rate, warmup_steps=rl.warmup_steps,
                        total_steps=rl.steps * rl.batching.num_minibatches,
                        max_grad_norm=rl.max_grad_norm)


def critic_learner(rl, critic: ModelRole, *, initialize: bool) -> Learner:
  """The critic's Learner (its clipped value loss), wherever it trains (the trainer's
  processes, or the scorers' apart: train/loop/remote_scorers.py)."""
  return Learner(critic, functools.partial(critic_update, cfg=rl),
                 rl_optimizer(rl, rl.critic.learning_rate), initialize=initialize)
