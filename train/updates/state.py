"""The train state of one trained model, its optimizer, and applying gradients to it."""
from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: nnx.State
  opt_state: optax.OptState


class Frozen(NamedTuple):
  """A model's graph with the parameters an update leaves alone (LoRA's base: the learner
  trains the adapters only, train/roles/learner.py); the update's `params` are the trained rest."""
  graphdef: nnx.GraphDef
  params: nnx.State


def model_of(graphdef, params):
  """The module of `graphdef` (or a `Frozen` graph with its frozen parameters) and `params`."""
  if isinstance(graphdef, Frozen):
    return nnx.merge(graphdef.graphdef, graphdef.params, params)
  return nnx.merge(graphdef, params)


NEVER_GIVE_UP = 2**30  # optax.apply_if_finite applies non-finite updates after this many


def make_optimizer(learning_rate: float, *, warmup_steps: int = 0, total_steps: int = 1,
                   weight_decay: float = 0.0, max_grad_norm: float = 1.0):
  """Clipped AdamW on a warm-up + cosine schedule. An update whose gradients hold a NaN or an
  Inf (from a NaN reward, advantage or loss too) is skipped: parameters, moments and schedule
  stay as they were, and the optimizer state counts it (`guard_metrics`); the run decides
  when too many in a row are too many (train/run/hooks.py, `NonFinite`)."""
  warmup_steps = max(warmup_steps, 1)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, learning_rate, warmup_steps, max(total_steps, warmup_steps + 1), learning_rate * 0.1)
  return optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(max_grad_norm),
                                           optax.adamw(schedule, b2=0.98,
                                                       weight_decay=weight_decay)),
                               max_consecutive_errors=NEVER_GIVE_UP)


def guard_metrics(opt_state, prefix: str = "") -> dict:
  """Whether the update just made was skipped for non-finite gradients (1.0) or applied (0.0),
  and how many in a row have been skipped (`..._max`: the most over a step's minibatches)."""
  if not isinstance(opt_state, optax.ApplyIfFiniteState):
    return {}
  return {f"{prefix}skipped_updates": 1.0 - opt_state.last_finite.astype(jnp.float32),
          f"{prefix}skipped_in_a_row_max": opt_state.notfinite_count}


def apply_gradients(state: TrainState, grads, optimizer, metrics: dict, prefix: str = ""):
  """(the state after the update, `metrics` with the non-finite guard's)."""
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  state = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                     opt_state=opt_state)
  return state, {**metrics, **guard_metrics(opt_state, prefix)}
