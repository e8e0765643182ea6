"""Multi-turn partial rollouts (train/rollout/conversations.py driven by
train/rollout/partial.py): conversations whose turns outlive weight swaps, with every token's
policy version, the fixed schedule a function of the seed, and a stream paused with
conversations in flight put back bit for bit (its environments replayed)."""
import dataclasses
import inspect

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.data.tasks import Example
from jaxrl.data.tokenizer import ByteTokenizer
from jaxrl.envs import Step
from jaxrl.models.transformer import LanguageModel
from sampler.methods import SamplingConfig
from sampler.sampler import Sampler
from sampler.stream import BatchStream, StreamGeometry
from test_partial import TINY, _same, _train, _weights
from train.rollout.conversations import ConversationStream, NotReplayable
from train.rollout.multiturn import MultiTurn, Turns, as_rollout
from train.rollout.partial import PartialRolloutWorker

TOK = ByteTokenizer()
N_BATCHES, PROMPTS, N, BUDGET = 6, 2, 2, 24
TURNS = Turns(BUDGET, max_turns=3, max_turn_tokens=6)


class Echo:
  """Answers a turn with its first two ids and a fixed id; done after 3 turns (a function of
  the turns, so a restored stream can replay it)."""

  def __init__(self, tok=None, verifier=None):
    self.stop_strings, self.turns = (), 0

  def reset(self, example):
    self.turns = 0
    return [int(example.answer)]

  def step(self, turn_ids):
    self.turns += 1
    return Step(list(turn_ids[:2]) + [7], float(len(turn_ids)), self.turns >= 3)


class Batches:
  def __getitem__(self, i):
    if i >= N_BATCHES:
      raise IndexError(i)
    ids = [TOK.encode(f"{i}*{j}", bos=True) for j in range(PROMPTS)]
    tokens, valid = TOK.pad_left(ids, 8)
    return {"prompt_tokens": tokens, "prompt_valid": valid,
            "examples": [Example(f"{i}*{j}", str(40 + j)) for j in range(PROMPTS)]}


def _finish(talks, prompts):
  rows = np.repeat(np.arange(PROMPTS), N)
  return as_rollout(talks, prompts["prompt_tokens"][rows], prompts["prompt_valid"][rows],
                    budget=BUDGET, pad_id=TOK.pad_id)


@pytest.fixture(scope="module")
def model():
  graphdef, params = nnx.split(LanguageModel(TINY, rngs=nnx.Rngs(0)))
  # One token in five ends a turn: turns of uneven lengths, some continuing across segments
  cfg = SamplingConfig(max_new_tokens=BUDGET, eos_id=-1, pad_id=TOK.pad_id,
                       stop_sequences=tuple((t,) for t in range(0, TINY.vocab_size, 5)))
  return Sampler(graphdef, cfg, n=1, inflight_slots=6), params


def _geometry(live, conversations=True):
  return StreamGeometry(slots=6, rows=PROMPTS * N, live=live, prompt_width=8,
                        max_new_tokens=BUDGET, conversations=conversations)


@pytest.fixture(scope="module")
def multiturn():
  with MultiTurn() as m:
    yield m


def _stream(sampler, params, live, multiturn):
  return ConversationStream(sampler, params, _geometry(live), n=N, environment=Echo,
                            turns=TURNS, keep_cache=True, finish=_finish, multiturn=multiturn)


def _worker(model, multiturn, version=0, state=None, start=0):
  sampler, params = model
  return PartialRolloutWorker(_stream(sampler, params, 2, multiturn), Batches(),
                              _weights(params, version), version=version, max_staleness=1,
                              schedule="fixed", state=state, start_index=start)


def test_a_streamed_batch_is_the_whole_batch_conversation_with_the_same_weights(model,
                                                                                  multiturn):
  sampler, params = model
  stream = _stream(sampler, params, 1, multiturn)
  stream.open(Batches()[0], jax.random.key_data(jax.random.key(5)))
  out = []
  while not out:
    out = stream.poll()
    stream.decode()
  (batch, rollout), = out
  prompts = Batches()[0]
  rows = np.repeat(np.arange(PROMPTS), N)
  talks = multiturn.converse(sampler, params, [TOK.encode(f"0*{j}", bos=True) for j in rows],
                             [prompts["examples"][j] for j in rows], [Echo() for _ in rows],
                             jax.random.key(5), max_new_tokens=BUDGET, max_turns=3,
                             max_turn_tokens=6)
  assert [t.ids for t in batch.talks] == [t.ids for t in talks]
  assert max(len(t.turns) for t in talks) == 3  # (several turns, cut by the budget or not)
  np.testing.assert_allclose(rollout.logprobs_BN, _finish(talks, prompts).logprobs_BN, atol=1e-6)
  assert (batch.versions_BN(BUDGET) == 0).all()


def test_both_streams_are_batch_streams_laid_out_as_their_geometry(model, multiturn):
  """Stream (rows) and ConversationStream (conversations) implement the one protocol the
  partial-rollout worker drives; their buffers are their geometry's, and their snapshots
  record it as checkpoints always have (what a resume compares)."""
  sampler, params = model
  rows = sampler.stream(params, _geometry(2, conversations=False))
  talks = _stream(sampler, params, 2, multiturn)
  for stream in (rows, talks):
    assert isinstance(stream, BatchStream)
    for name, member in vars(BatchStream).items():
      if inspect.isfunction(member) and not name.startswith("_"):
        assert (list(inspect.signature(getattr(type(stream), name)).parameters)
                == list(inspect.signature(member).parameters)), (type(stream), name)
      elif isinstance(member, property):
        assert isinstance(getattr(type(stream), name), property), (type(stream), name)
  ring = 8 + BUDGET - 1  # a prompt and its new tokens but the last
  assert rows.state.key_valid_RS.shape == (6, ring + 1)  # (and the scratch slot)
  assert (talks.engine.slots, talks.engine.ring) == (6, ring)
  shape = {"slots": 6, "rows": PROMPTS * N, "live": 2, "ring": ring}
  assert rows.snapshot()[1]["shape"] == shape
  assert talks.snapshot()[1]["shape"] == {"kind": "conversations", **shape}
  with pytest.raises(ValueError, match="does not fit"):  # a conversations' layout for rows
    sampler.stream(params, _geometry(2))
  with pytest.raises(ValueError, match="does not fit"):  # more slots than the sampler's
    ConversationStream(sampler, params, dataclasses.replace(_geometry(2), slots=8), n=N,
                       environment=Echo, turns=TURNS, keep_cache=True, finish=_finish,
                       multiturn=multiturn)


def test_fixed_schedule_is_a_function_of_the_seed_and_resumes_with_conversations_in_flight(
    model, multiturn):
  runs = [_train(_worker(model, multiturn), model[1], seed=s)[0] for s in (0, 1)]
  _same(*runs)
  batches = runs[0]
  assert [b.version for b in batches] == [max(0, i - 1) for i in range(N_BATCHES)]
  # Turns in flight took the next version as the following batch opened
  mixed = [b for b in batches if len(np.unique(b.versions_BN[b.rollout.loss_mask_BN])) == 2]
  assert mixed
  for b in batches:  # an environment's ids carry the version of the turn before them
    v, own = b.versions_BN, b.rollout.loss_mask_BN
    for r in range(len(v)):
      replies = np.flatnonzero(~own[r] & b.rollout.completion_mask_BN[r])
      replies = replies[replies > 0]
      assert (v[r, replies] == v[r, replies - 1]).all()
  talking = lambda state: any(t["turns"] and not ended  # noqa: E731
                              for b in state.meta["stream"]["batches"]
                              for t, ended in zip(b["talks"], b["ended"]))
  first, state, version = _train(_worker(model, multiturn), model[1], stop_after=3,
                                 until=talking)
  assert talking(state), "no conversation in flight at a pause"
  resumed = _worker(model, multiturn, version=version, state=state, start=version)
  _same(first + _train(resumed, model[1])[0], batches)
  # An environment that replies otherwise on replay cannot continue its conversations
  meta = state.meta["stream"]
  talk = next(t for b in meta["batches"] for t in b["talks"] if t["turns"])
  talk["ids"][talk["turns"][0][1]] += 1  # the first reply's first id
  with pytest.raises(NotReplayable, match="replied otherwise"):
    _stream(*model, 2, multiturn).restore(state.arrays["stream"], meta, Batches().__getitem__,
                                          lambda i: jax.random.key_data(jax.random.key(i)))
  # ... and a worker given it generates their batches again, with the weights it has (those
  # of the oldest open batch are gone): nothing waits for them
  again, rest = _worker(model, multiturn, version=version, state=state, start=version), []
  while len(first) + len(rest) < N_BATCHES:
    rest.append(again.get(timeout=120))
    again.update_weights(_weights(model[1], version + len(rest)), version + len(rest))
  again.close()
  assert [b.index for b in first + rest] == list(range(N_BATCHES))
