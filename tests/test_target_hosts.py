"""`--dry_run --target` on a slice of several hosts: the trainer and the sampler on hosts of
their own compile (async, partial rollouts of multi-turn conversations); a placement that
splits every host is refused before any compile, as is async where every process runs every
program (docs/hosts.md)."""
import json

import pytest

from train.cli import train
from train.cli.flags import load_config_file
from jaxrl.config import ConfigError
from jaxrl.config_files import resolve
from planner.targets import parse_target


def test_async_on_whole_hosts_compiles_for_a_multi_host_slice(tmp_path):
  """`separate` on whole hosts of a v5e-16 (4 hosts of 4 chips): the trainer on hosts 0-1, the
  sampler on hosts 2-3 (docs/hosts.md), async with partial rollouts of multi-turn conversations
  (turns in slots that keep their caches), compiles; the slots' programs run one after another,
  so the generation phase holds the largest of them, not their sum; the push into the trainer's
  mirror is compiled too."""
  from train.preflight.target_report import report
  raw = load_config_file("configs/tiny.py")
  raw.placement.update(strategy="separate", train_devices=8)
  raw.rl.schedule.update(mode="async", partial_rollouts=True)
  raw.rl.rollout.update(inflight_slots=8)
  raw.rl.environment.update(name="synthetic_short")
  lines, fits = report(resolve(raw, hf=False), parse_target("v5e-16"), str(tmp_path / "t.json"))
  assert fits, lines
  summary = json.loads((tmp_path / "t.json").read_text())
  assert summary["hosts"] == 4 and summary["meshes"]["actor"]["fsdp"] == 8
  turns = [p for p in summary["programs"] if p["phase"] == "generation"]
  assert [p["name"] for p in turns] == [
      "turns: cast weights", "turns: empty slots", "turns: admit (every slot)",
      "turns: extend kept caches", "turns: decode segment"]
  held = lambda p: p["argument_bytes"] + p["output_bytes"] + p["temp_bytes"] + p["code_bytes"]
  generation = summary["phases"]["generation"]["compiler_bytes"]
  assert max(map(held, turns)) <= generation < sum(map(held, turns))
  [push] = [p for p in summary["programs"] if p["phase"] == "weight push"]  # into the mirror
  assert push["name"] == "weight push (largest bucket)"
  landed = summary["phases"]["weight push"]
  assert landed["compiler_bytes"] >= held(push) > 0, landed


def test_the_dry_run_counts_the_trainers_mirror_of_a_sampler_on_hosts_of_its_own():
  """`separate` on whole hosts of a v5e-16: the trainer makes the sampler's copy in the
  sampler's layout on its own first devices for each push (the push's mirror) and drops it once
  sent: not resident, a "weight push" phase of the same bytes per device as the sampler's copy,
  on the trainer's devices."""
  from train.preflight import dry_run
  from train.preflight.target_compile import topology_devices
  raw = load_config_file("configs/tiny.py")
  raw.placement.update(strategy="separate", train_devices=8)
  raw.rl.schedule.update(mode="async")
  devices = topology_devices(parse_target("v5e-16"))
  cluster, resident, phases = dry_run.tables(resolve(raw, hf=False), devices)
  [copy] = [v for k, v in resident.items() if k.startswith("sampler copy")]
  [mirrored] = phases["weight push"].values()
  trainer = {d.id for d in cluster.meshes["actor"].devices.flat}
  assert set(mirrored) <= trainer and not set(copy) & trainer
  assert sorted(mirrored.values()) == sorted(copy.values())
  assert list(phases["weight push"]) == ["the trainer's mirror, made for the push"]


def test_async_where_every_process_runs_every_program_is_refused_in_one_line():
  """Each of 2 hosts split between the trainer and the sampler (as on GPU nodes) runs every
  program on every process: the generator would have no processes of its own, so async is a
  config error naming the placement that gives it some (docs/hosts.md)."""
  from train.preflight.target_compile import topology_devices
  from sharding.placement import make_placement
  from train.roles.layout import Layout, check_processes
  raw = load_config_file("configs/tiny.py")
  raw.rl.schedule.update(mode="async")
  devices = topology_devices(parse_target("v5p-16"))
  placement = make_placement("separate", 8, train_devices=2, n_hosts=2)
  with pytest.raises(ConfigError, match=r"^config.rl.schedule.mode: async on 2 processes .*"
                                        r"placement.strategy='separate'"):
    check_processes(Layout(resolve(raw, hf=False), placement, tuple(devices), None))


@pytest.mark.parametrize("strategy", ["separate", "interleave"])
def test_part_of_each_host_of_a_tpu_slice_is_refused_before_any_compile(capsys, strategy):
  """2 trainer chips of a v5p-16's 2 hosts of 4 would split each host, whose collectives the TPU
  compiler refuses (tests/test_target_compile.py,
  `test_a_program_the_compiler_refuses_is_named_in_one_line`): one line,
  before minutes of compiling, naming what compiles instead."""
  rc = train.main(["train", "--config=configs/tiny.py", "--dry_run", "--target=v5p-16",
                   f"--config.placement.strategy={strategy}",
                   "--config.placement.train_devices=2"])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and len(err) == 1, err
  assert f"placement.strategy: {strategy} on 2 hosts of a TPU slice" in err[0]
  assert "'separate' with placement.train_devices a multiple of 4" in err[0]


def test_interleave_with_the_scorers_apart_compiles_for_a_tpu_slice(capsys):
  """`interleave` on a v5p-16's 2 hosts, the scorers apart: the trainer and the sampler on one
  host's chips, the reference, the reward model and the critic on the other's (the critic's
  update there); the TPU compiler takes every program (part of each host, without them apart,
  is refused)."""
  rc = train.main(["train", "--config=configs/tiny.py", "--dry_run", "--target=v5p-16",
                   "--config.placement.strategy=interleave",
                   "--config.placement.scorers_apart=True", "--config.placement.train_devices=4",
                   "--config.rl.reward=reward_model", "--config.rl.advantage.name=gae"])
  out = capsys.readouterr().out
  assert rc == 0, out[-3000:]
  assert "  reward-model scores " in out and "verdict: fits" in out
  assert "placement interleave: actor {'fsdp': 4}" in out and "reward {'fsdp': 4}" in out
  assert "critic update (device 4)" in out  # (the first of the scorers' host's chips)
