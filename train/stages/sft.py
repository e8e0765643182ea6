"""SFT: the actor learns the task's demonstrations (prompt-masked cross-entropy, packing optional)."""
from __future__ import annotations

from jaxrl.config import ConfigError
from jaxrl.data.pipeline import sft_dataset
from train.roles.learner import Learner
from train.stages.base import Stage
from train.updates.sft import sft_update
from train.updates.state import make_optimizer


class SFTStage(Stage):
  name = "sft"
  log_every = 10

  def start(self, *, restoring: bool = False) -> None:
    s, ctx = self.cfg.sft, self.ctx
    try:
      self.data = sft_dataset(ctx.task.train, ctx.task.enc, batch_size=s.batch_size,
                              seq_len=ctx.task.prompt_len + ctx.task.max_new_tokens,
                              seed=self.cfg.seed, pack_length=s.pack_length)
    except ValueError as e:  # an example longer than sft.pack_length
      raise ConfigError(str(e)) from None
    optimizer = make_optimizer(s.learning_rate, warmup_steps=s.warmup_steps,
                                     total_steps=s.steps, weight_decay=s.weight_decay)
    self.learner = Learner(ctx.cluster.actor, sft_update, optimizer,
                           initialize=not restoring)

  def step(self) -> dict:
    actor = self.ctx.cluster.actor
    batch = self.data[self.progress.done]
    return self.learner.update(self.ctx.transfers.to_device(batch, actor.batch_shardings(batch),
                                                            "batch"))

  def finish(self) -> dict:
    return {"heldout_acc_sft": self.progress.last_eval["heldout_acc"]}

  def learners(self) -> dict[str, Learner]:
    return {"actor": self.learner}
