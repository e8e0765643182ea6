"""Bad Hugging Face model directories and checkpoints, and run directories in the way: one line
naming the file or the field and what is wrong, exit code 2, no traceback, nothing written over
a good checkpoint (tests/faults/conftest.py runs the CLI)."""
import json
import os
import pickle
import shutil

import pytest

from jaxrl.data.gsm8k_tiny import make

TINY = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, d_ff=64)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("hf") / "assets")
  make(out, n_train=60, n_heldout=8, model=TINY)
  return out


def _data(assets):
  return [f"--config.data.train_path={assets}/train.jsonl",
          f"--config.data.heldout_path={assets}/test.jsonl", "--config.data.chat=True",
          "--config.data.max_prompt_tokens=64", "--config.rl.rollout.max_new_tokens=64"]


def _edit_json(path, **changes):
  with open(path) as f:
    obj = json.load(f)
  obj.update(changes)
  with open(path, "w") as f:
    json.dump(obj, f)


def _truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def _split_index(model):
  """The weights named by an index whose one shard file is gone."""
  os.rename(os.path.join(model, "model.safetensors"), os.path.join(model, "shard.safetensors"))
  from safetensors import safe_open
  with safe_open(os.path.join(model, "shard.safetensors"), "numpy") as f:
    names = list(f.keys())
  with open(os.path.join(model, "model.safetensors.index.json"), "w") as f:
    json.dump({"weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}, f)


BROKEN = {  # how to break a copy of the model directory -> what the error says
    "no config": (lambda m: os.remove(os.path.join(m, "config.json")),
                  "is not a Hugging Face model directory (no config.json)"),
    "config not json": (lambda m: open(os.path.join(m, "config.json"), "w").write("{oops"),
                        "config.json: not valid JSON"),
    "unknown architecture": (lambda m: _edit_json(os.path.join(m, "config.json"),
                                                  model_type="mamba", architectures=["Mamba"]),
                             "config.json: architectures=[\"Mamba\"] is not supported (expected "
                             "one of ['Gemma3ForCausalLM', 'Gemma3ForConditionalGeneration', "
                             "'LlamaForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM', "
                             "'Qwen3MoeForCausalLM'])"),
    "no weights": (lambda m: os.remove(os.path.join(m, "model.safetensors")),
                   "neither model.safetensors nor model.safetensors.index.json"),
    "truncated weights": (lambda m: _truncate(os.path.join(m, "model.safetensors")),
                          "model.safetensors: cannot read"),
    "missing shard": (_split_index, "model.safetensors.index.json) is missing"),
    "no tokenizer": (lambda m: os.remove(os.path.join(m, "tokenizer.json")),
                     "no tokenizer.json"),
    "vocab too small": (lambda m: _edit_json(os.path.join(m, "config.json"), vocab_size=100),
                        "config.model.vocab_size: expected >= "),
    "wrong shapes": (lambda m: _edit_json(os.path.join(m, "config.json"), intermediate_size=96),
                     "does not match the model's", "--config.model.d_ff=96"),
}


class _Payload:
  """Unpickling this writes a file: what a malicious PyTorch checkpoint could do."""

  def __init__(self, path):
    self.path = path

  def __reduce__(self):
    return (open, (self.path, "w"))


def test_a_pickled_checkpoint_in_a_model_directory_is_never_opened(cli, assets, tmp_path):
  model, marker = str(tmp_path / "model"), tmp_path / "unpickled"
  shutil.copytree(os.path.join(assets, "model"), model)
  os.remove(os.path.join(model, "model.safetensors"))
  with open(os.path.join(model, "pytorch_model.bin"), "wb") as f:
    pickle.dump(_Payload(str(marker)), f)
  rc, line = cli(f"--config.model.hf_path={model}", *_data(assets))
  assert rc == 2 and "neither model.safetensors nor model.safetensors.index.json" in line
  assert not marker.exists()


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_model_directory_is_one_line_and_exit_2(cli, assets, tmp_path, name):
  model = str(tmp_path / "model")
  shutil.copytree(os.path.join(assets, "model"), model)
  breaks, message, *extra = BROKEN[name]
  breaks(model)
  rc, line = cli(f"--config.model.hf_path={model}", *_data(assets), *extra)
  assert rc == 2 and message in line, line


def test_a_model_directory_that_does_not_exist(cli):
  rc, line = cli("--config.model.hf_path=/nope")
  assert (rc, line) == (2, "config.model.hf_path: '/nope' is not a Hugging Face model directory "
                           "(no config.json)")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
  """A run of the tiny config that saved its SFT checkpoint (2 steps, no RL)."""
  from train.cli.train import main
  root = tmp_path_factory.mktemp("saved")
  assert main(["jaxrl-train", "--config=configs/tiny.py", f"--config.run_dir={root}",
               "--config.run_name=run", "--config.sft.steps=2", "--config.rl.steps=0"]) == 0
  return str(root / "run")


def test_checkpoints_that_do_not_fit(cli, saved_run):
  sft = os.path.join(saved_run, "checkpoints", "sft")
  rc, line = cli(f"--config.init_checkpoint={sft}", "--config.model.d_ff=128")
  assert rc == 2 and line.startswith(f"config.init_checkpoint: '{sft}' step 2 does not fit this "
                                     "model: decoder/blocks/0/mlp/w_down is (32, 64) there, "
                                     "(32, 128) here"), line
  rc, line = cli("--config.init_checkpoint=/nope")
  assert (rc, line) == (2, "config.init_checkpoint: no such directory '/nope'")
  before = sorted(os.listdir(sft))
  rc, line = cli(f"--config.run_dir={os.path.dirname(saved_run)}", "--config.run_name=run",
                 "--resume", "--config.model.d_ff=128")
  assert rc == 2 and line.startswith("checkpoints/sft/2 does not fit this config: actor/decoder"
                                     "/blocks/0/mlp/w_down is (32, 64) there, (32, 128) here"), line
  assert sorted(os.listdir(sft)) == before  # nothing moved aside or written over


def test_run_directories_in_the_way(cli, saved_run, tmp_path):
  runs = os.path.dirname(saved_run)
  rc, line = cli(f"--config.run_dir={runs}", "--config.run_name=run")
  assert (rc, line) == (2, f"config.run_name: {saved_run} already holds checkpoints; pass "
                           "--resume to continue that run, or pick a new name")
  rc, line = cli("--resume")
  assert (rc, line) == (2, "config.run_name: --resume continues a named run; set the name the "
                           "run was started with")
  never = tmp_path / "runs" / "never"  # --resume with nothing to resume: nothing is created
  rc, line = cli("--resume", "--config.run_name=never")
  assert (rc, line) == (2, f"config.run_name: --resume found nothing to resume in {never} (no "
                           f"checkpoint under {never / 'checkpoints'}); check the run name, "
                           "drop --resume to start the run, or pass --resume_or_start")
  assert not never.exists()
  assert cli("--resume", "--resume_or_start") == (2, "--resume and --resume_or_start: pass one "
                                                  "(--resume requires a checkpoint)")
  from jaxrl.config import ExperimentConfig
  from train.io.rundir import prepare
  assert prepare(ExperimentConfig(run_dir=str(tmp_path / "runs"), run_name="never"),
                 resume=True, start_if_none=True) == str(never)  # --resume_or_start: a start
  (tmp_path / "afile").write_text("x")
  rc, line = cli(f"--config.run_dir={tmp_path / 'afile'}", "--config.run_name=r")
  assert (rc, line) == (2, f"config.run_dir: cannot write the run directory "
                           f"{tmp_path / 'afile' / 'r'} (Not a directory: "
                           f"{tmp_path / 'afile' / 'r'})")


def test_a_checkpoint_missing_an_item_falls_back_to_the_one_before(tmp_path, capsys):
  from train.cli.train import main
  args = ["jaxrl-train", "--config=configs/tiny.py", f"--config.run_dir={tmp_path}",
          "--config.run_name=run", "--config.sft.steps=2", "--config.rl.steps=0",
          "--config.checkpoint_every=1"]
  assert main(args) == 0
  sft = os.path.join(tmp_path, "run", "checkpoints", "sft")
  shutil.rmtree(os.path.join(sft, "2", "actor"))  # a damaged checkpoint: its weights are gone
  capsys.readouterr()
  assert main(args + ["--resume"]) == 0
  err = capsys.readouterr().err
  assert "checkpoints/sft/2 cannot be restored (FileNotFoundError: checkpoints/sft/2: its actor " \
         "item is missing); moved to" in err and "resumed from checkpoints/sft/1" in err
