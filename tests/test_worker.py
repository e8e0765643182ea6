import functools
import threading
import time
import traceback
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.data.tokenizer import ByteTokenizer
from jaxrl.schedules import SCHEDULES, WorkerView
from jaxrl.models.transformer import LanguageModel
from sampler.engine import generate
from sampler.methods import SamplingConfig
from train.rollout.whole import RolloutWorker
from train.rollout.worker import RolloutWorkerError

TOK = ByteTokenizer()


def _prompt_stream(n_batches):
  """Prompt batch i by index (an IndexError ends the stream)."""
  batches = []
  for i in range(n_batches):
    tokens, valid = TOK.pad_left([TOK.encode(f"{i}+{j}=", bos=True) for j in range(4)], 8)
    batches.append({"tokens": tokens, "valid": valid})
  return batches


def _real_generate(tiny_cfg):
  graphdef, params = nnx.split(LanguageModel(tiny_cfg, rngs=nnx.Rngs(0)))
  cfg = SamplingConfig(max_new_tokens=4, eos_id=TOK.eos_id, pad_id=TOK.pad_id)
  fn = jax.jit(functools.partial(generate, graphdef, cfg=cfg, n=2))
  return (lambda p, prompts, key: fn(p, prompts["tokens"], prompts["valid"], key)), params


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_versions_monotonic_and_staleness_bounded(tiny_cfg, max_staleness):
  gen, params = _real_generate(tiny_cfg)
  seen = []
  with RolloutWorker(gen, _prompt_stream(12), params, max_staleness=max_staleness) as worker:
    version = 0
    for batch in worker:
      assert batch.rollout.tokens_BT.shape == (8, 12)  # 4 prompts x 2 samples, 8 + 4 tokens
      assert version - batch.version <= max_staleness
      seen.append(batch.version)
      time.sleep(0.01)  # the trainer's update
      version += 1
      worker.update_weights(jax.tree.map(lambda x: x * 1.0, params), version)
  assert seen == sorted(seen) and len(seen) == 12  # none too stale: none dropped
  if max_staleness == 0:
    assert seen == list(range(len(seen)))  # synchronous: always the newest weights


def test_new_weights_are_used(tiny_cfg):
  gen, params = _real_generate(tiny_cfg)
  zeros = jax.tree.map(jnp.zeros_like, params)  # all-zero weights: uniform logits
  with RolloutWorker(gen, _prompt_stream(3), params, max_staleness=0) as worker:
    first = worker.get(timeout=60)
    worker.update_weights(zeros, 1)
    second = worker.get(timeout=60)
  assert first.version == 0 and second.version == 1
  uniform = -np.log(tiny_cfg.vocab_size)
  mask = np.asarray(second.rollout.completion_mask_BN)
  np.testing.assert_allclose(np.asarray(second.rollout.logprobs_BN)[mask], uniform, rtol=1e-5)
  assert not np.allclose(np.asarray(first.rollout.logprobs_BN)[mask], uniform, rtol=1e-3)


def _exploding_generate(params, prompts, key):
  raise ValueError("bad prompt batch 7")


def test_worker_exception_reaches_consumer_with_traceback():
  worker = RolloutWorker(_exploding_generate, _prompt_stream(3), {"w": jnp.ones(2)})
  with pytest.raises(RolloutWorkerError) as e:
    worker.get(timeout=30)
  assert isinstance(e.value.__cause__, ValueError)
  frames = traceback.extract_tb(e.value.__cause__.__traceback__)
  assert any(f.name == "_exploding_generate" for f in frames)
  worker.close()


def test_close_returns_with_full_queue_and_no_consumer():
  calls = threading.Event()

  def gen(params, prompts, key):
    calls.set()
    return params

  worker = RolloutWorker(gen, range(10**6), {"w": jnp.ones(2)}, max_staleness=5)
  assert calls.wait(10)
  time.sleep(0.1)  # the worker is now blocked on the full queue
  t0 = time.monotonic()
  worker.close(timeout=5)
  assert time.monotonic() - t0 < 5
  with pytest.raises(RolloutWorkerError, match="closed"):
    worker.get(timeout=1)


def test_sync_worker_waits_for_new_weights_or_a_request_within_the_step():
  calls = []
  worker = RolloutWorker(lambda p, prompts, key: calls.append(prompts) or prompts, range(100),
                         {"w": jnp.ones(2)}, max_staleness=0)
  assert worker.get(timeout=10).prompts == 0
  time.sleep(0.3)
  assert calls == [0]  # no batch ahead of the trainer's update ...
  batch = worker.get(timeout=10)  # ... unless it asks for another before pushing (DAPO's rounds)
  assert (batch.prompts, batch.version) == (1, 0)
  worker.update_weights({"w": jnp.zeros(2)}, 1)
  assert worker.get(timeout=10).version == 1
  with pytest.raises(ValueError, match="must increase"):
    worker.update_weights({"w": jnp.zeros(2)}, 1)
  worker.close()


def test_schedules_decide_from_the_workers_view_alone():
  def view(taken, push=False, installed=0, newest=0, exhausted=False):
    return WorkerView(taken, push, installed, newest, exhausted)

  free, fixed = SCHEDULES["free"](1), SCHEDULES["fixed"](1)
  # Batch 3 next to take: one update can come before batch 4, two when a push is coming
  assert (view(3).ahead(4), view(3, push=True).ahead(4)) == (1, 2)
  assert free.ready(view(3), 4) and not free.ready(view(3, push=True), 4)
  assert free.blocked(view(3, push=True), 4, 0) and not free.blocked(view(3), 4, 0)
  # Fixed: batch 4 starts with version 3, the installed weights or the newest push
  assert not fixed.ready(view(3, installed=2, newest=2), 4)
  assert fixed.ready(view(3, installed=2, newest=3), 4)
  assert fixed.takes_pending(view(3, installed=2, newest=3), 4)
  assert fixed.ready(view(3, installed=3, newest=4), 4)
  assert not fixed.takes_pending(view(3, installed=3, newest=4), 4)
  # ... opens only once batch 2 has left the stream (its weights need it trained)
  assert fixed.blocked(view(0), 4, 2) and not fixed.blocked(view(0), 4, 3)
  # ... and a push of version 5 waits for version 4 installed, unless the prompts ran out
  assert not fixed.push_ready(view(0, installed=3), 5)
  assert fixed.push_ready(view(0, installed=4), 5)
  assert fixed.push_ready(view(0, installed=3, exhausted=True), 5)
  # One of two generators (odd batches, batch 5 next): version 4 stays until its batch 5 has
  # started with it; version 5, which no batch of its needs, gives way to 6 at once
  odd = dict(taken=5, push_coming=False, installed=3, newest=4, exhausted=False, next_own=5, stride=2)
  assert not fixed.push_ready(WorkerView(**odd), 5)
  assert fixed.push_ready(WorkerView(**{**odd, "newest": 5}), 6)
  assert fixed.push_ready(WorkerView(**{**odd, "installed": 4}), 5)


class _Box:
  """crossing.Mailbox's protocol in memory (one process's threads stand for the processes)."""
  _store, _cond = {}, threading.Condition()

  def __init__(self, name):
    self.name = name

  def post(self, key, message):
    with self._cond:
      self._store[(self.name, key)] = message
      self._cond.notify_all()

  def has(self, key):
    with self._cond:
      return (self.name, key) in self._store

  def take(self, key, *, poll_s=5.0, timeout_s=None):
    with self._cond:
      if not self._cond.wait_for(lambda: (self.name, key) in self._store, timeout_s):
        raise TimeoutError(key)
      return self._store[(self.name, key)]


@pytest.mark.parametrize("schedule,lag_s", [("free", 0.0), ("free", 0.1), ("fixed", 0.1)])
def test_a_group_of_processes_closes_where_its_first_process_did(schedule, lag_s):
  """Two workers with `Decisions` stand for a sampler group of two processes, each batch a
  collective (a barrier both must reach). Whatever each side's timing, the follower takes the
  leader's choices (which batch starts with which weights, and where it stops): both generate
  the same batches, and both close without a collective left half-way."""
  from train.rollout.decisions import Decisions
  collective, made = threading.Barrier(2, timeout=5), {"leader": [], "follower": []}

  def generate_as(who):
    def generate(params, prompts, key):
      collective.wait()
      made[who].append((int(prompts), params))
      return np.zeros(2)
    return generate

  name = f"{schedule}/{lag_s}"
  decisions = {who: Decisions(name, who == "leader", made=_Box, poll_s=0.05)
               for who in made}
  workers = {who: RolloutWorker(generate_as(who), list(range(8)), 0, max_staleness=1,
                                schedule=schedule, decide=decisions[who]) for who in made}
  errors = []

  def requests(who):  # the requests both sides handle in the same order
    try:
      worker = workers[who]
      for version in (1, 2, 3):
        worker.get()
        if who == "follower":  # (its thread waits for the push: the leader's is past it)
          time.sleep(lag_s)
        worker.update_weights(version, version)
      decisions[who].close(worker)  # right after a push: the leader may have started a batch
    except BaseException:  # noqa: BLE001 - reported below
      errors.append(f"{who}: {traceback.format_exc()}")

  threads = [threading.Thread(target=requests, args=(who,)) for who in made]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  assert not errors, errors
  assert not any(w.failed for w in workers.values())
  assert made["leader"] == made["follower"] and len(made["leader"]) >= 3  # (the 3 taken)


def test_a_group_of_processes_pauses_where_its_first_process_did():
  """A pause asked of both processes of a group while the first one still generates a batch
  the other has finished: both pause after the same batches (the state the trainer gathers
  from the two is one state), and both go on after it to a common close."""
  from train.rollout.decisions import Decisions
  collective, made = threading.Barrier(2, timeout=5), {"leader": [], "follower": []}

  def generate_as(who):
    def generate(params, prompts, key):
      collective.wait()
      time.sleep(0.5 if who == "leader" else 0.0)
      made[who].append(int(prompts))
      return types.SimpleNamespace(tokens=np.full(2, int(prompts)))
    return generate

  decisions = {who: Decisions("pauses", who == "leader", made=_Box, poll_s=0.05)
               for who in made}
  workers = {who: RolloutWorker(generate_as(who), list(range(8)), 0, max_staleness=3,
                                schedule="free", decide=decisions[who]) for who in made}
  while len(made["follower"]) < 2:
    time.sleep(0.01)
  assert len(made["leader"]) < 2  # (the pause is asked while the first process is behind)
  states = {}

  def pause_and_close(who):
    with workers[who].paused() as state:
      states[who] = [(m["index"], m["version"]) for m in state.meta["queue"]]
    decisions[who].close(workers[who])

  threads = [threading.Thread(target=pause_and_close, args=(who,)) for who in made]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  assert not any(t.is_alive() for t in threads)
  assert states["leader"] == states["follower"] == [(0, 0), (1, 0)]
  assert made["leader"] == made["follower"]


class _SlowPosts(_Box):
  """A store that shows a batch's choice before its post returns (the leader's thread is still
  posting when the trainer closes it)."""

  def post(self, key, message):
    super().post(key, message)
    if str(message.get("key", "")).startswith("batch"):
      time.sleep(0.4)


def test_a_choice_the_first_process_made_is_run_though_it_closed_meanwhile():
  """The trainer closes both processes of a group while the first one posts the choice of
  batch 0: the other took it and generates it (a collective), so the first one generates it
  too, and both stop after it, none with a collective left half-way."""
  from train.rollout.decisions import Decisions
  collective, made = threading.Barrier(2, timeout=5), {"leader": [], "follower": []}

  def generate_as(who):
    def generate(params, prompts, key):
      collective.wait()
      made[who].append(int(prompts))
      return np.zeros(2)
    return generate

  decisions = {who: Decisions("closing", who == "leader", made=_SlowPosts, poll_s=0.05)
               for who in made}
  workers = {who: RolloutWorker(generate_as(who), list(range(8)), 0, max_staleness=1,
                                schedule="free", decide=decisions[who]) for who in made}
  time.sleep(0.1)
  threads = [threading.Thread(target=decisions[who].close, args=(workers[who],))
             for who in made]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  assert not any(t.is_alive() for t in threads)
  assert not any(w.failed for w in workers.values())
  assert made["leader"] == made["follower"] == [0]


def test_pauses_asked_back_to_back_are_each_served():
  """The trainer asks the next pause as soon as one ends (before the worker's thread wakes from
  the first): the thread serves that one too, rather than wait for the first to end again."""
  from train.rollout.worker import Worker

  class Idle(Worker):  # a thread that only waits (as a partial worker does for the trainer)
    def _needs_pause(self):
      return True

    def _run(self):
      with self.locked():
        while self.wait_for_change(self.changes):
          pass

  worker = Idle([], 0, version=0, max_staleness=1, seed=0, start_index=0, schedule="free",
                transfer=None, state=None)
  worker.launch()
  served = []

  def pauses():
    for _ in range(200):
      with worker.paused() as state:
        served.append(state.meta["installed"])

  thread = threading.Thread(target=pauses, daemon=True)
  thread.start()
  thread.join(30)
  assert not thread.is_alive() and len(served) == 200
  worker.close()


def test_generators_dealt_every_other_batch_count_the_free_bound_from_the_trainers_batch():
  """Two workers, each every other batch (replicas.py's generators), under the free schedule
  with no staleness: each push says which batch the trainer takes next, so every batch starts
  with the weights the trainer will be at (not ahead of the other worker's batches)."""
  workers = [RolloutWorker(lambda params, prompts, key: prompts, list(range(6)), 0,
                           max_staleness=0, schedule="free", start_index=k, stride=2,
                           trainer_at=0) for k in (0, 1)]
  for version in range(6):
    batch = workers[version % 2].get(timeout=30)
    assert (batch.index, batch.version) == (version, version)
    for worker in workers:
      worker.update_weights(version + 1, version + 1, taken=version + 1)
  for worker in workers:
    worker.close()
