"""Idle-role offload (train/roles/offload.py): pinned host memory and back leaves every array
bit-identical in its own sharding; a colocated run offloading everything it can computes exactly
what the run without does, shows its moves in trace.json, and resumes from a checkpoint taken
while its optimizer state was on the host."""
import json
import os

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.config_files import shipped
from jaxrl.config import ConfigError
from jaxrl.config_files import resolve
from jaxrl.models.transformer import LanguageModel
from sharding.mesh import make_mesh, param_shardings
from sharding.rules import TRAIN_RULES
from train.roles.offload import DEVICE, HOST, moved
from train.run import Experiment

tiny = shipped("tiny")


def test_round_trip_is_bit_identical(tiny_cfg):
  """Parameters and Adam moments sharded over (data 2, fsdp 2, tensor 2) go to pinned host
  memory and back: the same values, the same shardings, the sources freed."""
  mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  _, abstract = nnx.split(nnx.eval_shape(lambda: LanguageModel(tiny_cfg, rngs=nnx.Rngs(0))))
  shardings = param_shardings(abstract, TRAIN_RULES, mesh)
  params = jax.jit(lambda: nnx.split(LanguageModel(tiny_cfg, rngs=nnx.Rngs(0)))[1],
                   out_shardings=shardings)()
  opt = optax.adam(1e-3)
  state = opt.update(jax.tree.map(lambda x: x * 0.5, params), opt.init(params), params)[1]
  tree = {"params": params, "opt": state}
  want = [np.asarray(x) for x in jax.tree.leaves(tree)]
  shardings = [x.sharding for x in jax.tree.leaves(tree)]
  host, size = moved(tree, HOST)
  assert size == sum(x.nbytes for x in jax.tree.leaves(tree))
  assert {x.sharding.memory_kind for x in jax.tree.leaves(host)} == {HOST}
  assert all(x.is_deleted() for x in jax.tree.leaves(tree))
  back, _ = moved(host, DEVICE)
  assert {x.sharding.memory_kind for x in jax.tree.leaves(back)} == {DEVICE}
  assert all(x.sharding.is_equivalent_to(s, x.ndim)
             for x, s in zip(jax.tree.leaves(back), shardings))
  for a, b in zip(jax.tree.leaves(back), want):
    np.testing.assert_array_equal(np.asarray(a), b)
  assert moved(back, DEVICE)[1] == 0  # already there: nothing moves


def _run(tmp_path, name, offload):
  c = tiny.get_config()
  c.run_dir, c.run_name = str(tmp_path), name
  c.placement.update(strategy="colocate", offload=offload)
  c.rl.update(steps=4)
  c.checkpoint_every = 2
  with Experiment(c) as exp:
    summary = exp.run()
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(exp.stages["rl"].actor.opt_state)}
  return summary, kinds, os.path.join(c.run_dir, name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("offload")
  return {off: _run(tmp, off or "none", off) for off in ("", "all")}


def test_offloading_changes_nothing_computed(runs):
  (plain, plain_kinds, _), (off, off_kinds, run_dir) = runs[""], runs["all"]
  assert off["params_fingerprint"] == plain["params_fingerprint"]
  assert off["heldout_acc_rl"] == plain["heldout_acc_rl"]
  assert plain_kinds == {DEVICE} and off_kinds == {HOST}  # between steps: on the host
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert all(r["time_offload"] > 0 for r in rows if r["phase"] == "rl" and "loss" in r)


def test_moves_are_in_the_trace(runs):
  with open(os.path.join(runs["all"][2], "trace.json")) as f:
    names = {e["name"] for e in json.load(f)["traceEvents"] if e.get("ph") == "X"}
  assert {"offload optimizer", "onload optimizer", "offload frozen", "onload frozen"} <= names


def test_resume_from_a_host_checkpoint(runs, tmp_path):
  """The checkpoint at RL step 2 was taken with the optimizer state on the host; resumed from
  it, the run ends where the uninterrupted one did."""
  import shutil
  copy = str(tmp_path / "run")
  shutil.copytree(runs["all"][2], copy)
  rl = os.path.join(copy, "checkpoints", "rl")
  for step in os.listdir(rl):
    if step.isdigit() and int(step) > 2:
      shutil.rmtree(os.path.join(rl, step))
  with Experiment.restore(copy) as exp:
    assert exp.run()["params_fingerprint"] == runs["all"][0]["params_fingerprint"]


@pytest.mark.parametrize("changes, words", [
    ({"placement": {"offload": "optimizer,weights"}}, "offload: expected a comma-separated"),
    ({"placement": {"offload": "all", "strategy": "separate"},
      "rl": {"schedule": {"mode": "async"}}},
     "placement.offload"),
])
def test_bad_offload_is_one_line(changes, words):
  c = tiny.get_config()
  for section, values in changes.items():
    c[section].update(values)
  with pytest.raises((ConfigError, ValueError)) as e:
    resolve(c)
  assert words in str(e.value) and "\n" not in str(e.value)
