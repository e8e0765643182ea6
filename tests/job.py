"""The CLI as a job of several CPU processes (the tests of tests/test_processes.py): launch,
wait for a step or a checkpoint, signal a process at a checkpoint, read the result."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sharding.distributed import loopback_port

ROOT = __file__.rsplit("/tests/", 1)[0]
ARGS = ["--config=configs/tiny.py", "--config.placement.strategy=separate",
        "--config.placement.train_devices=2", "--config.placement.train_fsdp=1",
        "--config.rl.schedule.mode=async", "--config.rl.loss.entropy_coef=0.01",
        "--config.rl.steps=4"]
TIMING = ("step_time", "tokens_per_s", "reshard_gbps")


def _port() -> int:
  return loopback_port(4)


def job_env(**extra) -> dict:
  drop = ("XLA_FLAGS", "JAX_PLATFORMS")
  return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def launch(run_dir, name, *extra, resume=False, args=ARGS, devices=1,
           cores=(None,) * 4, n=4, heartbeat=10) -> list[subprocess.Popen]:
  """The run on `n` processes of `devices` CPU devices each (ports apart by more than the
  transfer sockets), process i on `cores[i]` (JAXRL_CPU_CORES; None: any)."""
  port = _port()
  return [subprocess.Popen(
      [sys.executable, "-m", "train.cli.train", *args, *extra,
       f"--config.placement.cpu_devices={devices}",
       f"--config.run_dir={run_dir}", f"--config.run_name={name}",
       *(["--resume"] if resume else [])], cwd=ROOT,
      env=job_env(JAXRL_COORDINATOR=f"127.0.0.1:{port}", JAXRL_NUM_PROCESSES=str(n),
                  JAXRL_PROCESS_ID=str(i), JAXRL_HEARTBEAT_S=str(heartbeat),
                  **({} if cores[i] is None else {"JAXRL_CPU_CORES": str(cores[i])})),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]


def finish(procs) -> list[tuple[str, str]]:
  try:
    outs = [p.communicate(timeout=600) for p in procs]
  except subprocess.TimeoutExpired:
    hung(procs, "a process did not finish within 600 s")
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return outs


def hung(procs, what: str) -> None:
  """Fails with every process's Python stacks (SIGUSR1: train/cli/train.py) and stderr tail;
  the processes killed, not left to load the cores of the tests after."""
  for p in procs:
    if p.poll() is None:
      p.send_signal(signal.SIGUSR1)
  time.sleep(3)
  for p in procs:
    p.kill()
  tails = [p.communicate()[1][-6000:] for p in procs]
  pytest.fail(f"{what}; each process's stderr, last lines:\n" + "\n---\n".join(tails))


def one_process(run_dir, name, *extra, args=ARGS, devices=4):
  """The same run on one process of 4 devices: the same meshes."""
  subprocess.run([sys.executable, "-m", "train.cli.train", *args, *extra,
                  f"--config.placement.cpu_devices={devices}", f"--config.run_dir={run_dir}",
                  f"--config.run_name={name}"], cwd=ROOT, env=job_env(), check=True,
                 capture_output=True, timeout=600)


def result(run_dir, name):
  """(params_fingerprint, metrics rows without wall-clock values)."""
  path = os.path.join(run_dir, name)
  with open(os.path.join(path, "summary.json")) as f:
    summary = json.load(f)
  with open(os.path.join(path, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return summary["params_fingerprint"], [
      {k: v for k, v in r.items() if k not in TIMING and not k.startswith("time_")}
      for r in rows]


def wait(procs, what: str, done) -> None:
  """Polls `done()` for up to 600 s; a process that exits first fails the test with every
  process's stderr tail."""
  deadline = time.time() + 600
  while not done():
    if any(p.poll() is not None for p in procs):
      hung(procs, f"a process exited (codes {[p.poll() for p in procs]}) before {what}")
    if time.time() > deadline:
      hung(procs, f"{what} not reached within 600 s")
    time.sleep(0.05)


def at_rl_step(procs, run_dir, step: int) -> None:
  """Waits until the run's metrics have RL step `step`."""
  metrics = run_dir / "metrics.jsonl"
  wait(procs, f"RL step {step}", lambda: metrics.exists() and any(
      json.loads(line)["phase"] == "rl" and json.loads(line)["step"] >= step
      for line in metrics.read_text().splitlines() if line.endswith("}")))


# The held process answers no heartbeat while the checkpoint lands (about 2 s here, loaded or
# not; a CI run once saw a survivor stop before it landed: the margin, and `wait`'s stderr).
HELD_HEARTBEAT_S = 30


def signal_at_checkpoint(procs, run_dir, victim: int, sig, held: int | None = None) -> None:
  """Sends `sig` to process `victim` once the RL checkpoint of step 2 is saved, with RL steps
  still to go: when the save has begun, process `held` (default: the victim; one whose answer
  the trainer waits for) is stopped (SIGSTOP) until the checkpoint lands, so the run cannot end
  before the signal, however fast its last steps are (partial rollouts: a second)."""
  held = victim if held is None else held
  rl = run_dir / "checkpoints" / "rl"
  at_rl_step(procs, run_dir, 2)
  wait(procs, "the save of RL step 2", lambda: rl.is_dir() and any(
      d.name.startswith("2") for d in rl.iterdir()))
  procs[held].send_signal(signal.SIGSTOP)
  wait(procs, "the RL checkpoint of step 2", (rl / "2").is_dir)
  procs[victim].send_signal(sig)
  if sig != signal.SIGKILL or held != victim:
    procs[held].send_signal(signal.SIGCONT)
