"""RL: the single controller (train/loop/controller.py) in sync or async mode, any algorithm.

On a fresh start the stage freezes the reference (a copy of the actor on the reference mesh)
and, for `gae`, adds the critic (from the reward model when there is one, else from the actor's
trunk). Its run state: the policy version (= steps done), the first prompt batch not yet trained
on (with dynamic sampling a step may generate several: `samples_generated` counts them), the
run's largest sampler/trainer mismatch so far and its tokens per policy lag, the learners, and
in async mode the generator's own state (train/rollout/async_state.py): the batches generated
ahead and the rows in flight, saved with the generator paused, so a resumed run continues them
(the rows in flight only where the checkpoint's stream geometry is this config's:
train/rollout/source.py's `stream_geometry`).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time

from jaxrl.config import ConfigError
from jaxrl.config_rl import RLConfig
from sharding.host import NO_EXCESS_PRECISION, rounds_as_written
from train.loop.controller import Controller
from train.loop.full_kl import FullKL
from train.roles.learner import Learner, critic_learner, rl_optimizer
from train.roles.role import ModelRole
from train.rollout import async_state
from train.rollout.source import stream_geometry
from train.stages.base import Stage
from train.updates.policy import policy_update

log = logging.getLogger("jaxrl")
# summary.json entry -> the metrics row's value whose maximum over the run it keeps
MAXIMA = {"mismatch_max": "mismatch_max", "mismatch_kl_max": "mismatch_kl"}
KL_MAX = "sampler_kl_full_max"  # (kept from the evaluations' rows: `evaluate`)


def learners(rl: RLConfig, actor: ModelRole, critic: ModelRole | None, *,
             initialize: bool) -> tuple[Learner, Learner | None]:
  """The actor's Learner (the RL loss) and, for `gae`, the critic's (its value loss), each with
  its optimizer and learning-rate schedule; `initialize=False`: abstract state (a restore, or a
  target compile)."""
  actor_learner = Learner(actor, functools.partial(policy_update, cfg=rl),
                          rl_optimizer(rl, rl.learning_rate), initialize=initialize)
  if critic is None:
    return actor_learner, None
  return actor_learner, critic_learner(rl, critic, initialize=initialize)


class RLStage(Stage):
  name = "rl"
  evaluates_at_start = True  # the policy as RL starts: heldout_acc_rl_start, the step-0 row

  def __init__(self, ctx):
    super().__init__(ctx)
    self.next_index = 0  # the first prompt batch not yet trained on
    self.maxima = dict.fromkeys(MAXIMA, 0.0)  # the run's worst sampler/trainer mismatch so far
    self.lags: list[int] = []  # generated tokens trained on, by policy lag (async)
    self.controller: Controller | None = None
    self.wall0: float | None = None  # when this process's first RL step began
    # The async worker's state from a checkpoint, until the controller takes it
    self._worker_state = None
    self._paused = None  # while a checkpoint is taken: the generator's state
    self._full_kl: FullKL | None = None

  @classmethod
  def check(cls, cfg) -> None:
    """`rl.rollout.exact="replay"` in bfloat16 needs XLA to round as its programs say, a flag
    read as JAX starts (the train command sets it: train/cli/flags.py), but where the engine's
    schedule is replayed in the very programs that drew (`RLConfig.replays_engine`)."""
    rl = cfg.rl
    if rl.rollout.exact == "replay" and not rl.replays_engine and \
        cfg.model.dtype != "float32" and not rounds_as_written():
      raise ConfigError(f"rl.rollout.exact: 'replay' in {cfg.model.dtype} needs XLA_FLAGS="
                        f"{NO_EXCESS_PRECISION} set before JAX starts (jaxrl-train sets it); "
                        f"expected that, model.dtype='float32' or exact='pass'")

  def eval_due(self, done: int) -> bool:
    return done % self.cfg.eval.every == 0 or done == self.total

  def evaluate(self) -> dict:
    """The held-out score and, from the last batch's rows, the full-distribution check
    (train/loop/full_kl.py) at the current weights."""
    rows = None if self.controller is None else self.controller.last_rows
    if rows is None:
      return super().evaluate()
    if self._full_kl is None:
      e = self.cfg.eval
      self._full_kl = FullKL(self.actor.role, self.ctx.generator, self.ctx.transfers,
                             positions=e.sampler_kl_positions,
                             temperature=self.cfg.rl.rollout.temperature)
    kl = self._full_kl(rows, self.actor.role.params, self.ctx.cluster.sampler_weights.fresh())
    self.maxima[KL_MAX] = max(self.maxima.get(KL_MAX, 0.0), kl[KL_MAX])
    return {**super().evaluate(), **kl}  # (the evaluation releases a mirror made for both)

  def start(self, *, restoring: bool = False) -> None:
    rl, cluster = self.cfg.rl, self.ctx.cluster
    if cluster.get("reference") is None:  # frozen: the actor as RL starts
      cluster.add_reference(restored=restoring)
    critic = None
    if rl.trains_critic:
      critic = cluster.get("critic") or self._new_critic()
    self.actor, self.critic = learners(rl, cluster.actor, critic, initialize=not restoring)

  def _new_critic(self):
    """The critic starts from the reward model when there is one (as OpenRLHF does), else from
    the actor's trunk with a fresh value head."""
    cluster = self.ctx.cluster
    critic, reward = cluster.add("critic"), cluster.get("reward")
    if reward is not None:
      critic.load(reward.params)
    else:
      critic.load(cluster.actor_weights(), subtree="decoder")
    return critic

  def step(self) -> dict:
    if self.controller is None:
      self.wall0 = time.perf_counter()
      ctx = self.ctx
      self.controller = Controller(self.cfg, cluster=ctx.cluster, generator=ctx.generator,
                                   task=ctx.task, judge=ctx.judge, timeline=ctx.timeline,
                                   transfers=ctx.transfers, actor=self.actor, critic=self.critic,
                                   next_index=self.next_index, version=self.progress.done)
      self.controller.start(self._worker_state)
      self._worker_state = None
    row = self.controller.step(keep_rows=self.eval_due(self.progress.done + 1))
    self.next_index = self.controller.next_index
    for lag, count in enumerate(row.pop("token_lags", ())):
      self.lags += [0] * (lag + 1 - len(self.lags))
      self.lags[lag] += count
    for key, name in MAXIMA.items():  # (exact sync rollouts: the checked steps')
      if name in row:
        self.maxima[key] = max(self.maxima[key], float(row[name]))
    rollouts = self.cfg.rl.rollouts
    return {**row, "samples": (self.progress.done + 1) * rollouts,
            "samples_generated": self.next_index * rollouts}

  def finish(self) -> dict:
    if self.controller is not None:  # (the last checkpoint reads the critic on the trainer)
      self.controller.bring_critic_home()
    self.close()
    t = self.ctx.timeline.summary(self.wall0)
    log.info("RL timeline (trace.json): %s; bubble %.2f",
             ", ".join(f"{k} busy {v:.0%}" for k, v in t["busy"].items()), t["bubble"])
    return {"rl_steps_done": self.progress.done, "rl_wall_s": t["wall_s"],
            "bubble": t["bubble"],
            **{f"busy_{k}": v for k, v in t["busy"].items()},
            "heldout_acc_rl": self.progress.last_eval["heldout_acc"], **self.maxima,
            **({"token_lag_counts": self.lags} if self.lags else {})}

  def learners(self) -> dict[str, Learner]:
    out = {"actor": self.actor}
    if self.critic is not None:
      out["critic"] = self.critic
    return out

  @contextlib.contextmanager
  def paused(self):
    """The async generator paused at a point it can continue from, while a checkpoint is
    taken (`state` and `arrays` then include it); a critic apart is brought home first."""
    if self.controller is not None:
      self.controller.bring_critic_home()
    worker = None if self.controller is None else self.controller.worker
    if worker is None:
      yield
      return
    with worker.paused() as generator:  # (None: no state to keep, train/rollout/replicas.py)
      self._paused = None if generator is None else async_state.to_checkpoint(generator)
      try:
        yield
      finally:
        self._paused = None

  def state(self) -> dict:
    out = {"next_index": self.next_index, "maxima": self.maxima, "lags": self.lags}
    if self._paused is not None:
      out["generator"] = self._paused[1]
    return out

  def arrays(self) -> dict:
    return {} if self._paused is None else {"generator": self._paused[0]}

  def abstract_arrays(self, state: dict) -> dict:
    if "generator" not in state:
      return {}
    cluster = self.ctx.cluster
    return {"generator": async_state.abstract_checkpoint(
        state["generator"], cluster.meshes["sampler"], cluster.sampler_weights.abstract())}

  def restore(self, state: dict, arrays: dict) -> None:
    self.next_index, self.lags = state["next_index"], state.get("lags", [])
    self.maxima.update(state.get("maxima", {}))
    if "generator" in state and self.cfg.rl.schedule.mode == "async":
      self._worker_state = async_state.from_checkpoint(
          arrays["generator"], state["generator"], self.ctx.cluster.sampler_weights.abstract())
      stream = self._worker_state.meta.get("stream")
      if stream is not None and stream["shape"] != self._stream_layout():
        log.warning("the checkpoint's rows in flight were decoded in another layout (%s, now "
                    "%s): their batches are generated again", stream["shape"],
                    self._stream_layout())
        self._worker_state.arrays.pop("stream")
        del self._worker_state.meta["stream"]

  def _stream_layout(self) -> dict | None:
    """The layout partial rollouts' stream has under this config, as a checkpoint records it
    (None: no stream)."""
    geometry = stream_geometry(self.cfg.rl, self.ctx.task.prompt_len)
    return None if geometry is None else geometry.meta()

  def close(self) -> None:
    if self.controller is not None:
      self.controller.close()
      self.controller = None
