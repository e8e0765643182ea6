"""A save that fails half-way (here: the disk reports it is full while checkpoints/rl/4 is being
written) stops the run with one line naming the failed checkpoint and the intact one; the
failed save stays a temporary directory, and --resume continues from the intact one."""
import errno
import json
import os

from etils import epath

from train.cli.train import main


def _disk_full_for(monkeypatch, marker: str):
  """Every file orbax writes under a path holding `marker` fails with ENOSPC."""
  real = epath.Path.write_text

  def write_text(self, *args, **kwargs):
    if marker in str(self):
      raise OSError(errno.ENOSPC, "No space left on device", str(self))
    return real(self, *args, **kwargs)
  for cls in type(epath.Path("/")).__mro__:
    if "write_text" in vars(cls):
      monkeypatch.setattr(cls, "write_text", write_text)


def test_a_failing_save_keeps_the_previous_checkpoint_and_resumes(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
  args = ["jaxrl-train", "--config=configs/tiny.py", f"--config.run_dir={tmp_path}",
          "--config.run_name=run", "--config.sft.steps=2", "--config.rl.steps=6"]
  with monkeypatch.context() as patch:
    _disk_full_for(patch, "/rl/4.orbax-checkpoint-tmp")
    rc = main(args)
  err = capsys.readouterr().err
  assert rc == 1
  assert "jaxrl: error: checkpoints/rl/4: the save failed (OSError: [Errno 28] No space left " \
         "on device" in err and err.rstrip().endswith("checkpoints/rl/2 is intact")
  rl = os.path.join(tmp_path, "run", "checkpoints", "rl")
  assert sorted(os.listdir(rl)) == ["2", "4.orbax-checkpoint-tmp"]
  assert main(args + ["--resume"]) == 0
  err = capsys.readouterr().err
  assert "resumed from checkpoints/rl/2" in err
  assert sorted(os.listdir(rl)) == ["2", "4", "6"]  # the temporary directory cleaned up
  with open(os.path.join(tmp_path, "run", "summary.json")) as f:
    assert json.load(f)["rl_steps_done"] == 6
