"""The frozen scorers on processes of their own (`placement.scorers_apart`): the reference's
log-prob pass and, where RL has one, the reward model's scores run there, on a mesh of the
trainer's shape, while the trainer computes its own old log-probs and the verifier's rewards.

The trainer's processes keep the scorers' weights in the trainer's layout, in pinned host
memory (a checkpoint reads them there; a resumed run puts them back); the first scoring request
after they change carries them across, and they leave the devices once its reply has come (the
scorers' processes have pulled them in full by then). Each request carries the batch as the
passes take it (the reference's: tokens, valid, completion mask, or the packed rows' plan; the
reward model's: tokens, valid) on the actor's mesh, which crosses as it is to the scorers' mesh
of the same shape, and the reply carries the [B, N] log-probs and the [B] scores back: the same
programs on the same shapes, so the same numbers as on the trainer's devices. One request holds
both (the crossings of one thread, in one order on every process). Requests go through the
session's link (train/roles/link.py), so the generator's processes take part in these crossings
too.

The critic (`gae`), which trains, stands with them: its values come with the same reply, and
its update runs there on the batch's critic fields (`critic_update`), the metrics crossing back.
Its parameters and optimizer state live there; the trainer's copy (in the trainer's layout, in
pinned host memory) crosses over with the first request and comes home before a checkpoint
(`bring_critic_home`), so a checkpoint holds the critic as on one process and a resumed run
sends it again.
"""
from __future__ import annotations

import logging

from sharding import crossing
from train.loop.experience import CRITIC_FIELDS, critic_batch
from train.loop.passes import (critic_values, packed_scorer, policy_logprobs, reward_scores,
                               scorer)
from train.roles.learner import Learner, critic_learner
from train.roles.link import GroupHost
from train.roles.offload import DEVICE, HOST
from train.updates.packing import Pack

log = logging.getLogger("jaxrl")
TARGET = "scorers"  # the link's name for this group's requests


def _inputs(arrays: dict, packed: bool) -> tuple:
  """The reference pass's inputs from their leaves: (tokens, valid, mask) or (tokens, mask,
  pack)."""
  leaves = crossing.in_order(arrays)
  return (*leaves[:2], Pack(*leaves[2:])) if packed else tuple(leaves)


def _critic_arrays(critic: Learner) -> dict:
  """The critic's parameters and optimizer state, numbered (both ends know their trees)."""
  return {"params": crossing.numbered(critic.role.params),
          "state": crossing.numbered(critic.checkpoint_state())}


def _adopt_critic(critic: Learner, arrays: dict) -> None:
  """`_critic_arrays`, arrived, as `critic`'s parameters and optimizer state."""
  critic.role.adopt(crossing.unnumbered(critic.role.abstract(), arrays["params"]))
  critic.load_state(crossing.unnumbered(critic.abstract_state(), arrays["state"]))


class RemoteScorers:
  """The trainer's side: `score(...)` returns what the scorers' passes would on the actor's
  mesh; `update_critic` and `bring_critic_home`, the critic's update there and its state back."""

  def __init__(self, roles: dict, link_of, critic: Learner | None = None):
    """`roles`: the trainer's copies of the scorers on the actor's mesh (the reference's, and the
    reward model's where RL has one); `link_of()`: the session's link (the generator's worker
    has it); `critic`: the trainer's copy of the critic's learner (`gae`)."""
    self.roles, self._link_of, self.critic = roles, link_of, critic
    self.critic_there = False  # the scorers' processes hold the critic (sent this session)
    self.critic_home = True  # the trainer's copy is the critic as it is there

  def _ask(self, op: str, arrays: dict | None = None, **message) -> dict:
    """Request `op` to the scorers and its reply's arrays, on the actor's mesh."""
    link = self._link_of()
    link.post({"op": op, "replica": TARGET, **message}, arrays)
    reply = link.reply(RuntimeError, "the scorers' processes")
    home, there = link.ends(TARGET)
    return crossing.receive(reply["arrays"], there, home)

  def score(self, inputs: tuple, packed: bool, scored: tuple | None = None,
            values: tuple | None = None) -> tuple:
    """(the reference's [B, N] log-probs, the reward model's [B] scores or None, the critic's
    [B, N] values or None): `inputs` the reference pass's, `scored` the reward model's (tokens,
    valid), `values` the critic's (tokens, valid, completion mask), all on the actor's mesh."""
    arrays = {"inputs": crossing.numbered(inputs)}
    if scored is not None:
      arrays["scored"] = crossing.numbered(scored)
    if values is not None:
      arrays["values"] = crossing.numbered(values)
    fresh = [r for r in self.roles.values() if r.sent_version != r.version]
    for role in fresh:  # (from a restore, on the devices already; from RL's start, too)
      role.move(DEVICE)
      arrays[f"{role.name}_params"] = crossing.numbered(role.params)
    send_critic = self.critic is not None and not self.critic_there
    if send_critic:
      self.critic.role.move(DEVICE)
      self.critic.move_state(DEVICE)
      arrays["critic"] = _critic_arrays(self.critic)
    out = self._ask("score", arrays, packed=packed)
    for role in fresh:
      role.move(HOST)
      role.sent_version = role.version
      log.info("scorers: the %s's weights crossed to their processes (version %d)", role.name,
               role.version)
    if send_critic:
      self._critic_to_host()
      self.critic_there = True
      log.info("scorers: the critic crossed to their processes")
    return out["logprobs"], out.get("scores"), out.get("values")

  def update_critic(self, exp) -> dict:
    """The critic's update on the scorers' processes, on `exp`'s critic fields; its metrics."""
    out = self._ask("critic_update", {"batch": {k: getattr(exp, k) for k in CRITIC_FIELDS}})
    self.critic_home = False
    return out

  def bring_critic_home(self) -> None:
    """The critic's parameters and optimizer state from the scorers' processes into the
    trainer's copy (a checkpoint reads them there), unless it is the critic there already."""
    if self.critic is None or self.critic_home or not self.critic_there:
      return
    _adopt_critic(self.critic, self._ask("critic_home"))
    self._critic_to_host()
    self.critic_home = True

  def _critic_to_host(self) -> None:
    self.critic.role.move(HOST)
    self.critic.move_state(HOST)


class ScorersHost(GroupHost):
  """The scorers' processes: each scoring request's passes, and the critic's update, on the
  scorers' mesh."""

  target = name = TARGET

  def __init__(self, ctx):
    """`ctx`: the run's context on these processes (train/stages/context.py), its cluster
    abstract; the scorers' weights come with the first request."""
    cluster, rl = ctx.cluster, ctx.cfg.rl
    super().__init__(cluster.split, cluster.split.scorer_processes)
    self.roles = {"reference": cluster.add("reference", initialize=False)}
    if rl.reward == "reward_model":
      self.roles["reward"] = cluster.add("reward", initialize=False)
      reward = self.roles["reward"]
      self.scores_fn = reward.jit(reward_scores(rl, reward.graphdef))
    reference = self.roles["reference"]
    self.fns = {False: scorer(rl, reference, policy_logprobs(rl)),
                True: packed_scorer(rl, reference)}
    self.critic = None
    if rl.trains_critic:
      role = cluster.add("critic", initialize=False)
      self.critic = critic_learner(rl, role, initialize=False)
      self.values_fn = scorer(rl, role, critic_values(rl))

  def _score(self, request: dict) -> dict:
    arrays = self.arrived(request)
    for name, role in self.roles.items():
      if f"{name}_params" in arrays:
        log.info("scorers: the %s's weights arrived", name)
        role.adopt(crossing.unnumbered(role.abstract(), arrays[f"{name}_params"]))
    if "critic" in arrays:
      log.info("scorers: the critic arrived")
      _adopt_critic(self.critic, arrays["critic"])
    packed = request["packed"]
    out = {"logprobs": self.fns[packed](self.roles["reference"].params,
                                        *_inputs(arrays["inputs"], packed))}
    if "scored" in arrays:
      out["scores"] = self.scores_fn(self.roles["reward"].params,
                                     *crossing.in_order(arrays["scored"]))
    if "values" in arrays:
      out["values"] = self.values_fn(self.critic.role.params,
                                     *crossing.in_order(arrays["values"]))
    return self._reply(out)

  def _critic_update(self, request: dict) -> dict:
    fields = self.arrived(request)["batch"]
    return self._reply(self.critic.update(critic_batch(fields)))

  def _critic_home(self, request: dict) -> dict:
    return self._reply(_critic_arrays(self.critic))

  def _reply(self, arrays: dict) -> dict:
    home, _ = self.link.ends(TARGET)
    return {"arrays": crossing.send(arrays, home)}
