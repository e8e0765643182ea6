"""Two OS processes join through jax.distributed on loopback (gloo CPU collectives)."""
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
