"""User code contained: a reward function or an environment that raises, hangs past
`rl.user_code.timeout_s`, returns the wrong type or shape, or a NaN is reported with the
sample's (or conversation's) index; `rl.user_code.on_error` decides: stop (one line, exit 2) or
score 0 and count (`user_code_errors`). Reward functions run in worker processes
(isolation/workers.py): a hang that holds the GIL, a spin, a 40 GB allocation, a flood of output,
a file past the size limit and a fork bomb are each contained within about the time limit; user
environments run in host processes (jaxrl/envs/hosted.py) with the same limits and the same
faults."""
import os
import re
import tempfile
import time

import numpy as np
import pytest

from jaxrl.envs import ContainedEnvironment, EnvError, Step
from jaxrl.rewards.user import RewardFnError, call_reward_fn
from isolation.workers import UserCodePool

PROMPTS, COMPLETIONS = ["p0", "p1", "p2"], ["a", "bb", "ccc"]


def raises_on_bb(prompts, completions, **_):
  return [1 / (c != "bb") for c in completions]


def hangs(prompts, completions, **_):
  time.sleep(30)


def nan_on_bb(prompts, completions, **_):
  return [float("nan") if c == "bb" else 1.0 for c in completions]


def wrong_shape(prompts, completions, **_):
  return np.ones((len(completions), 2))


def regex_holding_the_gil(prompts, completions, **_):
  return [float(bool(re.match(r"(\d+)+$", "1" * 40 + "x"))) for _ in completions]


def spins(prompts, completions, **_):
  while True:
    pass


def allocates_40_gb(prompts, completions, **_):
  return [float(len(bytearray(40 * 2**30)))] * len(completions)


def prints_gigabytes(prompts, completions, **_):
  for _ in range(10**7):
    print("x" * 1000)
  return [1.0] * len(completions)


def writes_gigabytes(prompts, completions, **_):
  fd, path = tempfile.mkstemp()
  try:
    with os.fdopen(fd, "wb") as f:
      for _ in range(4096):
        f.write(b"x" * 2**20)
  finally:
    os.remove(path)
  return [1.0] * len(completions)


def fork_bomb(prompts, completions, **_):
  while True:
    os.fork()


def forks_children_holding_600_mb(prompts, completions, **_):
  """Three children, each holding 600 MB for a second: 1.8 GB against the worker's 1 GB."""
  children = []
  for _ in range(3):
    pid = os.fork()
    if pid == 0:
      try:
        held = bytearray(600 * 2**20)
        for i in range(0, len(held), 4096):
          held[i] = 1
      except MemoryError:
        os._exit(1)
      time.sleep(1)
      os._exit(0)
    children.append(pid)
  ends = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
  return [ends.count(0) * 600.0] * len(completions)


CASES = [  # fn, the error under "stop", the rewards under "zero", how many samples failed
    (raises_on_bb, " on sample 1: raised ZeroDivisionError: division by zero", [1, 0, 1], 1),
    (hangs, ": did not return within 0.2 s", [0, 0, 0], 3),
    (nan_on_bb, " on sample 1: returned nan, not a finite number", [1, 0, 1], 1),
    (wrong_shape, ": returned an array of shape (2, 2), not (2,)", [0, 0, 0], 3),  # (2 calls)
    (regex_holding_the_gil, ": did not return within 0.2 s", [0, 0, 0], 3),
    (spins, ": did not return within 0.2 s", [0, 0, 0], 3),
    (allocates_40_gb, ": raised MemoryError", [0, 0, 0], 3),
    (prints_gigabytes, ": did not return within 0.2 s", [0, 0, 0], 3),
    (writes_gigabytes, ": raised OSError: [Errno 27] File too large", [0, 0, 0], 3),
    (fork_bomb, ": raised BlockingIOError: [Errno 11] Resource temporarily unavailable",
     [0, 0, 0], 3),
]


# The allowance for a worker's start (a replacement's, after a kill): the pool's `start_s`,
# generous, as a loaded machine needs (the time bounds below are the pool's own deadlines)
START_S = 20.0


@pytest.fixture(scope="module")
def pool():
  # A 4 MB file limit (64 by default): writing up to 64 MB took more than the 0.2 s limit once
  # on a loaded 2-core machine, and the time limit answered first
  workers = UserCodePool(workers=2, timeout_s=0.2, memory_gb=2.0, file_mb=4.0, start_s=START_S,
                         preload=[f"{__name__}:{case[0].__name__}" for case in CASES])
  yield workers
  workers.close()


@pytest.mark.parametrize("fn,stop_message,zero_rewards,failed", CASES,
                         ids=[c[0].__name__ for c in CASES])
def test_a_misbehaving_reward_function_under_both_policies(fn, stop_message, zero_rewards,
                                                           failed, pool, capfd):
  with pytest.raises(RewardFnError) as e:
    call_reward_fn(fn, PROMPTS, COMPLETIONS, pool=pool, policy="stop")
  assert str(e.value) == f"reward function {__name__}:{fn.__name__}{stop_message}"
  counted = []
  t0 = time.monotonic()
  rewards = call_reward_fn(fn, PROMPTS, COMPLETIONS, pool=pool, policy="zero",
                           report=counted.append)
  assert rewards.tolist() == zero_rewards and counted == [failed]
  # Within the pool's deadlines: the batch's round (a call's limit and a start's allowance),
  # then one retry round of two limits; a machine's load moves only what they contain
  assert time.monotonic() - t0 < 3 * pool.timeout_s + pool.start_s
  assert len(capfd.readouterr().out) < 1000  # a worker's output is discarded


FAULTS = {1: lambda: 1 / 0, 2: lambda: time.sleep(30), 3: lambda: {"observation": [1]},
          4: lambda: regex_holding_the_gil([], [""]), 5: lambda: spins([], []),
          6: lambda: allocates_40_gb([], []), 7: lambda: fork_bomb([], []),
          8: lambda: prints_gigabytes([], []), 9: lambda: writes_gigabytes([], [])}


class Flaky:
  """A user environment whose step misbehaves as `FAULTS` says, by the turn's first id."""
  stop_strings = ("</x>",)

  def __init__(self, tok, verifier):
    pass

  def reset(self, example):
    return [7]

  def step(self, turn_ids):
    if turn_ids[0] in FAULTS:
      return FAULTS[turn_ids[0]]()
    return Step([5, 6], 0.5, False)


@pytest.fixture(scope="module")
def hosts():
  from jaxrl.data.tokenizer import ByteTokenizer
  from jaxrl.envs import EnvHosts
  # (the pool's 4 MB file limit: writing up to 64 MB outlasted the 0.5 s limit under load)
  hosted = EnvHosts("test_user_code:Flaky", ByteTokenizer(), "math", workers=1, timeout_s=0.5,
                    memory_gb=2.0, file_mb=4.0, start_s=START_S)
  yield hosted
  hosted.close()


def contained(hosts, policy, report=None):
  return ContainedEnvironment(hosts.new(), name="my:Flaky", policy=policy, report=report)


@pytest.mark.parametrize("first,message", [
    (1, "step: ObjectCallError: ZeroDivisionError: division by zero"),
    (2, "step: UserCodeTimeout: step did not return within 0.5 s (its host process was killed)"),
    (3, "step returned a dict, not a jaxrl.envs.Step"),
    (4, "step: UserCodeTimeout: step did not return within 0.5 s (its host process was killed)"),
    (5, "step: UserCodeTimeout: step did not return within 0.5 s (its host process was killed)"),
    (6, "step: ObjectCallError: MemoryError"),
    (7, "step: ObjectCallError: BlockingIOError: [Errno 11] Resource temporarily unavailable"),
    (8, "step: UserCodeTimeout: step did not return within 0.5 s (its host process was killed)"),
    (9, "step: ObjectCallError: OSError: [Errno 27] File too large"),
], ids=["raises", "sleeps", "returns a dict", "regex", "spins", "40 GB", "fork bomb",
        "prints GBs", "writes GBs"])
def test_a_misbehaving_environment_under_both_policies(hosts, first, message):
  """The environment lives in a host process (jaxrl/envs/hosted.py): each fault is one error
  naming it (a call past the time limit: its host killed), the run goes on (the next
  environment works), nothing runs on in a thread."""
  stop = contained(hosts, "stop")
  assert stop.reset(None) == [7] and stop.step([4 - 4]) == Step([5, 6], 0.5, False)
  with pytest.raises(EnvError) as e:
    stop.step([first])
  assert str(e.value) == f"environment my:Flaky: {message}"
  counted = []
  zero = contained(hosts, "zero", counted.append)
  assert zero.step([first]) == Step([], 0.0, True) and counted == [1]
  assert zero.step([0]) == Step([], 0.0, True)  # the conversation is over
  assert contained(hosts, "stop").step([0]) == Step([5, 6], 0.5, False)


REWARDS = '''
import time

def slow_sometimes(prompts, completions, **_):
  with open(COUNTER, "a+") as f:  # (the calls, counted across worker processes)
    f.write("x")
    f.seek(0)
    calls = len(f.read())
  if calls in (4, 5):  # (after 3 evaluations) the first 2 RL steps' scoring hangs
    time.sleep(5)
  return [float(len(c) % 2) for c in completions]

def raises_on_a(prompts, completions, answer, **_):
  return [1 / ("a" not in a) for a in answer]
'''


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
  (tmp_path / "faulty_rewards.py").write_text(f"COUNTER = {str(tmp_path / 'calls')!r}\n"
                                              + REWARDS)
  monkeypatch.syspath_prepend(str(tmp_path))
  return "faulty_rewards"


def test_a_hanging_reward_function_scores_0_and_the_run_goes_on(cli, user_rewards, tmp_path):
  import json
  import os
  rc, _ = cli(f"--config.rl.verifier={user_rewards}:slow_sometimes",
              "--config.rl.user_code.on_error=zero", "--config.rl.user_code.timeout_s=0.5",
              "--config.rl.user_code.workers=1",
              "--config.run_name=slow", "--config.sft.steps=1", "--config.rl.steps=3")
  assert rc == 0
  with open(os.path.join(tmp_path, "runs", "slow", "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if '"user_code_errors"' in line]
  assert [r["user_code_errors"] for r in rows] == [16, 16, 0]  # 8 prompts x 2 samples a step


def test_a_raising_reward_function_stops_the_run_naming_the_sample(cli, user_rewards):
  from jaxrl.config_files import shipped
  tiny = shipped("tiny")
  from jaxrl.data.tasks import make_splits
  t = tiny.get_config().task
  held = make_splits(t.name, t.num_digits, t.n_train, t.n_heldout, 0, t.teacher_error)[1]
  first = next(i for i, ex in enumerate(held) if "a" in ex.answer)  # the first evaluation's
  rc, line = cli(f"--config.rl.verifier={user_rewards}:raises_on_a", "--config.sft.steps=1")
  assert rc == 2 and line == (f"config.rl.verifier: reward function {user_rewards}:raises_on_a "
                              f"on sample {first}: raised ZeroDivisionError: division by zero")


@pytest.mark.parametrize("module,message", [
    ("import time\ntime.sleep(600)\n",
     "importing it did not finish within 2 s (rl.user_code.timeout_s)"),
    ("X = bytearray(40 * 2**30)\n", "importing 'bad_import' failed (MemoryError)")])
def test_a_reward_module_whose_import_hangs_or_allocates_stops_the_run_in_one_line(
    cli, tmp_path, monkeypatch, module, message):
  """The module is imported in a worker only: the trainer process never imports it, and the
  run ends with one line and exit 2 within about the time limit (and a worker's start)."""
  import sys
  (tmp_path / "bad_import.py").write_text(module)
  monkeypatch.syspath_prepend(str(tmp_path))
  start = time.monotonic()
  rc, line = cli("--config.rl.verifier=bad_import:reward", "--config.rl.user_code.timeout_s=2")
  assert rc == 2 and line == ("config.rl.verifier: reward function 'bad_import:reward': "
                              + message)
  assert time.monotonic() - start < 30
  assert "bad_import" not in sys.modules


@pytest.mark.parametrize("hierarchy", ["this machine's", "none"])
def test_a_workers_children_share_its_memory_limit(monkeypatch, hierarchy):
  """A reward worker's forked children share its 1 GB: a cgroup per worker kills inside it
  past 1 GB (or the children's memory was never more); without a writable hierarchy (forced
  here), the budget lets the worker start no process at all (threads still run)."""
  from isolation import process_limits
  if hierarchy == "none":
    monkeypatch.setattr(process_limits, "CGROUP", "/nonexistent")
  spec = f"{__name__}:forks_children_holding_600_mb"
  pool = UserCodePool(workers=1, timeout_s=20.0, memory_gb=1.0, preload=[spec])
  try:
    [(out, error)] = pool.results([pool.submit(spec, prompts=["p"], completions=["a"])])
    threads = pool.results([pool.submit(f"{__name__}:runs_a_thread")])[0]
  finally:
    pool.close()
  if pool.tree.kind == "budget":
    assert isinstance(error, BlockingIOError) and out is None
  else:
    assert error is None and out[0] <= 600, (out, error)
  assert threads == (7, None)


def runs_a_thread():
  import threading
  box = []
  thread = threading.Thread(target=lambda: box.append(7))
  thread.start()
  thread.join()
  return box[0]


def worker_pid():
  return os.getpid()


def test_a_runs_user_code_processes_are_its_own_and_stop_with_it():
  """A run's processes of user code (train/task/processes.py: `UserProcesses`, its RunContext's):
  two runs in one process share no worker, and closing one stops its reward workers and
  environment hosts while the other's go on."""
  from jaxrl.config_rl import UserCodeConfig
  from jaxrl.data.tokenizer import ByteTokenizer
  from train.task.processes import UserProcesses
  limits = UserCodeConfig(workers=1, timeout_s=5.0, memory_gb=2.0)
  spec, env = f"{__name__}:worker_pid", "test_user_code:Flaky"
  first, second = UserProcesses(), UserProcesses()
  with second:
    pools = [first.pool(limits, spec), second.pool(limits, spec)]
    hosts = [p.hosts(limits, env, ByteTokenizer(), "exact_match") for p in (first, second)]
    pids = [pool.results([pool.submit(spec)])[0][0] for pool in pools]
    assert pids[0] != pids[1] and os.getpid() not in pids
    assert [h.new().reset(None) for h in hosts] == [[7], [7]]
    first.close()
    assert first.closed and not second.closed
    with pytest.raises(RuntimeError):
      pools[0].submit(spec)
    assert not hosts[0].hosts[0].process.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
      first.pool(limits, spec)
    assert pools[1].results([pools[1].submit(spec)])[0][0] == pids[1]  # the same worker
    assert hosts[1].new().reset(None) == [7]
  assert not hosts[1].hosts[0].process.is_alive()
