"""`SamplerWeights`: the sampler's copy of the actor's weights, what the generator decodes with,
refreshed by `push()`.

Full fine-tuning: the actor's weights resharded into the sampler's layout (SAMPLER_RULES on the
sampler's mesh) in the compute dtype, bucketed, device to device. With LoRA, `lora.sampler`:

  merged    the adapters folded into the base on the actor's devices (W + scale B A), then
            moved like full weights; the sampler decodes the plain model.
  adapters  only the adapters move on a push. The base is frozen: where the sampler's layout of
            it is the actor's own (one device, or matching meshes) the sampler reads the
            actor's arrays, one copy for both; otherwise it is resharded once. The sampler
            decodes with the adapters (jaxrl/models/layouts.py adds their low-rank products).

A copy's arrays are freed when a newer one replaces it, except those the actor holds and while an
asynchronous generator may still be decoding with it (between `pin()` and `unpin()`). Where the
generator stands on processes of its own, the trainer's copy is a `mirror` of its layout, made
for a push (or a held-out evaluation) and dropped once sent (`release()`): the crossing holds
what it sends until the generator has pulled it (sharding/crossing.py), so between pushes the
trainer's devices hold no copy.
"""
from __future__ import annotations

import functools

import jax
from flax import nnx

from jaxrl.config import ExperimentConfig
from jaxrl.models import lora
from jaxrl.models.dtypes import compute_dtypes
from sharding.reshard import TransferStats, reshard
from sharding.rules import SAMPLER_RULES
from train.io.host_transfers import HostTransfers
from train.roles.role import ModelRole, role_shardings


class SamplerWeights:

  def __init__(self, cfg: ExperimentConfig, actor: ModelRole, mesh, plain_graphdef=None,
               transfers: HostTransfers | None = None, *, mirror: bool = False):
    """`plain_graphdef`: the actor's module without adapters; `transfers`: the run's named
    host transfers (a push is "weights"); `mirror`: the copy is the trainer's of a generator
    on processes of its own (`release` drops it)."""
    self.cfg, self.actor, self.mirror = cfg, actor, mirror
    self.transfers = HostTransfers() if transfers is None else transfers
    self.lora = cfg.lora.enabled
    self.adapters = self.lora and cfg.lora.sampler == "adapters"
    self.merging = self.lora and not self.adapters  # decodes the plain model, adapters folded in
    self.graphdef = plain_graphdef if self.merging else actor.graphdef
    # The copy's parameters as the actor holds them (merging: its base, the plain model's).
    self._like = actor.split(actor.abstract())[1] if self.merging else actor.abstract()
    self.shardings = role_shardings("sampler", self._like, SAMPLER_RULES, mesh)
    self.params: nnx.State | None = None
    self._held = False  # pinned: an async generator may still decode with an old copy
    self._base = None  # adapters: the sampler's base (the actor's arrays, or a copy of them)
    self._version = -1  # the actor version the copy holds

  def _bucket(self) -> int:
    return self.cfg.placement.reshard_bucket_mb << 20

  def sources(self) -> tuple[nnx.State, object]:
    """What a push moves, as the actor holds it (abstract), and the dtype each leaf moves in
    (a tree like it; None: its own)."""
    return self._like, compute_dtypes(self.cfg.model, self._like)

  def _moved(self, params, shardings, *, donate: bool = False):
    """`params` in the layout `shardings`, matrices in the compute dtype (timed)."""
    dtypes = compute_dtypes(self.cfg.model, params)
    with self.transfers.allowed("weights", params):  # see train/io/host_transfers.py
      return reshard(params, shardings, dtypes=dtypes, bucket_bytes=self._bucket(),
                     donate=donate)

  def make(self) -> tuple[nnx.State, TransferStats]:
    """A fresh copy of the actor's current weights (timed)."""
    params = self.actor.params
    if not self.lora:
      return self._moved(params, self.shardings)
    if self.merging:  # the adapters folded into a temporary, moved (donated) into place
      merged = self.merge(params)
      # (never donating an array the actor holds, should jit forward an unchanged input)
      held = {id(x) for x in jax.tree.leaves(params)}
      donate = not any(id(x) in held for x in jax.tree.leaves(merged))
      return self._moved(merged, self.shardings, donate=donate)
    adapters, base = self.actor.split(params)
    shard_adapters, shard_base = self.actor.split(self.shardings)
    if self._base is None:
      self._base = base if self.shares_base else self._moved(base, shard_base)[0]
    moved, stats = self._moved(adapters, shard_adapters)
    return self.actor.join(moved, self._base), stats

  @functools.cached_property
  def merge(self):
    """jit: the actor's parameters -> the plain model's, adapters folded in, in the base's
    layout (jaxrl/models/lora.merged)."""
    return jax.jit(functools.partial(lora.merged, self.actor.graphdef),
                   out_shardings=self.actor.split(self.actor.shardings)[1])

  @property
  def shares_base(self) -> bool:
    """Whether the copy reads the actor's own base arrays: adapters mode, and the sampler's
    layout of the base is the actor's (shardings and dtypes)."""
    if not self.adapters:
      return False
    base = self.actor.split(self._like)[1]
    targets = self.actor.split(self.shardings)[1]
    dtypes = compute_dtypes(self.cfg.model, base)
    return all(x.sharding.is_equivalent_to(s, x.ndim) and (d is None or d == x.dtype)
               for x, s, d in zip(jax.tree.leaves(base), jax.tree.leaves(targets),
                                  jax.tree.leaves(dtypes, is_leaf=lambda v: v is None)))

  def abstract(self) -> nnx.State:
    """The copy's abstract parameters: shapes, its dtypes, its shardings."""
    return jax.tree.map(lambda x, s, d: jax.ShapeDtypeStruct(x.shape, d or x.dtype, sharding=s),
                        self._like, self.shardings, compute_dtypes(self.cfg.model, self._like))

  def _free(self, params) -> None:
    """Deletes `params`' arrays that neither the actor nor the current copy holds."""
    keep = {id(x) for x in jax.tree.leaves(self.actor.params)}
    keep |= {id(x) for x in jax.tree.leaves(self.params)}
    for x in jax.tree.leaves(params):
      if id(x) not in keep and not x.is_deleted():
        x.delete()

  def pin(self) -> None:
    """An asynchronous generator decodes with the copies from now on, at its own pace: none is
    freed when a newer one replaces it (the generator drops its own references)."""
    self._held = True

  def unpin(self) -> None:
    self._held = False

  def push(self) -> TransferStats:
    """Refreshes the copy; the old one is freed at once unless the copies are pinned."""
    old = self.params
    self.params, stats = self.make()
    self._version = self.actor.version
    if old is not None and not self._held:
      self._free(old)
    return stats

  def fresh(self) -> nnx.State:
    """The copy, pushed first if the actor changed since the last push."""
    if self._version != self.actor.version:
      self.push()
    return self.params

  def release(self) -> None:
    """The trainer's mirror, sent: its references dropped (not deleted: a crossing still
    pulling holds its arrays until done), the next `fresh` makes it again. A no-op elsewhere."""
    if self.mirror:  # (adapters mode: the base's copy too, made again with the next)
      self.params, self._base, self._version = None, None, -1

  def drop(self) -> None:
    """Frees the copy now (the next `fresh` pushes a new one), unless the copies are pinned; a
    base the actor holds stays (adapters mode with a base of its own: that base is copied again
    on the next push)."""
    if self._held:
      return
    old, self.params, self._base, self._version = self.params, None, None, -1
    if old is not None:
      self._free(old)
