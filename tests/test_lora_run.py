"""A LoRA run (`lora.rank > 0`): SFT and GRPO train the adapters alone; the base's bytes never
change; colocated, the reference IS the base (the same arrays, not saved twice); a resume puts
it all back; jaxrl-export writes the merged weights or a PEFT adapter directory."""
import json
import os
import shutil

import jax
import numpy as np
import pytest

from train.cli.export import main as export_main
from jaxrl.config_files import shipped
from jaxrl.models import lora
from train.run import Experiment

tiny = shipped("tiny")


def _host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _same(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(_host(a), _host(b)))


def _config(tmp, name: str, sft_steps: int):
  c = tiny.get_config()
  c.run_dir, c.run_name = str(tmp), name
  c.placement.strategy = "colocate"
  c.lora.update(rank=4, alpha=8.0, targets="wq,wv,w_up")
  c.sft.steps, c.rl.steps = sft_steps, 2
  c.checkpoint_every = 100
  return c


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """GRPO straight from the (random) base: the adapters' B is zero as RL starts. The random
  policy earns no reward, so an entropy bonus gives the first steps their gradient."""
  c = _config(tmp_path_factory.mktemp("lora"), "run", sft_steps=0)
  c.rl.loss.entropy_coef = 0.01
  out = {}
  with Experiment(c) as exp:
    cluster = exp.ctx.cluster
    actor = cluster.actor
    out["base0"], out["adapters0"] = _host(cluster.plain(actor.params)), _host(
        actor.split(actor.params)[0])
    exp.rl.step()
    exp.save()  # mid-stage: the learner's state too
    ref = cluster.get("reference").params
    out["shared"] = (cluster.shared, all(
        a is b for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(cluster.plain(actor.params)))))
    out["adapters_1"] = _host(actor.split(actor.params)[0])
    exp.rl.step()
    out["base1"], out["adapters1"] = _host(cluster.plain(actor.params)), _host(
        actor.split(actor.params)[0])
    out["params"] = _host(actor.params)
    out["dtypes"] = {str(x.dtype) for x in jax.tree.leaves(cluster.plain(actor.params))
                     if x.ndim > 1}
    out["summary"] = exp.finish()
  out["dir"] = os.path.join(c.run_dir, "run")
  return out


def test_only_the_adapters_train(run):
  assert all(np.array_equal(a, b) for a, b in zip(run["base0"], run["base1"]))
  for before, after in [(run["adapters0"], run["adapters_1"]),
                        (run["adapters_1"], run["adapters1"])]:
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))
  assert len(run["adapters1"]) == 2 * 3  # wq, wv, w_up in the tiny model's one layer


def test_after_lora_sft_the_reference_is_the_sft_policy(tmp_path):
  """SFT trains the adapters (the base unchanged); RL's reference is then the policy as RL
  starts, the adapters folded in: a copy of its own, not the base."""
  with Experiment(_config(tmp_path, "sft", sft_steps=3)) as exp:
    cluster = exp.ctx.cluster
    base0 = _host(cluster.plain(cluster.actor.params))
    exp.stage("sft").run()
    assert _same(cluster.plain(cluster.actor.params), base0)
    assert any(np.any(a != 0) for a in _host(cluster.actor.split(cluster.actor.params)[0]))
    exp.stages["rl"].start()
    assert cluster.shared == set()
    np.testing.assert_equal(_host(cluster.get("reference").params),
                            _host(cluster.actor_weights()))


def test_the_reference_is_the_actors_base(run):
  shared, same_arrays = run["shared"]
  assert shared == {"reference"} and same_arrays
  rl = os.path.join(run["dir"], "checkpoints", "rl")
  items = set(os.listdir(os.path.join(rl, "1")))
  assert "actor" in items and "learner_actor" in items and "reference" not in items


def test_resume_mid_rl_continues_exactly(run, tmp_path):
  """From the checkpoint after RL step 1 (the later one removed): the shared reference is
  rebuilt from the restored base, and step 2 gives the uninterrupted run's adapters."""
  copy = str(tmp_path / "run")
  shutil.copytree(run["dir"], copy)
  shutil.rmtree(os.path.join(copy, "checkpoints", "rl", "2"))
  with Experiment.restore(copy) as exp:
    cluster = exp.ctx.cluster
    assert cluster.shared == {"reference"}
    assert _same(cluster.get("reference").params, cluster.plain(cluster.actor.params))
    exp.rl.step()
    np.testing.assert_equal(_host(cluster.actor.params), run["params"])


def test_export_merged_and_peft(run, tmp_path):
  ckpt = os.path.join(run["dir"], "checkpoints", "rl")
  assert export_main(["--checkpoint", ckpt, "--out", str(tmp_path / "merged"),
                      "--dtype", "float32"]) == 0
  with open(tmp_path / "merged" / "config.json") as f:
    assert json.load(f)["num_hidden_layers"] == 1
  assert export_main(["--checkpoint", ckpt, "--out", str(tmp_path / "peft"), "--peft"]) == 0
  with open(tmp_path / "peft" / "adapter_config.json") as f:
    config = json.load(f)
  assert (config["r"], sorted(config["target_modules"])) == (4, ["q_proj", "up_proj", "v_proj"])


def test_base_is_held_in_the_compute_dtype(run):
  assert run["dtypes"] == {"float32"}  # the tiny model computes in float32
  assert lora.LoRAConfig().enabled is False


def test_docs_fit_table_row_is_what_the_dry_run_says():
  """docs/lora.md's one-GPU Llama-3.1-8B row, recomputed (`python -m train.preflight.fit_table --write`
  rewrites the table)."""
  from train.preflight import fit_table
  with open(fit_table.DOC, encoding="utf-8") as f:
    text = f.read()
  cells = [fit_table.cell(fit_table.CONFIGS["Llama-3.1-8B"], 1, rank, offload)
           for rank, offload in fit_table.COLUMNS.values()]
  row = "| Llama-3.1-8B | 1 x 80 GB | " + " | ".join(cells) + " |"
  assert row in text, f"{row} not in docs/lora.md: run `python -m train.preflight.fit_table --write`"
  assert cells[0].endswith("no") and cells[-1].endswith("fits")
