"""The shared hooks reach every stage: a stop request ends DPO and reward-model training too (with
a checkpoint), checkpoints come by steps and by minutes, and stages run piecewise."""
import time

import pytest

from jaxrl.config_files import shipped
from train.run import Experiment
from train.run.hooks import Checkpoint, Hook, Progress
from train.stages import StageProgress, Stopped, run_stage

tiny = shipped("tiny")


class _RequestStopAt(Hook):
  def __init__(self, exp, step):
    self.exp, self.step = exp, step

  def after_step(self, stage, row):
    if stage.progress.done == self.step:
      self.exp.stop.event.set()  # what SIGTERM's handler does


@pytest.mark.slow
@pytest.mark.parametrize("stage,over", [("dpo", {"dpo": {"steps": 50}}),
                                        ("reward_model", {"reward_model": {"steps": 50},
                                                          "rl": {"reward": "reward_model"}})])
def test_stop_request_ends_every_stage_with_a_checkpoint(tmp_path, stage, over):
  raw = tiny.get_config().to_dict()
  raw.update(run_dir=str(tmp_path), run_name=stage, checkpoint_every=1000)
  for section, fields in over.items():
    raw[section].update(fields)
  raw["dpo"]["batch_size"] = raw["reward_model"]["batch_size"] = 8
  with Experiment(raw) as exp:
    exp.hooks.insert(-1, _RequestStopAt(exp, 3))  # just before the stop hook
    with pytest.raises(Stopped):
      exp.stage(stage).run()
    assert exp.stages[stage].progress.done == 3 and not exp.stages[stage].progress.finished
    exp.checkpointer.wait()
    assert exp.checkpointer.saved()[0] == (stage, 3)
  with Experiment.restore(str(tmp_path / stage)) as again:  # and it continues from there
    assert again.stages[stage].progress.done == 3
    again.stage(stage).run(steps=2)
    assert again.stages[stage].progress.done == 5


@pytest.mark.slow
def test_stop_during_a_stages_last_step_ends_the_run_after_that_stage(tmp_path):
  raw = tiny.get_config().to_dict()
  raw.update(run_dir=str(tmp_path), run_name="last", checkpoint_every=1000)
  raw["dpo"].update(steps=4, batch_size=8)
  with Experiment(raw) as exp:
    exp.hooks.insert(-1, _OnStage(exp, "dpo", 4))
    summary = exp.run()
    assert summary["stopped"] == "stop request" and exp.stages["dpo"].progress.finished
    assert not exp.stages["rl"].progress.started
  with Experiment.restore(str(tmp_path / "last")) as again:
    assert again.stage_names[again.position] == "rl"  # DPO is done: RL is next
    assert again.stages["dpo"].progress.finished
    assert "stopped" not in again.summary  # the checkpoint holds the summary as saved


class _OnStage(_RequestStopAt):
  def __init__(self, exp, name, step):
    super().__init__(exp, step)
    self.name = name

  def after_step(self, stage, row):
    if stage.name == self.name:
      super().after_step(stage, row)


def test_checkpoint_hook_saves_by_steps_by_minutes_and_at_the_end():
  saved = []

  class FakeStage:
    total, progress = 10, StageProgress()

  hook = Checkpoint(lambda s: saved.append(s.progress.done), every=4, minutes=0.01)  # 0.6 s
  stage = FakeStage()
  for done in range(1, 11):
    stage.progress = StageProgress(started=True, done=done)
    if done == 6:
      time.sleep(0.7)
    hook.after_step(stage, {})
  hook.after_stage(stage)
  assert saved == [4, 6, 8, 10]


def test_a_resumed_stages_bar_counts_from_its_checkpoint_to_its_total(capsys):
  """A stage restored at step 8 of 20 gets no `on_start`: its bar opens at the first step after
  the restore and reads 9/20 after step 9 and 20/20 at the end (it read 10/20, then 21)."""

  class RestoredStage:
    name, total = "rl", 20
    progress = StageProgress(started=True, done=8)

    def advance(self):
      self.progress = StageProgress(started=True, done=self.progress.done + 1)
      seen.append(hook.bar.n if hook.bar else None)
      return {}

    def conclude(self):
      self.progress = StageProgress(started=True, done=self.total, finished=True)

  seen, hook, stage = [], Progress(enabled=True), RestoredStage()
  run_stage(stage, [hook], steps=1)
  assert hook.bar.n == 9 and hook.bar.total == 20
  run_stage(stage, [hook])
  assert seen == [None, *range(9, 20)] and hook.bar is None  # closed at the stage's end
  assert "20/20" in capsys.readouterr().err.replace("\r", "\n").splitlines()[-1]
