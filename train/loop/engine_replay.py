"""Exact rows drawn by the sampler's own engine, which the trainer runs again: `rl.rollout.exact=
"replay"` in in-flight slots (`rollout.inflight_slots`) or for multi-turn conversations.

In the in-flight engine a row's numbers depend on its schedule: the ring slot its prompt sits
at, the refill bucket that prefilled it, the batch sizes of the tail it decoded in, and for a
conversation the requests its turns were, each continuing in the slot that kept its cache. No
other loop computes those shapes, so the trainer replays the schedule itself: the engine's host
loop run again over the same prompts, each row emitting its drawn tokens (a forced engine,
`Sampler(forced=True)`: `Slots.forced_RN`, picked where the engine would draw) within its own
length as budget, and each environment answering with its recorded reply
(train/rollout/scripted.py). The done flags then flip at the same steps, so every refill,
decode segment, tail and turn is the one that drew, in the same compiled programs: the
log-probs are the sampler's bit for bit at the same weights, in any dtype.

In sync mode the rows are drawn here, on the actor's mesh from the actor's parameters, and the
replay checks them before each evaluation; in async mode (in-flight single-turn rows) the
sampler's copy draws on its own devices in the same programs (train/rollout/generator.py) and
the replay is the old log-prob pass of every step.
"""
from __future__ import annotations

import jax
import numpy as np

from jaxrl.config_checks import ConfigError
from sampler.engine import Rollout
from sampler.inflight import jit_inflight
from sampler.sampler import Sampler


class EngineReplay:
  """Draws a step's rows in the engine's forced programs on the actor's mesh (`sample`) and
  replays them (`replayed`): `generator` is the run's (its sampling settings, its conversations'
  environments and turns)."""

  def __init__(self, rl, role, generator, transfers):
    self.role, self.generator, self.transfers = role, generator, transfers
    self.group, sampling = rl.group_size, generator.sampler.cfg
    self.converses = bool(rl.environment.name)
    if self.converses and not (generator.turns["keep_cache"] or rl.rollout.inflight_slots):
      raise ConfigError("config.rl.rollout.exact: 'replay' of conversations runs their turns "
                        "in in-flight slots, which a sliding window does not fit; expected a "
                        "model without one")
    try:
      if self.converses:  # (the turns' requests engine, in slots the turns make if none given)
        self._talker = Sampler(role.graphdef, sampling, n=self.group, mesh=role.mesh,
                               rules=role.rules, inflight_slots=rl.rollout.inflight_slots,
                               forced=True)
      else:
        self._rows = jit_inflight(role.graphdef, sampling, slots=rl.rollout.inflight_slots,
                                  n=self.group, mesh=role.mesh, rules=role.rules, forced=True)
    except ValueError as e:
      raise ConfigError(f"config.rl.rollout.inflight_slots: {e} (the actor's mesh, where "
                        "exact in-flight rows are drawn)") from None

  def _put(self, host: tuple, label: str):
    return self.transfers.to_device(host, self.role.batch_shardings(host), label)

  def sample(self, prompts: dict, key) -> Rollout:
    if self.converses:
      return self.generator.converse(self._talker, self.role.params, prompts, key)
    return self._rows(self.role.params,
                      *self._put((prompts["prompt_tokens"], prompts["prompt_valid"]), "prompts"),
                      key)

  def replayed(self, params, rollout: Rollout):
    """The rollout's log-probs [B, N] at `params` as the engine computes them, on the actor's
    mesh: its host loop run again, each row (each turn) emitting its drawn tokens."""
    fields = (rollout.tokens_BT, rollout.valid_BT, rollout.completion_mask_BN)
    if self.converses:
      fields += (rollout.loss_mask_BN,)
    tokens_BT, valid_BT, mask_BN, *policy = (np.asarray(x) for x in jax.device_get(fields))
    if self.converses:
      logp_BN = self.generator.replayed_conversations(self._talker, params, tokens_BT,
                                                      valid_BT, mask_BN, policy[0])
      return self._put((logp_BN.astype(np.float32),), "old logprobs")[0]
    p = tokens_BT.shape[1] - mask_BN.shape[1]
    prompts = self._put((tokens_BT[::self.group, :p], valid_BT[::self.group, :p]), "prompts")
    forced_BN, lengths_B = self._put((np.where(mask_BN, tokens_BT[:, p:], -1).astype(np.int32),
                                      mask_BN.sum(axis=1).astype(np.int32)), "forced rows")
    return self._rows(params, *prompts, jax.random.key(0), lengths_B, forced_BN).logprobs_BN
