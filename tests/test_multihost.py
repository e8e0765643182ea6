"""Two OS processes join through jax.distributed on loopback (gloo CPU collectives): a training
step and a reshard agree with one process; the CLI runs a whole experiment on 2 x 4 devices and
resumes it; a survivor stops when its peer dies."""
import json
import os
import socket
import subprocess
import sys
import time

import jax
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import multihost_worker  # noqa: E402

from sharding.mesh import make_mesh  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
ROOT = __file__.rsplit("/tests/", 1)[0]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(port, pid, *extra):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  return subprocess.Popen([sys.executable, WORKER, str(port), str(pid), *extra], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_processes_train_reshard_and_agree():
  port = _free_port()
  procs = [_start(port, i) for i in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
  assert results[0]["loss"] == results[1]["loss"]
  assert results[0]["checksum"] == results[1]["checksum"]
  # The same step on this process's devices, no distribution: same loss and weights.
  loss, checksum = multihost_worker.run(make_mesh({"fsdp": 4}, jax.devices()[:4]))
  assert results[0]["loss"] == pytest.approx(loss, rel=1e-5)
  assert results[0]["checksum"] == pytest.approx(checksum, rel=1e-4)


def _cli(port, pid, run_dir, *extra):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(JAXRL_COORDINATOR=f"127.0.0.1:{port}", JAXRL_NUM_PROCESSES="2",
             JAXRL_PROCESS_ID=str(pid))
  return subprocess.Popen(
      [sys.executable, "-m", "cli.train", "--config=configs/tiny.py", f"--config.run_dir={run_dir}",
       "--config.run_name=mh", "--config.placement.cpu_devices=4", *extra],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_cli_runs_an_experiment_on_two_processes_and_resumes_it(tmp_path):
  outs = []
  for extra in ((), ("--resume",)):
    port = _free_port()
    procs = [_cli(port, i, tmp_path, *extra) for i in range(2)]
    outs.append([p.communicate(timeout=600) for p in procs])
    for p, (out, err) in zip(procs, outs[-1]):
      assert p.returncode == 0, err[-3000:]
  run_dir = tmp_path / "mh"
  (first0, _), (first1, _) = outs[0]
  assert "params_fingerprint=" in first0 and "params_fingerprint" not in first1  # process 0 logs
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if r["phase"] == "rl" and "loss" in r] == [1, 2, 3]  # once each
  assert (run_dir / "metrics.png").exists() and (run_dir / "trace.json").exists()
  actor = run_dir / "checkpoints" / "rl" / "3" / "actor"
  assert (actor / "ocdbt.process_0").is_dir() and (actor / "ocdbt.process_1").is_dir()
  fingerprint = first0.rsplit("params_fingerprint=", 1)[1].split()[0]
  assert f"params_fingerprint={fingerprint}" in outs[1][0][0]  # the resumed run: same weights
  assert "resumed from checkpoints/rl/3" in outs[1][0][1]


@pytest.mark.slow
def test_survivor_stops_when_a_peer_dies():
  port = _free_port()
  procs = [_start(port, i, "die") for i in range(2)]
  t0 = time.monotonic()
  outs = [p.communicate(timeout=180) for p in procs]
  elapsed = time.monotonic() - t0
  assert procs[1].returncode == 17
  assert procs[0].returncode != 0, outs[0]
  assert "stopped sending heartbeats" in outs[0][1]  # the coordination service names the cause
  assert elapsed < 180
