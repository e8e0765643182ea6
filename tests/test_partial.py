"""The async schedule (train/rollout/worker.py) and partial rollouts (train/rollout/partial.py,
sampler/stream.py): staleness without dropped batches, the fixed schedule's versions whatever
the trainer's timing, weights swapped into rows in flight with every token's version and
log-prob, and a worker's run state put back bit for bit with batches queued and rows in flight."""
import dataclasses
import random
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.data.tokenizer import ByteTokenizer
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import LanguageModel
from sampler.methods import SamplingConfig
from sampler.sampler import Sampler
from sampler.stream import StreamGeometry
from train.rollout.partial import PartialRolloutWorker
from train.rollout.whole import RolloutWorker

TOK = ByteTokenizer()
N_BATCHES, PROMPTS, BUDGET = 7, 3, 20
TINY = ModelConfig(vocab_size=264, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   d_ff=64)  # (conftest's tiny_cfg, for a module-scoped fixture)


class Batches:
  """Prompt batch i by index; an IndexError ends the stream."""

  def __getitem__(self, i):
    if i >= N_BATCHES:
      raise IndexError(i)
    ids = [TOK.encode(f"{i}+{j}{'=' * (j + 1)}", bos=True) for j in range(PROMPTS)]
    tokens, valid = TOK.pad_left(ids, 8)
    return {"prompt_tokens": tokens, "prompt_valid": valid}


@pytest.fixture(scope="module")
def model():
  graphdef, params = nnx.split(LanguageModel(TINY, rngs=nnx.Rngs(0)))
  # One token in seven ends a row (~15% a step for this random model): uneven lengths, up to
  # BUDGET tokens over several decode segments
  cfg = SamplingConfig(max_new_tokens=BUDGET, eos_id=-1, pad_id=TOK.pad_id,
                       stop_sequences=tuple((t,) for t in range(0, TINY.vocab_size, 7)))
  return Sampler(graphdef, cfg, n=2, inflight_slots=4), params


def _weights(params, version):
  return jax.tree.map(lambda x: x * (1 + 0.1 * version), params)


def _geometry(sampler, live):
  return StreamGeometry(slots=sampler.inflight_slots, rows=PROMPTS * sampler.n, live=live,
                        prompt_width=8, max_new_tokens=sampler.cfg.max_new_tokens)


def _partial(model, schedule, staleness, version=0, state=None, start=0, stride=1):
  sampler, params = model
  stream = sampler.stream(params, _geometry(sampler, live=staleness + 1))
  return PartialRolloutWorker(stream, Batches(), _weights(params, version), version=version,
                              max_staleness=staleness, schedule=schedule, state=state,
                              start_index=start, stride=stride)


def _train(worker, params, *, seed=None, stop_after=None, until=lambda state: True):
  """Takes every batch, 'updating' (a perturbation, after a random pause) after each; with
  `stop_after`, returns the batches and the worker's state after that many updates, from the
  first pause whose state meets `until` (the worker paused and resumed until then: what the
  fixed schedule generates does not depend on when it pauses)."""
  rng, out, version = random.Random(seed), [], worker.version
  for batch in worker:
    out.append(batch)
    time.sleep(rng.uniform(0, 0.05) if seed is not None else 0)
    version += 1
    worker.update_weights(_weights(params, version), version)
    if version == stop_after:
      for _ in range(2000):
        with worker.paused() as state:
          if until(state):
            worker.close()
            return out, state, version
        time.sleep(0.005)
      worker.close()
      return out, state, version
  worker.close()
  return out, None, version


def _same(a, b):
  assert [x.index for x in a] == [y.index for y in b]
  for x, y in zip(a, b):
    assert x.version == y.version
    np.testing.assert_array_equal(x.versions_BN, y.versions_BN)
    for field in ("tokens_BT", "valid_BT", "logprobs_BN"):
      np.testing.assert_array_equal(getattr(x.rollout, field), getattr(y.rollout, field))


def test_fixed_schedule_is_a_function_of_the_seed_and_resumes_with_rows_in_flight(model):
  runs = [_train(_partial(model, "fixed", 1), model[1], seed=s)[0] for s in (0, 1)]
  _same(*runs)
  batches = runs[0]
  assert [b.version for b in batches] == [max(0, i - 1) for i in range(N_BATCHES)]
  # Rows in flight took the next version as the following batch opened: tokens of 2 versions.
  assert any(len(np.unique(b.versions_BN)) == 2 for b in batches)
  in_flight = lambda state: any(b["admitted"] > b["finished"]  # noqa: E731
                                for b in state.meta["stream"]["batches"])
  first, state, version = _train(_partial(model, "fixed", 1), model[1], stop_after=3,
                                 until=in_flight)
  assert in_flight(state), "no row in flight at a pause"
  resumed = _partial(model, "fixed", 1, version=version, state=state, start=version)
  _same(first + _train(resumed, model[1])[0], batches)


def _train_dealt(workers, params, seed):
  """As `_train`, batch i taken from `workers[i % len(workers)]`, every update pushed to all
  (train/rollout/replicas.py `Generators`)."""
  rng, out = random.Random(seed), []
  try:
    while True:
      try:
        out.append(workers[len(out) % len(workers)].get(timeout=60))
      except StopIteration:
        return out
      time.sleep(rng.uniform(0, 0.05))
      for worker in workers:
        worker.update_weights(_weights(params, len(out)), len(out), taken=len(out))
  finally:
    for worker in workers:
      worker.close()


def test_two_streams_dealt_every_other_batch_follow_the_fixed_schedule(model):
  """Two generators' streams (every other batch each, `stride`): under the fixed schedule each
  batch starts with its version and the rollouts are a function of the seed; with nothing
  generated ahead (max_staleness 0) they draw one stream's tokens, their log-probs within
  float32 rounding (a row's keys lie elsewhere in its slot's ring, which the global decode
  step places: sampler/slots.py; attention sums them in another order)."""
  dealt = lambda s, seed: _train_dealt(  # noqa: E731
      [_partial(model, "fixed", s, start=k, stride=2) for k in (0, 1)], model[1], seed)
  runs = [dealt(1, seed) for seed in (0, 1)]
  _same(*runs)
  assert [b.version for b in runs[0]] == [max(0, i - 1) for i in range(N_BATCHES)]
  one = _train(_partial(model, "fixed", 0), model[1])[0]
  for x, y in zip(dealt(0, 0), one, strict=True):
    assert (x.index, x.version) == (y.index, y.version)
    np.testing.assert_array_equal(x.rollout.tokens_BT, y.rollout.tokens_BT)
    np.testing.assert_allclose(x.rollout.logprobs_BN, y.rollout.logprobs_BN, atol=1e-5)


def test_swapped_weights_reach_rows_in_flight_with_their_versions_and_logprobs(model, tiny_cfg):
  sampler, params = model
  # Every row runs to BUDGET tokens (3 segments): batch 1's last rows start as batch 0 ends
  sampler = dataclasses.replace(sampler, cfg=dataclasses.replace(sampler.cfg, stop_sequences=()))
  zeros = jax.tree.map(jnp.zeros_like, params)  # all-zero weights: uniform logits
  worker = _partial((sampler, params), "free", 1)
  first = worker.get(timeout=60)  # batch 1 opened with version 0 before batch 0 ended
  worker.update_weights(zeros, 1)  # ... and its rows take these weights mid-way
  second = worker.get(timeout=60)
  worker.close()
  assert first.versions_BN.max() == 0 and second.version == 0
  versions, logp = second.versions_BN, np.asarray(second.rollout.logprobs_BN)
  new = versions == 1
  assert new.any() and (~new).any()
  uniform = -np.log(tiny_cfg.vocab_size)
  np.testing.assert_allclose(logp[new], uniform, rtol=1e-5)
  assert not np.allclose(logp[~new], uniform, rtol=1e-3)  # the older weights' tokens
  for row in versions:  # a row switches once, and never back
    assert (np.diff(row) >= 0).all()
  # The first token after the switch point was drawn from logits the old weights computed.
  switched = [r for r in range(len(versions)) if 0 < (versions[r] == 0).sum() < BUDGET]
  assert switched
  for r in switched:
    assert not np.isclose(logp[r, (versions[r] == 0).sum() - 1], uniform, rtol=1e-3)


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_free_schedule_bounds_the_lag_and_drops_nothing(model, staleness):
  batches, _, _ = _train(_partial(model, "free", staleness), model[1], seed=staleness)
  assert [b.index for b in batches] == list(range(N_BATCHES))
  for step, b in enumerate(batches):  # taken at policy version `step`
    assert 0 <= step - b.versions_BN.min() <= staleness and b.version == b.versions_BN.min()


def test_whole_batches_fixed_schedule_and_a_trainer_taking_several_per_step(tiny_cfg):
  def gen(params, prompts, key):
    time.sleep(random.uniform(0, 0.01))
    return {"tokens": prompts["prompt_tokens"]}

  seen = []
  with RolloutWorker(gen, Batches(), {"w": jnp.ones(2)}, max_staleness=2,
                     schedule="fixed") as worker:
    for version, batch in enumerate(worker, 1):
      seen.append(batch.version)
      time.sleep(random.uniform(0, 0.02))
      worker.update_weights({"w": jnp.ones(2)}, version)
  assert seen == [max(0, i - 2) for i in range(N_BATCHES)]
  # DAPO-like: two batches per update with max_staleness=0 (each step's second batch is asked
  # for before the push); nothing waits forever and every batch is on-policy.
  done = threading.Event()
  with RolloutWorker(gen, Batches(), {"w": jnp.ones(2)}, max_staleness=0) as worker:
    versions, version = [], 0

    def consume():
      nonlocal version
      for _ in range(N_BATCHES // 2):
        versions.extend([worker.get(timeout=30).version, worker.get(timeout=30).version])
        version += 1
        worker.update_weights({"w": jnp.ones(2)}, version)
      done.set()

    threading.Thread(target=consume, daemon=True).start()
    assert done.wait(60)
  assert versions == [v // 2 for v in range(len(versions))]


def test_whole_batches_resume_their_queue_and_the_older_weights(model):
  """A RolloutWorker paused with batches queued, on the fixed schedule (its weights one version
  behind the trainer's), put back into a new worker: the same batches as never stopping."""
  sampler, params = model
  generate = lambda p, prompts, key: jax.block_until_ready(sampler.generate(
      p, prompts["prompt_tokens"], prompts["prompt_valid"], key))
  worker = lambda version=0, **kw: RolloutWorker(generate, Batches(), _weights(params, version),
                                                 version=version, max_staleness=2,
                                                 schedule="fixed", **kw)
  full = _train(worker(), params)[0]
  first, state, version = _train(worker(), params, stop_after=3)
  assert state.meta["queue"] and state.meta["installed_params"]  # batches ahead, older weights
  assert state.meta["installed"] < version
  rest = _train(worker(version, state=state, start_index=version), params)[0]
  for x, y in zip(first + rest, full):
    assert (x.index, x.version) == (y.index, y.version)
    for field in ("tokens_BT", "logprobs_BN"):
      np.testing.assert_array_equal(getattr(x.rollout, field), getattr(y.rollout, field))
  assert len(first + rest) == len(full) == N_BATCHES
