"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral): a softmax router picks `moe.per_token` of
`moe.experts` SwiGLU experts per token and sums their outputs weighted by the router's
probabilities (renormalised over the chosen experts where `norm_topk`).

Dropless: every token reaches every expert it picked. `moe.impl="ragged"` sorts the (token,
expert) assignments by expert and runs each projection as one grouped matrix product
(`jax.lax.ragged_dot_general`: rows [assignments, in] against weights [experts, out, in], each
expert multiplying its own run of rows), so the FLOPs are the active parameters'; "blocked"
pads each expert's run to whole blocks of rows and multiplies block by block (a batched product,
each block with its expert's weights: at most E x (block - 1) padding rows); "dense" runs every
expert over every token and weights the outputs by a one-hot combine matrix, moe.experts /
moe.per_token times the FLOPs: the reference the others are tested and benchmarked against
(benchmarks/moe.py). "auto": dense for a decode-sized batch, else blocked (`experts_impl`).

Routing replay (`route(..., routes_RK)`): the experts are given (the sampler's choice for the
token, recorded at rollout; what verl and NeMo-RL call R3, rollout routing replay) and only
their weights come from this router, so gradients still reach it. `MoEStats` carries a
layer's choices and what the update's auxiliary losses need.
Expert weights are stored [experts, out, in] with an `expert` logical axis (sharding/rules.py).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.partitioning import active_spec

MOE_IMPLS = ("auto", "ragged", "blocked", "dense")
_GROUPED = jax.lax.RaggedDotDimensionNumbers(  # [M, in] x [E, out, in] -> [M, out]
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEStats:
  """One MoE layer's routing: the experts each token picked, [B, T, k], and over the valid
  tokens the share of assignments per expert, [E], the mean router probability per expert,
  [E], the mean squared log-sum-exp of the router logits (z-loss), and the share of tokens
  whose recorded experts are not the ones this router picks (0 with none recorded)."""
  ids: jax.Array  # [B, T, k] (stacked: [B, T, L, k])
  load_E: jax.Array
  prob_E: jax.Array
  z: jax.Array
  replay_differs: jax.Array

  POOLED = ("load_E", "prob_E", "z", "replay_differs")  # the statistics over the tokens


def route(x_RD, router_ED, k: int, norm: bool, routes_RK=None, replay: bool = True):
  """(expert ids [R, k], their weights [R, k] float32, router probabilities [R, E] and logits,
  float32, whether each token's recorded experts `routes_RK` differ from this router's own top
  k [R]). Softmax over all experts in float32, then the top k, or with `replay` the recorded
  ids where a token has them (a row of `routes_RK` below 0: not recorded, routed here)."""
  # In the compute dtype, then float32, as transformers computes it.
  logits_RE = jax.lax.dot_general(x_RD, router_ED.astype(x_RD.dtype),
                                  (((1,), (1,)), ((), ()))).astype(jnp.float32)
  probs_RE = jax.nn.softmax(logits_RE, axis=-1)
  top_RK, ids_RK = jax.lax.top_k(probs_RE, k)
  differs_R = jnp.zeros(ids_RK.shape[:1], bool)
  if routes_RK is not None:
    given_RK = routes_RK.astype(jnp.int32)
    recorded_R = (given_RK >= 0).all(-1)
    differs_R = recorded_R & (jnp.sort(given_RK, -1) != jnp.sort(ids_RK, -1)).any(-1)
    if replay:
      ids_RK = jnp.where(recorded_R[:, None], given_RK, ids_RK)
      top_RK = jnp.take_along_axis(probs_RE, ids_RK, axis=-1)
  if norm:
    top_RK = top_RK / top_RK.sum(-1, keepdims=True)
  return ids_RK, top_RK, probs_RE, logits_RE, differs_R


def _sorted(x_RD, ids_RK):
  """The (token, expert) assignments sorted by expert: each one's expert [M] (unsorted), the
  sorting order [M] and its inverse [M], and the tokens' rows in that order [M, D]."""
  flat_M = ids_RK.reshape(-1)
  order_M = jnp.argsort(flat_M, stable=True)
  inverse_M = jnp.zeros_like(order_M).at[order_M].set(jnp.arange(flat_M.size))
  return flat_M, order_M, inverse_M, jnp.take(x_RD, order_M // ids_RK.shape[1], axis=0)


def _combined(out_MD, inverse_M, weights_RK):
  """The experts' outputs for the sorted assignments [M, D] back in token order, summed over
  each token's k experts with their weights: [R, D]."""
  r, k = weights_RK.shape
  out_RKD = jnp.take(out_MD, inverse_M, axis=0).reshape(r, k, -1)
  return jnp.einsum("rkd,rk->rd", out_RKD, weights_RK.astype(out_MD.dtype))


def grouped_experts(x_RD, ids_RK, weights_RK, w_gate_EFD, w_up_EFD, w_down_EDF, act):
  """sum_j weights[r, j] * expert_{ids[r, j]}(x[r]) through grouped products over the
  assignments sorted by expert: [R, D]."""
  flat_M, _, inverse_M, x_MD = _sorted(x_RD, ids_RK)
  sizes_E = jnp.bincount(flat_M, length=w_gate_EFD.shape[0]).astype(jnp.int32)
  grouped = lambda a, w: jax.lax.ragged_dot_general(a, w.astype(a.dtype), sizes_E, _GROUPED)
  h_MF = act(grouped(x_MD, w_gate_EFD)) * grouped(x_MD, w_up_EFD)
  return _combined(grouped(h_MF, w_down_EDF), inverse_M, weights_RK)


def block_rows(assignments: int, experts: int) -> int:
  """Rows of one block of `blocked_experts`: the power of two at or above the assignments per
  expert, within 8 to 64 (fewer padding rows for a small batch)."""
  per_expert = max(1, -(-assignments // experts))
  return min(64, max(8, 1 << (per_expert - 1).bit_length()))


def blocked_experts(x_RD, ids_RK, weights_RK, w_gate_EFD, w_up_EFD, w_down_EDF, act,
                    block: int = 0):
  """`grouped_experts` as batched products over blocks of `block` rows (0: `block_rows`): the
  assignments sorted by expert, each expert's run padded to whole blocks (at most
  E x (block - 1) padding rows: a static bound), and every block multiplied by its expert's
  weights, gathered per block."""
  e, m, d = w_gate_EFD.shape[0], ids_RK.size, x_RD.shape[1]
  block = block or block_rows(m, e)
  flat_M, order_M, inverse_M, x_MD = _sorted(x_RD, ids_RK)
  sizes_E = jnp.bincount(flat_M, length=e)
  padded_E = -(-sizes_E // block) * block
  ends_E = jnp.cumsum(padded_E)
  expert_M = flat_M[order_M]  # each sorted assignment's expert, and its row in the blocks
  first_M = (ends_E - padded_E - (jnp.cumsum(sizes_E) - sizes_E))[expert_M]
  slot_M = first_M + jnp.arange(m)
  n = -(-(m + e * (block - 1)) // block)
  source_S = jnp.full((n * block,), m).at[slot_M].set(jnp.arange(m))  # m: a zero row
  x_MD = jnp.concatenate([x_MD, jnp.zeros((1, d), x_RD.dtype)])
  x_NbD = jnp.take(x_MD, source_S, axis=0).reshape(n, block, d)
  # Each block's expert: the experts whose padded runs end at or before its first row.
  ends_before_NE = ends_E[None, :] <= (jnp.arange(n) * block)[:, None]
  expert_N = jnp.minimum(ends_before_NE.sum(-1), e - 1)
  per_block = lambda a, w, spec: jnp.einsum(spec, a,
                                            jnp.take(w.astype(a.dtype), expert_N, axis=0))
  h_NbF = (act(per_block(x_NbD, w_gate_EFD, "nbd,nfd->nbf"))
           * per_block(x_NbD, w_up_EFD, "nbd,nfd->nbf"))
  out_SD = per_block(h_NbF, w_down_EDF, "nbf,ndf->nbd").reshape(n * block, d)
  return _combined(jnp.take(out_SD, slot_M, axis=0), inverse_M, weights_RK)


def dense_experts(x_RD, ids_RK, weights_RK, w_gate_EFD, w_up_EFD, w_down_EDF, act):
  """The same sum with every expert run over every token and a one-hot combine matrix."""
  dt = x_RD.dtype
  combine_RE = jnp.einsum("rke,rk->re", jax.nn.one_hot(ids_RK, w_gate_EFD.shape[0], dtype=dt),
                          weights_RK.astype(dt))
  gate_ERF = jnp.einsum("rd,efd->erf", x_RD, w_gate_EFD.astype(dt))
  up_ERF = jnp.einsum("rd,efd->erf", x_RD, w_up_EFD.astype(dt))
  out_ERD = jnp.einsum("erf,edf->erd", act(gate_ERF) * up_ERF, w_down_EDF.astype(dt))
  return jnp.einsum("erd,re->rd", out_ERD, combine_RE)


EXPERTS = {"ragged": grouped_experts, "blocked": blocked_experts, "dense": dense_experts}


def _axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def split_experts(impl: str, x_RD, ids_RK, weights_RK, w_gate_EFD, w_up_EFD, w_down_EDF, act):
  """`EXPERTS[impl]` under the active layout: where it splits the experts (`expert`: each
  device holds whole experts) or their width (`mlp`: a slice of every expert), each device runs
  the products for the tokens it holds on its own share of the weights, the assignments to
  other devices' experts weighted 0, and one all-reduce of [R, D] sums the shares. Left to the
  compiler, the blocked form's per-block weight gather became an all-reduce of the gathered
  weights (blocks x 3 x F x D per layer), the ragged one's of [assignments, F]."""
  active = active_spec(("expert", "mlp", None))
  split = () if active is None else _axes(active[1][0]) + _axes(active[1][1])
  run = functools.partial(EXPERTS[impl], act=act)
  if not split:
    return run(x_RD, ids_RK, weights_RK, w_gate_EFD, w_up_EFD, w_down_EDF)
  mesh, (by_expert, by_width, _) = active
  e_local = w_gate_EFD.shape[0] // math.prod(mesh.shape[a] for a in _axes(by_expert))

  def per_device(x_RD, ids_RK, weights_RK, w_gate, w_up, w_down):
    # Varying over the split, so that the transposes of its gathers sum over it once.
    x_RD = jax.lax.pcast(x_RD, split, to="varying")
    first = jax.lax.axis_index(_axes(by_expert)) * e_local if by_expert else 0
    local_RK = (ids_RK >= first) & (ids_RK < first + e_local)
    y_RD = run(x_RD, jnp.where(local_RK, ids_RK - first, 0), jnp.where(local_RK, weights_RK, 0),
               w_gate, w_up, w_down)
    return jax.lax.psum(y_RD, split)

  P = jax.sharding.PartitionSpec
  rows, w_in, w_out = P(), P(by_expert, by_width, None), P(by_expert, None, by_width)
  return jax.shard_map(per_device, mesh=mesh, in_specs=(rows, rows, rows, w_in, w_in, w_out),
                       out_specs=rows, axis_names=set(split))(
                           x_RD, ids_RK, weights_RK, w_gate_EFD, w_up_EFD, w_down_EDF)


def stats(ids_RK, probs_RE, logits_RE, differs_R, valid_R, shape_BT) -> MoEStats:
  """`MoEStats` of one layer over its valid tokens (`valid_R` None: all)."""
  e = probs_RE.shape[-1]
  w_R = jnp.ones(probs_RE.shape[0], jnp.float32) if valid_R is None else valid_R.astype(
      jnp.float32)
  n = jnp.maximum(w_R.sum(), 1.0)
  mean = lambda x_R: (x_R * w_R).sum() / n
  load_E = jnp.zeros((e,), jnp.float32).at[ids_RK].add(
      jnp.broadcast_to(w_R[:, None], ids_RK.shape)) / (n * ids_RK.shape[1])
  return MoEStats(ids_RK.reshape(*shape_BT, -1), load_E, (probs_RE * w_R[:, None]).sum(0) / n,
                  mean(jnp.square(jax.nn.logsumexp(logits_RE, axis=-1))),
                  mean(differs_R.astype(jnp.float32)))


def aux_losses(load_LE, prob_LE, z_L) -> tuple[jax.Array, jax.Array]:
  """(load-balancing loss, router z-loss), each the mean over the MoE layers. The balance loss
  is Switch Transformer's E * sum_e load_e * prob_e: 1 when the assignments and the
  probabilities are uniform over the experts (Hugging Face's `load_balancing_loss_func` is k
  times this, pooled over layers)."""
  e = load_LE.shape[-1]
  return (e * (load_LE * prob_LE).sum(-1)).mean(), z_L.mean()


def experts_impl(impl: str, assignments: int, experts: int) -> str:
  """`model.moe.impl`, with "auto" resolved by the batch's size: the dense form for at most
  2 assignments per expert (a decode step: every expert's weights are read anyway), else the
  blocked one. Measured by benchmarks/moe.py (docs/models.md): on an H200 the blocked form
  ran a Qwen3-30B-A3B layer over 8192 tokens 13.6x faster than `ragged_dot` and 2.1x faster
  than the dense form, and at 16 tokens the dense form 1.8x faster than both; on the CPU the
  same order (at 1024 tokens blocked 6.4x faster than ragged, 1.08x than dense; at 16 tokens
  dense 4.6x faster than blocked)."""
  if impl != "auto":
    return impl
  return "dense" if assignments <= 2 * experts else "blocked"


def _param(rngs, shape, axes, scale):
  return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * scale, logical_axes=axes)


class MoE(nnx.Module):
  """The router [E, D] and E gated experts ([E, F, D] gate and up, [E, D, F] down), `act` on
  the gate (SwiGLU: silu)."""

  def __init__(self, cfg, rngs: nnx.Rngs, act):
    e, f, d = cfg.moe.experts, cfg.moe.d_ff, cfg.d_model
    self.router = _param(rngs, (e, d), (None, "embed"), d**-0.5)
    self.w_gate = _param(rngs, (e, f, d), ("expert", "mlp", "embed"), d**-0.5)
    self.w_up = _param(rngs, (e, f, d), ("expert", "mlp", "embed"), d**-0.5)
    self.w_down = _param(rngs, (e, d, f), ("expert", "embed", "mlp"), f**-0.5 / cfg.n_layers)
    self.k, self.norm, self.impl = cfg.moe.per_token, cfg.moe.norm_topk, cfg.moe.impl
    self.replay = cfg.moe.routing_replay == "rollout"
    self.act = act

  def __call__(self, x_BTD, valid_BT=None, routes_BTK=None):
    """(output [B, T, D], `MoEStats`): rows layout only. `routes_BTK`: the experts the sampler
    used (replayed under `routing_replay="rollout"`, else compared)."""
    b, t, d = x_BTD.shape
    x_RD = x_BTD.reshape(b * t, d)
    routes = None if routes_BTK is None else routes_BTK.reshape(b * t, -1)
    ids_RK, weights_RK, probs_RE, logits_RE, differs_R = route(
        x_RD, self.router[...], self.k, self.norm, routes, self.replay)
    impl = experts_impl(self.impl, ids_RK.size, self.w_gate.shape[0])
    y_RD = split_experts(impl, x_RD, ids_RK, weights_RK, self.w_gate[...], self.w_up[...],
                         self.w_down[...], self.act)
    valid_R = None if valid_BT is None else valid_BT.reshape(-1)
    return y_RD.reshape(b, t, d), stats(ids_RK, probs_RE, logits_RE, differs_R, valid_R, (b, t))


def pooled_stats(a: MoEStats, weight_a, b: MoEStats, weight_b, ids) -> MoEStats:
  """Two passes' statistics as one pass's over the tokens of both (`weight_a`, `weight_b`:
  their tokens' summed weights), the experts `ids` given."""
  total = jnp.maximum(weight_a + weight_b, 1.0)
  mix = lambda x, y: (x * weight_a + y * weight_b) / total  # noqa: E731
  return MoEStats(ids, *(mix(getattr(a, f), getattr(b, f)) for f in MoEStats.POOLED))


def stack_stats(per_layer: list) -> MoEStats | None:
  """The MoE layers' `MoEStats` stacked: ids [B, T, L, k], the rest with a leading layer axis
  (None for a model without MoE layers)."""
  layers = [s for s in per_layer if s is not None]
  if not layers:
    return None
  return MoEStats(jnp.stack([s.ids for s in layers], axis=2),
                  *(jnp.stack([getattr(s, f) for s in layers]) for f in MoEStats.POOLED))
