"""Kill-and-resume: a run killed with SIGKILL at random moments and resumed with --resume ends
bit-identical to an uninterrupted one (same params_fingerprint, same metrics rows: no step
missing, none twice), in SFT, in RL sync, in RL async with max_staleness=0, and in RL async
ahead of the trainer (the fixed schedule, whole batches or partial rollouts) from checkpoints
that hold batches generated ahead and rows in flight; a truncated latest checkpoint is reported
and the one before it is used."""
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import orbax.checkpoint as ocp
import pytest

ROOT = __file__.rsplit("/tests/", 1)[0]
ARGS = ["--config=configs/tiny.py", "--config.sft.steps=24", "--config.rl.steps=6",
        "--config.checkpoint_every=4", "--config.eval.every=2"]
TIMING = ("step_time", "tokens_per_s", "reshard_gbps")  # wall-clock values differ run to run


def _launch(tmp_path, name, *extra, resume=True):
  return subprocess.Popen(
      [sys.executable, "-m", "train.cli.train", *ARGS, *extra, f"--config.run_dir={tmp_path}",
       f"--config.run_name={name}", *(["--resume"] if resume else [])],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rows(run_dir):
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    lines = f.read().splitlines()
  return [json.loads(line) for line in lines if line.endswith("}")]  # a half-written last line


def _comparable(run_dir):
  return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("time_")}
          for r in _rows(run_dir)]


def _finish(proc):
  out, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-3000:]
  return err


def _resumed_from(err: str) -> tuple[str, int]:
  stage, step = re.search(r"resumed from checkpoints/(\w+)/(\d+)", err).groups()
  return stage, int(step)


def _kill_at(proc, run_dir, phase, step, delay):
  """SIGKILL once a `phase` row at `step` or later is logged, after `delay` seconds."""
  deadline = time.time() + 600
  while not any(r["phase"] == phase and r["step"] >= step for r in _rows(run_dir)):
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert time.time() < deadline
    time.sleep(0.05)
  time.sleep(delay)
  proc.send_signal(signal.SIGKILL)
  return proc.communicate(timeout=60)[1]


def _summary(run_dir):
  with open(os.path.join(run_dir, "summary.json")) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("reference")
  _finish(_launch(tmp, "ref", resume=False))
  run_dir = os.path.join(tmp, "ref")
  return _summary(run_dir)["params_fingerprint"], _comparable(run_dir)


@pytest.mark.slow
def test_killed_in_sft_and_in_rl_sync_resumes_exactly(tmp_path, reference):
  rng = random.Random(0)
  run_dir = os.path.join(tmp_path, "run")
  _kill_at(_launch(tmp_path, "run", resume=False), run_dir, "sft", rng.choice([1, 10, 20]),
           rng.uniform(0, 1.5))
  _kill_at(_launch(tmp_path, "run"), run_dir, "rl", rng.randint(1, 4), rng.uniform(0, 1.5))
  _finish(_launch(tmp_path, "run"))
  assert (_summary(run_dir)["params_fingerprint"], _comparable(run_dir)) == reference


@pytest.mark.slow
def test_killed_in_rl_async_staleness_0_resumes_exactly(tmp_path, reference):
  async_args = ("--config.rl.schedule.mode=async", "--config.rl.schedule.max_staleness=0")
  run_dir = os.path.join(tmp_path, "run")
  _kill_at(_launch(tmp_path, "run", *async_args, resume=False), run_dir, "rl", 3, 0.3)
  _finish(_launch(tmp_path, "run", *async_args))
  rows = _comparable(run_dir)
  assert [r["policy_lag"] for r in rows if "policy_lag" in r] == [0] * 6
  # every token on-policy (async rows count their tokens' lags; sync rows have none to count)
  assert [(r.pop("token_lag_mean"), r.pop("token_lag_max")) for r in rows
          if "policy_lag" in r] == [(0.0, 0)] * 6
  assert (_summary(run_dir)["params_fingerprint"], rows) == reference


@pytest.mark.slow
def test_truncated_latest_checkpoint_falls_back_to_the_one_before(tmp_path, reference):
  run_dir = os.path.join(tmp_path, "run")
  _kill_at(_launch(tmp_path, "run", resume=False), run_dir, "rl", 5, 1.0)
  rl = os.path.join(run_dir, "checkpoints", "rl")
  latest = max(int(s) for s in os.listdir(rl) if s.isdigit())
  data = os.path.join(rl, str(latest), "actor", "d")
  for name in os.listdir(data):  # cut every array file in half
    path = os.path.join(data, name)
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
  err = _finish(_launch(tmp_path, "run"))
  assert f"checkpoints/rl/{latest} cannot be restored" in err
  assert (_summary(run_dir)["params_fingerprint"], _comparable(run_dir)) == reference
  # The bad one was moved aside, and the redone steps saved their own checkpoints again.
  assert [d.split("-")[:2] for d in os.listdir(os.path.join(run_dir, "checkpoints_unreadable"))] \
      == [["rl", str(latest)]]
  assert str(latest) in os.listdir(rl)


# Partial rollouts ahead of the trainer on the fixed schedule (batch i from version i - 2), rows
# of up to 24 tokens decoding in 16 in-flight slots; checkpoints every 2 steps, evaluations every
# 3. An entropy bonus makes every update depend on the sampled tokens (the verifier scores
# nothing this early), 4 minibatches keep the trainer behind the generator.
AHEAD = ("--config.rl.schedule.mode=async", "--config.rl.schedule.max_staleness=2",
         "--config.rl.steps=10", "--config.rl.schedule.name=fixed",
         "--config.rl.schedule.partial_rollouts=True", "--config.rl.rollout.inflight_slots=16",
         "--config.rl.rollout.max_new_tokens=24", "--config.checkpoint_every=2",
         "--config.eval.every=3", "--config.rl.loss.entropy_coef=0.01",
         "--config.rl.batching.num_minibatches=4")


@pytest.fixture(scope="module")
def ahead_reference(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("ahead")
  _finish(_launch(tmp, "ref", *AHEAD, resume=False))
  run_dir = os.path.join(tmp, "ref")
  summary, rows = _summary(run_dir), _comparable(run_dir)
  # Batch i trained at step i + 1, from version max(0, i - 2): lags 0, 1, 2, 2, ...
  lags = [r["policy_lag"] for r in rows if "policy_lag" in r]
  assert lags == [0, 1] + [2] * 8
  assert all(r["rollout_version"] + r["policy_lag"] == r["step"] - 1 for r in rows
             if "policy_lag" in r)
  assert os.path.getsize(os.path.join(run_dir, "trace.json")) > 0 and 0 <= summary["bubble"] <= 1
  assert sum(summary["token_lag_counts"][:2]) > 0 and len(summary["token_lag_counts"]) == 3
  return summary["params_fingerprint"], rows


def _resume(tmp_path, name, *args):
  """A resumed run, once it has restored its checkpoint (so that metrics rows of the run before
  it, which it cuts back, are gone): (process, (stage, step) it resumed from)."""
  proc = _launch(tmp_path, name, *args)
  while "resumed from" not in (line := proc.stderr.readline()):
    assert line or proc.poll() is None, proc.communicate()[1][-3000:]
  return proc, _resumed_from(line)


def _generator_state(run_dir, step) -> dict:
  """The async generator's state in checkpoints/rl/STEP (its JSON meta)."""
  manager = ocp.CheckpointManager(os.path.join(run_dir, "checkpoints", "rl"))
  meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  manager.close()
  return meta["state"]["generator"]["worker"]


def _kill_after_checkpoint(proc, run_dir, step, delay):
  """SIGKILL `delay` seconds after the RL checkpoint of `step` (or a later one) is complete
  (orbax renames a checkpoint's directory to its step once it is written)."""
  rl, deadline = os.path.join(run_dir, "checkpoints", "rl"), time.time() + 600
  while not (os.path.isdir(rl) and any(d.isdigit() and int(d) >= step for d in os.listdir(rl))):
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert time.time() < deadline
    time.sleep(0.02)
  time.sleep(delay)
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)


def _killed_and_resumed(tmp_path, args, kills) -> list[dict]:
  """Run "run" killed after the RL checkpoint of each (step, delay) of `kills` and resumed; the
  generator's state each resume started from (what it had done ahead of the trainer)."""
  run_dir = os.path.join(tmp_path, "run")
  proc, states = _launch(tmp_path, "run", *args, resume=False), []
  for step, delay in kills:
    _kill_after_checkpoint(proc, run_dir, step, delay)
    proc, (stage, at) = _resume(tmp_path, "run", *args)
    assert stage == "rl" and at >= step
    states.append(_generator_state(run_dir, at))
  _finish(proc)
  return states


@pytest.mark.slow
def test_killed_in_rl_async_ahead_resumes_exactly(tmp_path, ahead_reference):
  """Partial rollouts on the fixed schedule, killed 3 times (whole batches' queue and older
  weights resume in tests/test_partial.py)."""
  run_dir, held = os.path.join(tmp_path, "run"), []
  for state in _killed_and_resumed(tmp_path, AHEAD, [(2, 0.0), (4, 0.3), (6, 0.1)]):
    in_flight = any(b["admitted"] > b["finished"] for b in state.get("stream", {}).get(
        "batches", []))
    held.append((bool(state["queue"]), in_flight))
  # Every resume continued batches generated ahead or rows in flight (whether a pause finds a
  # batch finished depends on the two threads' speeds); one continued both.
  assert all(queued or in_flight for queued, in_flight in held), held
  assert (True, True) in held, held
  assert (_summary(run_dir)["params_fingerprint"], _comparable(run_dir)) == ahead_reference


# Multi-turn partial rollouts (train/rollout/conversations.py) from the start of RL: 3 turns of
# up to 6 tokens each answered with 4 ids, a batch's 16 conversations as requests in 8 in-flight
# slots (so that the generator is seldom far ahead of the trainer).
TALKS = (*AHEAD, "--config.sft.steps=0", "--config.rl.steps=8", "--config.eval.every=4",
         "--config.rl.rollout.inflight_slots=8", "--config.rl.environment.name=synthetic_short",
         "--config.rl.environment.max_turn_tokens=6", "--config.rl.environment.max_turns=3")


@pytest.mark.slow
def test_killed_with_conversations_in_flight_resumes_exactly(tmp_path):
  """Resumed runs replay the conversations in flight into new environments and continue their
  turns from the saved caches: bit for bit an uninterrupted run."""
  _finish(_launch(tmp_path, "ref", *TALKS, resume=False))
  reference = _summary(os.path.join(tmp_path, "ref"))["params_fingerprint"], _comparable(
      os.path.join(tmp_path, "ref"))
  run_dir, talking = os.path.join(tmp_path, "run"), []
  for state in _killed_and_resumed(tmp_path, TALKS, [(2, 0.0), (4, 0.2), (6, 0.1)]):
    batches = state.get("stream", {}).get("batches", [])
    talking.append(any(t["turns"] and not ended for b in batches
                       for t, ended in zip(b["talks"], b["ended"])))
  assert any(talking), "no resume had a conversation in flight"
  assert (_summary(run_dir)["params_fingerprint"], _comparable(run_dir)) == reference


@pytest.mark.slow
def test_a_run_dir_of_an_unrolled_decoder_resumes_with_a_scanned_one(tmp_path, reference):
  """`model.layers.scan` changes how the blocks are stored (stacked) and computed (a scan):
  a run killed mid-RL resumes with it from its per-layer checkpoint (the actor, the reference
  and the optimizer's moments converted on the devices: jaxrl/models/scan.py) and ends with
  every row once. Its weights then differ from the uninterrupted run by rounding only: the
  scan sums in another order."""
  run_dir = os.path.join(tmp_path, "run")
  proc, saved = _launch(tmp_path, "run", resume=False), os.path.join(run_dir, "checkpoints/rl/4")
  deadline = time.time() + 600
  while not os.path.isdir(saved):  # (orbax renames a finished save into place)
    assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  err = _finish(_launch(tmp_path, "run", "--config.model.layers.scan=True"))
  assert _resumed_from(err) == ("rl", 4), err[-3000:]
  rows = _comparable(run_dir)
  assert [(r["phase"], r["step"]) for r in rows] == [(r["phase"], r["step"]) for r in reference[1]]
  ref = {(r["phase"], r["step"]): r for r in reference[1]}
  for row in rows:
    for key in ("entropy", "heldout_acc"):
      if key in row:
        assert row[key] == pytest.approx(ref[(row["phase"], row["step"])][key], abs=1e-3), key


def test_resuming_an_unnamed_run_by_its_name_warns_only_of_what_changed(tmp_path, caplog):
  """A run started without a name lives in a timestamp directory; resumed by that name, its
  run_name ('' -> the name) and run_dir are how it is found, not a change of the config."""
  from jaxrl.config_files import resolve, shipped
  from train.io import rundir

  first = resolve(shipped("tiny").get_config(), hf=False)
  run_dir = tmp_path / "20261205-120000"
  rundir.write_config(first, str(run_dir))
  (run_dir / "checkpoints" / "sft").mkdir(parents=True)
  raw = shipped("tiny").get_config()
  raw.update(run_dir=str(tmp_path), run_name="20261205-120000")
  with caplog.at_level("WARNING", logger="jaxrl"):
    assert rundir.prepare(resolve(raw, hf=False), resume=True) == str(run_dir)
    assert not caplog.records
    raw.rl.steps = 7
    rundir.prepare(resolve(raw, hf=False), resume=True)
  assert [r.getMessage() for r in caplog.records] == [
      "resuming with a changed config: config.rl.steps: 3 -> 7"]
