"""One model on its role's mesh: its graph, its parameter shardings and (once set) its parameters.

The actor, critic, reward model and reference are each a `ModelRole` on the mesh the placement
gives their role (sharding/placement.py), so any of them can live on its own devices. A role is
born abstract: `initialize()` draws random weights straight into the shardings, `load()` copies
weights from any layout, `adopt()` takes arrays already in its layout (a checkpoint restored into
`abstract()`, safetensors read into the shardings), so no random initialisation runs before a
restore. The role owns its parameters: every change goes through one of its methods
(`set_trained` after an update, `move` for idle-role offload, `release`), and each change of
weights bumps `version` (copies can tell they are stale).
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.models.dtypes import cast_to
from sharding.mesh import batch_sharding, param_shardings
from sharding.placement import PlacementError
from sharding.reshard import move, reshard
from sharding.rules import TRAIN_RULES, NotDivisible, jit_on
from train.roles.offload import moved


def role_shardings(name: str, abstract: nnx.State, rules, mesh: Mesh) -> nnx.State:
  """Parameter shardings of a role, checked on abstract shapes before anything is allocated;
  an axis that does not divide a dimension is a PlacementError naming the role and the config
  field that sets the axis."""
  try:
    return param_shardings(abstract, rules, mesh)
  except NotDivisible as e:
    field = "sampler_tensor" if name == "sampler" else "train_devices"
    raise PlacementError(
        f"config.placement.{field}: the {name}'s mesh axis {e.axis}={e.size} does not divide "
        f"{e.path} (dimension {e.dim}); set placement.{field} to a divisor of {e.dim}"
        + (" (0 chooses one)" if name == "sampler" else "")) from None
  except ValueError as e:
    raise PlacementError(f"{name}: {e}") from None


def copy_into(params: nnx.State, shardings: nnx.State, dtypes=None) -> nnx.State:
  """`params` (from any mesh) in the layout `shardings` (cast to `dtypes` where not None),
  never aliasing the source."""
  moved, _ = reshard(params, shardings, donate=False, dtypes=dtypes)
  # Where the layouts already match, device_put returns the source itself: copy, so that
  # donating the source (an update step) cannot free these weights.
  return jax.tree.map(lambda a, b: jnp.copy(b) if a is b else b, params, moved)


def abstract_like(tree, shardings):
  """ShapeDtypeStructs of `tree` carrying `shardings` (what a restore writes into)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


@contextlib.contextmanager
def _init_lowering(mesh: Mesh):
  """On one GPU, random initialisation hashes its threefry bits in JAX's CUDA kernel instead of
  XLA's inlined, unrolled rounds (the same bits): a model's init calls the hash once per
  parameter, and Qwen2.5-0.5B's init program took 216 s to compile on an H200 with the inlined
  rounds, 7.9 s with the kernel. With several devices XLA's lowering stays: SPMD does not
  partition the kernel's custom call, so every device would hash whole arrays."""
  gpu = mesh.size == 1 and mesh.devices.flat[0].platform == "gpu"
  before = jax.config.jax_threefry_gpu_kernel_lowering
  if gpu:
    jax.config.update("jax_threefry_gpu_kernel_lowering", True)
  try:
    yield
  finally:
    if gpu:
      jax.config.update("jax_threefry_gpu_kernel_lowering", before)


class ModelRole:
  """`make_model()` builds the module (only traced here: `nnx.eval_shape`). `stored_dtypes`
  (a frozen role): a function of the abstract parameters giving the dtypes to hold them in
  (a tree, None: as initialised), e.g. `dtypes.compute_dtypes`: a bf16 reference holds half the
  bytes and scores exactly as its float32 weights would."""

  def __init__(self, name: str, make_model, mesh: Mesh, rules=TRAIN_RULES, stored_dtypes=None,
               trainable=None, shape=None):
    """`trainable`: an nnx filter of the parameters a learner trains (LoRA's adapters), None:
    all of them. `shape`: `nnx.split(nnx.eval_shape(make_model))` when the caller has it."""
    self.name, self.mesh, self.rules, self._make_model = name, mesh, rules, make_model
    self.trainable = trainable
    self.graphdef, abstract = shape or nnx.split(nnx.eval_shape(make_model))
    self.dtypes = None if stored_dtypes is None else stored_dtypes(abstract)
    if self.dtypes is not None:
      abstract = jax.tree.map(lambda x, d: x if d is None else jax.ShapeDtypeStruct(x.shape, d),
                              abstract, self.dtypes)
    self._abstract = abstract
    self.shardings = role_shardings(name, self._abstract, rules, mesh)
    self._params: nnx.State | None = None
    self.version = 0  # bumped whenever the parameters change (copies can tell they are stale)
    self.sent_version = None  # the version a copy on processes apart holds (remote_scorers.py)

  @property
  def params(self) -> nnx.State | None:
    return self._params

  def adopt(self, params: nnx.State) -> None:
    """Takes `params`, already in this role's layout, as its parameters (no copy)."""
    self._params, self.version = params, self.version + 1

  def set_trained(self, trained: nnx.State) -> None:
    """The trained parameters an update produced, with the frozen rest kept."""
    self.adopt(self.join(trained, self.split(self._params)[1]))

  def move(self, kind: str) -> int:
    """The parameters moved to memory `kind` (idle-role offload, train/roles/offload.py), the
    same weights in the same layout; the bytes moved."""
    self._params, size = moved(self._params, kind)
    return size

  def release(self) -> None:
    """Drops the parameters (a restore puts others in place)."""
    self._params = None

  def initialize(self) -> ModelRole:
    """Random weights, born sharded (eval_shape -> shardings -> jit(init, out_shardings))."""
    cast = lambda params: params if self.dtypes is None else cast_to(params, self.dtypes)
    with _init_lowering(self.mesh):
      self.adopt(jax.jit(lambda: cast(nnx.split(self._make_model())[1]),
                         out_shardings=self.shardings)())
    return self

  def abstract(self) -> nnx.State:
    return abstract_like(self._abstract, self.shardings)

  def with_fresh_trained(self, frozen: nnx.State) -> nnx.State:
    """`frozen` (e.g. a loaded base) joined with newly initialised trained parameters (LoRA
    adapters, B = 0), born sharded: XLA drops the rest of the initialisation."""
    init = lambda: self.split(nnx.split(self._make_model())[1])[0]
    with _init_lowering(self.mesh):
      trained = jax.jit(init, out_shardings=self.split(self.shardings)[0])()
    return self.join(trained, frozen)

  def split(self, tree: nnx.State) -> tuple[nnx.State, nnx.State | None]:
    """(trained, frozen) parts of a tree shaped like the parameters; frozen is None when every
    parameter trains."""
    if self.trainable is None:
      return tree, None
    return nnx.split_state(tree, self.trainable, ...)

  def join(self, trained: nnx.State, frozen: nnx.State | None) -> nnx.State:
    return trained if frozen is None else nnx.merge_state(trained, frozen)

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def jit(self, fn, **kwargs):
    """jit whose trace runs under this mesh's activation rules."""
    return jit_on(self.mesh, self.rules, fn, **kwargs)

  def batch_shardings(self, tree):
    """Each leaf split over this mesh's batch axes along its first dimension."""
    return jax.tree.map(lambda x: batch_sharding(self.mesh, self.rules, np.ndim(x)), tree)

  def put(self, tree):
    """Host or other-mesh arrays -> arrays split over this mesh's batch axes (explicit)."""
    return move(tree, self.batch_shardings(tree))

  def load(self, params: nnx.State, *, subtree: str | None = None) -> None:
    """Copies `params` (from any mesh) into this role's layout, whole or into one `subtree`
    (e.g. an actor's `decoder` into a reward model or critic, which must be initialized)."""
    if subtree is None:
      self.adopt(copy_into(params, self.shardings, self.dtypes))
      return
    new = jax.tree.map(lambda x: x, self.params)
    new[subtree] = copy_into(params[subtree], self.shardings[subtree],
                             None if self.dtypes is None else self.dtypes[subtree])
    self.adopt(new)
