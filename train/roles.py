"""One model on its role's mesh: sharded parameters, optional optimizer state, jitted functions.

The actor, critic, reward model and reference are each a `ModelRole` on the mesh the placement
gives their role (sharding/placement.py), so any of them can live on its own devices.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.mesh import batch_sharding, init_sharded, param_shardings
from sharding.placement import PlacementError
from sharding.reshard import reshard
from sharding.rules import TRAIN_RULES, activation_rules
from train.steps import TrainState


def jit_on(mesh: Mesh, rules, fn, **kwargs):
  """jit whose trace runs under `mesh`'s activation rules (see sharding.rules.constrain)."""

  def traced(*args):
    with activation_rules(mesh, rules):
      return fn(*args)

  return jax.jit(traced, **kwargs)


def role_shardings(name: str, abstract: nnx.State, rules, mesh: Mesh) -> nnx.State:
  """Parameter shardings of a role, checked on abstract shapes before anything is allocated;
  an axis that does not divide a dimension is a PlacementError naming the role."""
  try:
    return param_shardings(abstract, rules, mesh)
  except ValueError as e:
    raise PlacementError(f"{name}: {e}") from None


def copy_into(params: nnx.State, shardings: nnx.State) -> nnx.State:
  """`params` (from any mesh) in the layout `shardings`, never aliasing the source."""
  moved, _ = reshard(params, shardings, donate=False)
  # Where the layouts already match, device_put returns the source itself: copy, so that
  # donating the source (an update step) cannot free these weights.
  return jax.tree.map(lambda a, b: jnp.copy(b) if a is b else b, params, moved)


class ModelRole:
  """`make_model()` builds the module; parameters are born sharded on `mesh` under `rules`, or
  are a copy of `params` (any layout) when given."""

  def __init__(self, name: str, make_model, mesh: Mesh, rules=TRAIN_RULES, params=None):
    self.name, self.mesh, self.rules = name, mesh, rules
    self.graphdef, abstract = nnx.split(nnx.eval_shape(make_model))
    self.shardings = role_shardings(name, abstract, rules, mesh)
    if params is None:
      _, params, _ = init_sharded(make_model, rules, mesh)
    else:
      params = copy_into(params, self.shardings)
    self.state = TrainState(step=self._replicated(jnp.zeros((), jnp.int32)), params=params,
                            opt_state=())
    self.batch_sharding = batch_sharding(mesh, rules)

  @property
  def params(self) -> nnx.State:
    return self.state.params

  def _replicated(self, x):
    return jax.device_put(x, NamedSharding(self.mesh, PartitionSpec()))

  def jit(self, fn, **kwargs):
    """jit whose trace runs under this mesh's activation rules."""
    return jit_on(self.mesh, self.rules, fn, **kwargs)

  def jit_update(self, update_fn):
    """An update step `(state, batch) -> (state, metrics)` with the state donated."""
    sh = jax.tree.map(lambda x: x.sharding, self.state)
    return self.jit(update_fn, in_shardings=(sh, None), out_shardings=(sh, None), donate_argnums=0)

  def put_batch(self, batch: dict) -> dict:
    """Host or foreign-mesh arrays -> arrays split over this mesh's batch axes."""
    return {k: jax.device_put(v, batch_sharding(self.mesh, self.rules, np.ndim(v)))
            for k, v in batch.items()}

  def set_optimizer(self, optimizer) -> None:
    """Fresh optimizer state (moments sharded like their parameters) and step 0."""
    replicated = NamedSharding(self.mesh, PartitionSpec())
    params = self.state.params
    opt_shardings = optax.tree_map_params(
        optimizer, lambda _, sharding: sharding, jax.eval_shape(optimizer.init, params),
        self.shardings, transform_non_params=lambda _: replicated)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    self.state = TrainState(step=self._replicated(jnp.zeros((), jnp.int32)), params=params,
                            opt_state=opt_state)

  def load(self, params: nnx.State, *, subtree: str | None = None) -> None:
    """Copies `params` (from any mesh) into this role's layout, whole or into one `subtree`
    (e.g. an actor's `decoder` into a reward model or critic)."""
    if subtree is None:
      new = copy_into(params, self.shardings)
    else:
      new = jax.tree.map(lambda x: x, self.state.params)
      new[subtree] = copy_into(params[subtree], self.shardings[subtree])
    self.state = TrainState(step=self.state.step, params=new, opt_state=self.state.opt_state)

  def frozen_copy(self, name: str, mesh: Mesh, make_model) -> ModelRole:
    """A copy of the current parameters as a new role on `mesh` (e.g. the reference); no
    random initialisation is run for it."""
    return ModelRole(name, make_model, mesh, self.rules, params=self.state.params)
