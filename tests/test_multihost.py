"""Two OS processes join through jax.distributed on loopback (gloo CPU collectives): a training
step and a reshard agree with one process; the launch scripts run a whole experiment on 2 x 4
devices and resume it; a survivor stops when its peer dies."""
import json
import os
import subprocess
import sys
import time

import jax
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import multihost_worker  # noqa: E402

from sharding.distributed import loopback_port  # noqa: E402
from sharding.mesh import make_mesh  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
ROOT = __file__.rsplit("/tests/", 1)[0]


def _free_port() -> int:
  return loopback_port(2)


def _start(port, pid, *extra):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  return subprocess.Popen([sys.executable, WORKER, str(port), str(pid), *extra], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hybrid", "spread"])
def test_two_processes_train_reshard_and_agree(mode):
  """The trainer hybrid-sharded (a whole copy per host) or spread over both hosts (fsdp 4 across
  them: each holds half of each weight); its weights resharded, with device-to-host transfers
  disallowed, onto the sampler's devices of both hosts and onto half the trainer's."""
  port = _free_port()
  procs = [_start(port, i, *([mode] if mode == "spread" else [])) for i in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
  assert results[0]["loss"] == results[1]["loss"]
  assert results[0]["checksums"] == results[1]["checksums"]
  # The same step on this process's devices, no distribution: same loss and weights.
  loss, (checksum,) = multihost_worker.run(make_mesh({"fsdp": 4}, jax.devices()[:4]))
  assert results[0]["loss"] == pytest.approx(loss, rel=1e-5)
  assert results[0]["checksums"] == pytest.approx([checksum] * 2, rel=1e-4)


def _launch(script: str, port: int, pid: int, run_dir, *extra):
  """Process `pid` of 2 started by a launch script, as on a cluster: the Slurm script from
  Slurm's variables, the TPU pod script from the JAXRL_* ones (a pod's metadata elsewhere)."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["JAXRL_PYTHON"] = sys.executable
  if script == "slurm_gpu.sbatch":
    env.update(SLURM_PROCID=str(pid), SLURM_LOCALID=str(pid), SLURM_NTASKS="2",
               SLURM_JOB_NODELIST="127.0.0.1", JAXRL_PORT=str(port), SLURM_SUBMIT_DIR=ROOT)
  else:
    env.update(JAXRL_COORDINATOR=f"127.0.0.1:{port}", JAXRL_NUM_PROCESSES="2",
               JAXRL_PROCESS_ID=str(pid))
  return subprocess.Popen(
      [os.path.join(ROOT, "launch", script), "--config=configs/tiny.py",
       f"--config.run_dir={run_dir}", "--config.run_name=mh", "--config.placement.cpu_devices=4",
       *extra], cwd="/", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_launch_scripts_run_an_experiment_on_two_processes_and_resume_it(tmp_path):
  """launch/slurm_gpu.sbatch runs the experiment on 2 processes x 4 CPU devices (the trainer on
  one, the generator on the other, in sync mode), and launch/tpu_pod.sh resumes it (run from
  another directory: the scripts find the repo)."""
  outs = []
  for script, extra in (("slurm_gpu.sbatch", ()), ("tpu_pod.sh", ("--resume",))):
    port = _free_port()
    procs = [_launch(script, port, i, tmp_path, *extra) for i in range(2)]
    outs.append([p.communicate(timeout=600) for p in procs])
    for p, (out, err) in zip(procs, outs[-1]):
      assert p.returncode == 0, err[-3000:]
  run_dir = tmp_path / "mh"
  (first0, _), (first1, _) = outs[0]
  assert "params_fingerprint=" in first0 and "params_fingerprint" not in first1  # process 0 logs
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if r["phase"] == "rl" and "loss" in r] == [1, 2, 3]  # once each
  assert (run_dir / "metrics.png").exists() and (run_dir / "trace.json").exists()
  assert (run_dir / "tensorboard" / "rl").is_dir()
  actor = run_dir / "checkpoints" / "rl" / "3" / "actor"
  # The default placement (separate, 4 trainer devices) gives each process a role group: the
  # trainer's one process saves (host arrays), the sampler's saves nothing (docs/hosts.md)
  assert (actor / "ocdbt.process_0").is_dir() and not (actor / "ocdbt.process_1").exists()
  fingerprint = first0.rsplit("params_fingerprint=", 1)[1].split()[0]
  assert f"params_fingerprint={fingerprint}" in outs[1][0][0]  # the resumed run: same weights
  assert "resumed from checkpoints/rl/3" in outs[1][0][1]


@pytest.mark.slow
def test_the_planners_placement_gives_each_group_its_processes(tmp_path):
  """`placement.strategy=plan` on 2 processes of 2 devices, async: every process works the
  layout out once, with the planner's choice (the trainer on process 0, the generator on
  process 1), and serves its group; the run ends on both with exit 0. (Before, the groups were
  read before the planner ran: process 1 ran the trainer's experiment too and died.)"""
  port = _free_port()
  procs = [_launch("tpu_pod.sh", port, i, tmp_path, "--config.placement.strategy=plan",
                   "--config.placement.cpu_devices=2", "--config.rl.schedule.mode=async",
                   "--config.sft.steps=0", "--config.rl.steps=2") for i in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  assert ("process groups: trainer on processes [0], sampler on processes [1]; this process "
          "serves the trainer group") in outs[0][1], outs[0][1][-3000:]
  rows = [json.loads(line) for line in (tmp_path / "mh" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if r["phase"] == "rl" and "loss" in r] == [1, 2]


@pytest.mark.slow
def test_survivor_stops_when_a_peer_dies():
  port = _free_port()
  procs = [_start(port, i, "die") for i in range(2)]
  t0 = time.monotonic()
  outs = [p.communicate(timeout=180) for p in procs]
  elapsed = time.monotonic() - t0
  assert procs[1].returncode == 17
  assert procs[0].returncode != 0, outs[0]
  # jaxrl's line names the dead process (the coordination service's C++ abort is not reached)
  assert "process 1 of the job stopped answering" in outs[0][1]
  assert "Check failure" not in outs[0][1] and "Traceback" not in outs[0][1], outs[0][1][-3000:]
  assert elapsed < 180


def test_only_a_generator_of_several_that_others_survive_is_dropped(capsys):
  """`Job.drop` (the peer watch's choice): the processes of one generator replica, gone, are
  dropped once with a line naming them, while another generator lives; a trainer process, two
  generators at once or the last one end the job instead."""
  from sharding.distributed import Job
  joined = Job(client=None)
  joined.replicas = {1: 0, 2: 1, 3: 1, 4: 2}  # (this process, 0, is the trainer's)
  assert not joined.drop([0]) and not joined.drop([1, 2])
  assert joined.drop([3]) and joined.dropped == {1}
  assert "process 3 (generator 1's) of the job stopped answering; generator 1 (processes 2, 3) " \
         "is dropped and its batches are dealt to generators 0, 2" in capsys.readouterr().err
  assert joined.drop([2]) and capsys.readouterr().err == ""  # (its mate, going after it)
  assert joined.drop([4]) and joined.dropped == {1, 2}
  assert not joined.drop([1])  # the last generator
