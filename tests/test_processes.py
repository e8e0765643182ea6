"""The async generator on processes of its own: the CLI as 4 CPU processes of one device each,
the trainer on 2 and the sampler on 2 (`separate` on whole hosts), weights and batches crossing
device to device. Each run ends as the same run on one process with the same meshes does (the
fixed schedule: the same params_fingerprint and metrics rows), under partial rollouts and with a
multi-turn environment; the free schedule keeps its staleness bound (whole batches, partial
rollouts, two generators of either); a sampler process killed mid-run stops the others, and the
resumed run ends bit for bit as the uninterrupted one; one of two generators killed is dropped
and the run goes on. The scorers apart, with a generator apart and with `interleave`."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from sharding.distributed import loopback_port
from train.io.timeline import overlap_seconds, read_trace, seconds_within

ROOT = __file__.rsplit("/tests/", 1)[0]
ARGS = ["--config=configs/tiny.py", "--config.placement.strategy=separate",
        "--config.placement.train_devices=2", "--config.placement.train_fsdp=1",
        "--config.rl.schedule.mode=async", "--config.rl.loss.entropy_coef=0.01",
        "--config.rl.steps=4"]
TIMING = ("step_time", "tokens_per_s", "reshard_gbps")


def _port() -> int:
  return loopback_port(4)


def _env(**extra) -> dict:
  drop = ("XLA_FLAGS", "JAX_PLATFORMS")
  return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def _launch(run_dir, name, *extra, resume=False, args=ARGS, devices=1,
            cores=(None,) * 4, n=4) -> list[subprocess.Popen]:
  """The run on `n` processes of `devices` CPU devices each (ports apart by more than the
  transfer sockets), process i on `cores[i]` (JAXRL_CPU_CORES; None: any)."""
  port = _port()
  return [subprocess.Popen(
      [sys.executable, "-m", "train.cli.train", *args, *extra,
       f"--config.placement.cpu_devices={devices}",
       f"--config.run_dir={run_dir}", f"--config.run_name={name}",
       *(["--resume"] if resume else [])], cwd=ROOT,
      env=_env(JAXRL_COORDINATOR=f"127.0.0.1:{port}", JAXRL_NUM_PROCESSES=str(n),
               JAXRL_PROCESS_ID=str(i), JAXRL_HEARTBEAT_S="10",
               **({} if cores[i] is None else {"JAXRL_CPU_CORES": str(cores[i])})),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]


def _finish(procs) -> list[tuple[str, str]]:
  try:
    outs = [p.communicate(timeout=600) for p in procs]
  except subprocess.TimeoutExpired:
    _hung(procs, "a process did not finish within 600 s")
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return outs


def _hung(procs, what: str) -> None:
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


def _one_process(run_dir, name, *extra, args=ARGS, devices=4):
  """The same run on one process of 4 devices: the same meshes."""
  subprocess.run([sys.executable, "-m", "train.cli.train", *args, *extra,
                  f"--config.placement.cpu_devices={devices}", f"--config.run_dir={run_dir}",
                  f"--config.run_name={name}"], cwd=ROOT, env=_env(), check=True,
                 capture_output=True, timeout=600)


def _result(run_dir, name):
  """(params_fingerprint, metrics rows without wall-clock values)."""
  path = os.path.join(run_dir, name)
  with open(os.path.join(path, "summary.json")) as f:
    summary = json.load(f)
  with open(os.path.join(path, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return summary["params_fingerprint"], [
      {k: v for k, v in r.items() if k not in TIMING and not k.startswith("time_")}
      for r in rows]


PARTIAL = ("--config.rl.schedule.name=fixed", "--config.rl.schedule.partial_rollouts=True",
           "--config.rl.rollout.inflight_slots=8")


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory):
  """Partial rollouts under the fixed schedule, on 4 processes (the kill-and-resume test's
  reference too)."""
  tmp = tmp_path_factory.mktemp("partial")
  outs = _finish(_launch(tmp, "four", *PARTIAL))
  return tmp, outs


@pytest.mark.slow
def test_partial_rollouts_on_four_processes_match_one_process(partial_run):
  tmp, outs = partial_run
  _one_process(tmp, "one", *PARTIAL)
  four, one = _result(tmp, "four"), _result(tmp, "one")
  assert four == one
  assert any(r.get("grad_norm", 0) > 0 for r in four[1])  # the policy did move
  lags = [r["policy_lag"] for r in four[1] if r["phase"] == "rl" and "loss" in r]
  assert lags[1:] == [1] * (len(lags) - 1)  # generated ahead
  with open(os.path.join(tmp, "four", "summary.json")) as f:
    assert json.load(f)["busy_sampler"] > 0  # the sampler's busy time, on the timeline
  assert "params_fingerprint" in outs[0][0]  # the trainer's first process reports
  assert not any("params_fingerprint" in out for out, _ in outs[1:])


@pytest.mark.slow
def test_multi_turn_whole_batches_on_four_processes_match_one_process(tmp_path):
  extra = ("--config.rl.schedule.name=fixed", "--config.rl.environment.name=synthetic_short",
           "--config.rl.steps=2")
  _finish(_launch(tmp_path, "four", *extra))
  _one_process(tmp_path, "one", *extra)
  assert _result(tmp_path, "four") == _result(tmp_path, "one")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["whole", "partial", "replicas", "replicas_partial"])
def test_free_schedule_on_several_processes_keeps_its_staleness_bound(tmp_path, layout):
  """The sampler's first process decides what timing decides (each batch's weights; with
  partial rollouts, each segment's and when each batch opens), the other one follows. Two
  generators (3 processes of 2 devices) each count the bound from the batch the trainer takes
  next, which every push tells them."""
  extra = {"whole": (), "partial": PARTIAL[1:],
           "replicas": ("--config.placement.sampler_replicas=2",),
           "replicas_partial": ("--config.placement.sampler_replicas=2", *PARTIAL[1:])}[layout]
  shape = dict(devices=2, n=3) if layout.startswith("replicas") else {}
  _finish(_launch(tmp_path, "free", "--config.rl.schedule.name=free",
                  "--config.rl.schedule.max_staleness=2", *extra, **shape))
  _, rows = _result(tmp_path, "free")
  steps = [r for r in rows if r["phase"] == "rl" and "loss" in r]
  assert [r["step"] for r in steps] == [1, 2, 3, 4]
  assert all(r["token_lag_max"] <= 2 for r in steps)


@pytest.mark.slow
def test_the_generator_generates_while_the_trainer_trains_on_cores_of_their_own(tmp_path):
  """Async under the fixed schedule, the trainer's processes on one core and the sampler's on
  the other: after the first step, generation and training run at the same time (batch s + 1
  is generated during step s; sharding/host.py `pin_to_cores` says why the pin
  comes after JAX starts)."""
  cores = [0, 0, 1, 1] if os.cpu_count() > 1 else [0] * 4
  _finish(_launch(tmp_path, "pinned", "--config.rl.schedule.name=fixed",
                  "--config.rl.rollout.max_new_tokens=24", "--config.model.d_model=128",
                  "--config.model.d_ff=512", "--config.rl.rollout.ignore_eos=True",
                  cores=cores))
  spans = read_trace(os.path.join(tmp_path, "pinned", "trace.json"))
  since = next(end for label, _, end in spans["trainer"] if label == "update")
  busy = {k: seconds_within(spans[k], since) for k in ("sampler", "trainer")}
  assert min(busy.values()) > 0  # (the shorter of the two lies mostly within the other)
  # (apart from the other's: ~0; a CI run, another test on the same 2 cores, measured 0.38)
  assert overlap_seconds(spans["sampler"], spans["trainer"], since) > 0.25 * min(busy.values())


REPLICAS = ("--config.rl.schedule.name=fixed", "--config.placement.sampler_replicas=2")


@pytest.fixture(scope="module")
def replicas_run(tmp_path_factory):
  """3 processes of 2 devices: the trainer on one, a generator on each of the others (batch i
  generator i mod 2's, every push to both), uninterrupted."""
  tmp = tmp_path_factory.mktemp("replicas")
  _finish(_launch(tmp, "replicas", *REPLICAS, devices=2, n=3))
  return _result(tmp, "replicas")


@pytest.mark.slow
def test_two_generator_replicas_match_one_process_and_resume_exactly(replicas_run, tmp_path):
  """Two generators end the run as the same meshes on one process; a SIGTERM to the second
  generator's process mid-run saves both generators' states, every process exits 0, and the
  resumed run ends bit for bit the same."""
  three = dict(devices=2, n=3)
  _one_process(tmp_path, "one", "--config.rl.schedule.name=fixed", devices=4)
  assert replicas_run == _result(tmp_path, "one")
  assert any(r.get("grad_norm", 0) > 0 for r in replicas_run[1])
  assert _stopped_and_resumed(tmp_path, REPLICAS, 2, **three) == replicas_run[0]


def _stopped_and_resumed(tmp_path, extra, victim: int, **shape) -> str:
  """The run stopped by a SIGTERM to process `victim` at RL step 2 (every process exits 0),
  then resumed: its params_fingerprint."""
  procs = _launch(tmp_path, "stopped", *extra, **shape)
  _at_rl_step(procs, tmp_path / "stopped", 2)
  procs[victim].send_signal(signal.SIGTERM)
  for p, (_, err) in zip(procs, [p.communicate(timeout=120) for p in procs]):
    assert p.returncode == 0, err[-3000:]
  _finish(_launch(tmp_path, "stopped", *extra, resume=True, **shape))
  return _result(tmp_path, "stopped")[0]


REPLICAS_PARTIAL = (*REPLICAS, *PARTIAL[1:])


@pytest.fixture(scope="module")
def replicas_partial_run(tmp_path_factory):
  """`replicas_run` with partial rollouts: each generator a stream of every other batch."""
  tmp = tmp_path_factory.mktemp("replicas_partial")
  _finish(_launch(tmp, "replicas", *REPLICAS_PARTIAL, devices=2, n=3))
  return _result(tmp, "replicas")


@pytest.mark.slow
def test_two_generators_with_partial_rollouts_resume_exactly(replicas_partial_run, tmp_path):
  """Partial rollouts on two generators (each a stream of every other batch) under the fixed
  schedule: the policy lag is the schedule's, and a SIGTERM to the second generator's process
  mid-run (rows in flight on both) saves both streams, every process exits 0, and the resumed
  run ends bit for bit as the uninterrupted one."""
  lags = [r["policy_lag"] for r in replicas_partial_run[1] if r["phase"] == "rl" and "loss" in r]
  assert lags[1:] == [1] * (len(lags) - 1)  # generated ahead, by both
  assert _stopped_and_resumed(tmp_path, REPLICAS_PARTIAL, 2, devices=2, n=3) == \
      replicas_partial_run[0]


@pytest.mark.slow
@pytest.mark.parametrize("batches", ["whole", "partial"])
def test_a_dead_generator_replica_is_dropped_and_the_run_goes_on(request, tmp_path, batches):
  """SIGKILL to the second generator's process after RL step 1 (with partial rollouts: its
  rows in flight lost with it). The others drop it within the heartbeat with a line naming it;
  the first generator makes the batches from the one the trainer waits for on (that one with
  the newest weights, fresher than the fixed schedule's version), and every survivor ends the
  run with exit 0; the rows before are the uninterrupted run's."""
  extra = REPLICAS if batches == "whole" else REPLICAS_PARTIAL
  replicas_run = request.getfixturevalue(f"replicas{'' if batches == 'whole' else '_partial'}_run")
  procs = _launch(tmp_path, "dropped", *extra, devices=2, n=3)
  _at_rl_step(procs, tmp_path / "dropped", 1, saved=False)  # (batch 3, generator 1's, to come)
  procs[2].send_signal(signal.SIGKILL)
  outs = _finish(procs[:2])
  line = "jaxrl: warning: process 2 (generator 1's) of the job stopped answering; generator 1"
  assert all(line in err for _, err in outs), outs[0][1][-3000:]
  first = int(re.search(r"generator 1 is dropped; from batch (\d+) on", outs[0][1]).group(1))
  whole, dropped = replicas_run[1], _result(tmp_path, "dropped")[1]
  before = lambda rows: [r for r in rows if r["phase"] != "rl" or r["step"] <= first]  # noqa
  assert before(dropped) == before(whole)  # (step s trains batch s - 1)
  steps = lambda rows: [r["step"] for r in rows if r["phase"] == "rl"]  # noqa: E731
  assert steps(dropped) == steps(whole)
  lags = {r["step"]: r.get("policy_lag", 0) for r in dropped if r["phase"] == "rl"}
  assert lags[first + 1] == 0 and max(lags.values()) <= 1, lags


def _at_rl_step(procs, run_dir, step: int, saved: bool = True) -> None:
  """Waits until the run's metrics have RL step `step` and (`saved`) its RL checkpoint of step
  2 is saved (every process still running)."""
  metrics, checkpoint = run_dir / "metrics.jsonl", run_dir / "checkpoints" / "rl" / "2"
  deadline = time.time() + 600
  while not ((checkpoint.is_dir() or not saved) and metrics.exists() and any(
      json.loads(line)["phase"] == "rl" and json.loads(line)["step"] >= step
      for line in metrics.read_text().splitlines() if line.endswith("}"))):
    assert all(p.poll() is None for p in procs)
    if time.time() > deadline:
      _hung(procs, f"RL step {step} not reached within 600 s")
    time.sleep(0.05)


def _resumes_exactly(partial_run, tmp_path, name) -> None:
  outs = _finish(_launch(tmp_path, name, *PARTIAL, resume=True))
  assert "resumed from checkpoints/rl/" in outs[0][1]
  reference, _ = _result(partial_run[0], "four")
  assert _result(tmp_path, name)[0] == reference


@pytest.mark.slow
@pytest.mark.parametrize("victim,group", [(3, "sampler"), (1, "trainer")])
def test_a_killed_process_stops_the_run_with_one_line_and_it_resumes_exactly(
    partial_run, tmp_path, victim, group):
  """SIGKILL to a sampler or a trainer process mid-run (partial rollouts in flight): every
  survivor stops within the heartbeat with jaxrl's line naming the dead process and the
  command that continues (no C++ abort, no traceback), and the resumed run ends bit for bit as
  the uninterrupted one."""
  procs = _launch(tmp_path, "killed", *PARTIAL)
  _at_rl_step(procs, tmp_path / "killed", 2)  # (two of the four RL steps to go)
  procs[victim].send_signal(signal.SIGKILL)
  t0 = time.time()
  outs = [p.communicate(timeout=120) for p in procs]
  assert all(p.returncode != 0 for p in procs), [(p.returncode, e[-1500:]) for p, (_, e) in
                                                 zip(procs, outs)]
  assert time.time() - t0 < 60  # within the heartbeat (10 s here), not a hang
  for i, (_, err) in enumerate(outs):
    if i != victim:
      line = f"jaxrl: error: process {victim} (the {group}'s) of the job stopped answering"
      assert line in err and "--resume" in err.split(line, 1)[1].splitlines()[0], err[-3000:]
      assert "Traceback" not in err and "Check failure" not in err, err[-3000:]
  _resumes_exactly(partial_run, tmp_path, "killed")


@pytest.mark.slow
def test_sigterm_to_a_sampler_process_saves_and_every_process_exits_0(partial_run, tmp_path):
  """A preemption's SIGTERM reaching one process of the generator's: the trainer stops after its
  step with a checkpoint (the generator's state brought over), every process exits 0, and the
  resumed run ends bit for bit as the uninterrupted one."""
  procs = _launch(tmp_path, "stopped", *PARTIAL)
  _at_rl_step(procs, tmp_path / "stopped", 2)
  procs[2].send_signal(signal.SIGTERM)
  outs = [p.communicate(timeout=120) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  assert "jaxrl: stopped by SIGTERM; checkpoint saved" in outs[0][1]
  with open(tmp_path / "stopped" / "summary.json") as f:
    assert json.load(f)["stopped"] == "SIGTERM"
  _resumes_exactly(partial_run, tmp_path, "stopped")


@pytest.mark.slow
def test_a_placement_that_leaves_the_generator_no_whole_processes_is_one_line():
  """Async on 2 processes of 4 CPU devices with train_devices 2 (one of each process's):
  each process says, in one line and exit 2, what the generator needs, in the CPU's terms."""
  port = loopback_port(2)
  procs = [subprocess.Popen(
      [sys.executable, "-m", "train.cli.train", "--config=configs/tiny.py",
       "--config.placement.strategy=separate", "--config.placement.train_devices=2",
       "--config.rl.schedule.mode=async", "--config.placement.cpu_devices=4"], cwd=ROOT,
      env=_env(JAXRL_COORDINATOR=f"127.0.0.1:{port}", JAXRL_NUM_PROCESSES="2",
               JAXRL_PROCESS_ID=str(i)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True) for i in range(2)]
  for p in procs:
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2, err[-3000:]
    assert ("placement.train_devices a multiple of each process's 4 devices (on the CPU, "
            "placement.cpu_devices=4 per process), from 4 to 4; got 'separate' with "
            "train_devices=2") in err and "Traceback" not in err, err[-3000:]


SPREAD = [a for a in ARGS if "train_devices" not in a and "train_fsdp" not in a] + [
    "--config.placement.train_devices=4", "--config.placement.train_fsdp=4"]


@pytest.mark.slow
def test_a_trainer_spread_over_two_processes_pushes_to_the_sampler_device_to_device(tmp_path):
  """4 processes of 2 devices: the trainer's fsdp over processes 0 and 1 (each holds half of
  each weight), the sampler on 2 and 3. The push reshards by device programs with
  device-to-host transfers disallowed (sharding/reshard.py) and crosses device to device; the
  run equals the same meshes on one process of 8 devices within docs/hosts.md's tolerance
  (gloo sums a 4-way reduction in another order than one process)."""
  extra = ("--config.rl.schedule.name=fixed", "--config.rl.steps=3")
  _finish(_launch(tmp_path, "four", *extra, args=SPREAD, devices=2))
  _one_process(tmp_path, "one", *extra, args=SPREAD, devices=8)
  (_, four), (_, one) = _result(tmp_path, "four"), _result(tmp_path, "one")
  assert [sorted(r) for r in four] == [sorted(r) for r in one]
  for a, b in zip(four, one):
    for k, v in a.items():
      if isinstance(v, float):
        assert v == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["phase"], a["step"], k)
      else:
        assert v == b[k], (a["phase"], a["step"], k)


APART = ("--config.rl.schedule.name=fixed", "--config.placement.scorers_apart=True",
         "--config.rl.reward=reward_model", "--config.reward_model.steps=4",
         "--config.reward_model.batch_size=8", "--config.reward_model.warmup_steps=1")


@pytest.mark.slow
def test_the_scorers_on_processes_of_their_own_match_one_process_and_resume_exactly(tmp_path):
  """3 processes of 2 devices: the trainer on the first (it trains the reward model first), the
  reference and the reward model on the second (each batch crossing device to device, its
  log-probs and scores crossing back), the generator on the third. The run ends as the same
  meshes on one process of 6 devices do, bit for bit; a SIGTERM to the scorers' process mid-run
  saves a checkpoint (their weights from the trainer's host memory), every process exits 0, and
  the resumed run ends the same."""
  three = dict(devices=2, n=3)
  outs = _finish(_launch(tmp_path, "apart", *APART, **three))
  _one_process(tmp_path, "one", *APART, devices=6)
  apart = _result(tmp_path, "apart")
  assert apart == _result(tmp_path, "one")
  assert any(r.get("kl", 0) > 0 for r in apart[1])  # the reference's log-probs came back
  assert "scorers: the reward's weights crossed" in outs[0][1]  # (its scores came from there)
  assert _stopped_and_resumed(tmp_path, APART, 1, **three) == apart[0]


@pytest.mark.slow
def test_interleave_with_the_scorers_apart_on_two_processes_matches_one_process(tmp_path):
  """`interleave`, the scorers apart, 2 processes of 2 devices: the trainer and the sampler on
  the first (generation there, sync), the reference and the reward model on the second (each
  batch crossing to them, log-probs and scores crossing back through a session of their own).
  The run ends as the same meshes on one process of 4 devices do, bit for bit."""
  args = [a for a in ARGS if "mode=" not in a and "strategy=" not in a] + [
      "--config.placement.strategy=interleave", "--config.rl.schedule.mode=sync"]
  outs = _finish(_launch(tmp_path, "two", *APART[1:], args=args, devices=2, n=2))
  _one_process(tmp_path, "one", *APART[1:], args=args, devices=4)
  two = _result(tmp_path, "two")
  assert two == _result(tmp_path, "one")
  assert any(r.get("kl", 0) > 0 for r in two[1])  # the reference's log-probs came back
  assert "scorers: the reward's weights crossed" in outs[0][1]
