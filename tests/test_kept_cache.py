"""The KV cache kept across turns (sampler/requests.py): a turn continued in the slot that kept
its conversation computes what a fresh prefill of the whole conversation computes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.decoding import LMDecoding
from jaxrl.models.transformer import LanguageModel
from sampler.methods import SamplingConfig
from sampler.requests import Request
from sampler.sampler import Sampler
from sharding.reshard import to_device
from train.updates.forward import completion_logprobs

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64)  # float32


@pytest.fixture(scope="module")
def model():
  graphdef, params = nnx.split(LanguageModel(CFG, rngs=nnx.Rngs(0)))
  sampler = Sampler(graphdef, SamplingConfig(max_new_tokens=24, eos_id=1, pad_id=0,
                                             method="temperature", temperature=1.0),
                    inflight_slots=4)
  return graphdef, params, sampler


def _run_until(engine, tag):
  """Advances until request `tag` comes back; (its ids, its log-probs)."""
  for _ in range(100):
    for t, ids, logp, _ in engine.poll():
      if t == tag:
        return ids, logp
    engine.advance()
  raise AssertionError(f"{tag} never finished")


def _slot(engine, tag):
  return next(s for s, r in enumerate(engine._serving) if r is not None and r.tag == tag)


def test_a_continued_turn_sees_exactly_a_fresh_prefill_of_the_conversation(model):
  graphdef, params, sampler = model
  key = np.asarray(jax.random.key_data(jax.random.key(1)), np.uint32)
  engine = sampler.requests(params, context_width=16)
  fresh = LMDecoding.of(nnx.merge(graphdef, params))
  prompt = (5, 6, 7, 8, 9, 10, 11)
  engine.submit(Request("a", prompt, 6, key, 0))
  first, _ = _run_until(engine, "a")
  # Other rows decode meanwhile, for more than two rings' worth of steps: the global step
  # wraps the ring, and the kept slot must keep its keys all the while.
  fillers = 0
  while int(engine.g) <= 2 * engine.ring:  # three at a time: none waits for a slot
    for r in range(fillers, fillers + 3):
      engine.submit(Request(r, tuple(range(2, 14)), 24, key, 10 + r))
    while engine.busy:
      for tag, *_ in engine.poll():
        engine.release(tag)  # its conversation ended (else its slot would be kept)
      engine.advance()
    fillers += 3
  context = prompt + tuple(first)
  # the environment's reply, then a turn continued with an empty reply
  for turn_index, reply in enumerate(((20, 21, 22), ())):
    context += reply
    engine.submit(Request("a", context, 5, key, 1 + turn_index))
    engine._segment = to_device(np.int32(0))  # prefill the continuation, decode nothing
    engine.advance()
    engine._segment = to_device(np.int32(8))
    slot = _slot(engine, "a")
    want_V, _, _ = fresh.prefill(jnp.asarray([context]), jnp.ones((1, len(context)), bool))
    np.testing.assert_allclose(np.asarray(engine.state.logits_RV[slot]), np.asarray(want_V[0]),
                               atol=1e-5, rtol=0)
    assert int(engine.state.key_valid_RS[slot, :-1].sum()) == len(context)
    turn, logp = _run_until(engine, "a")
    # every token of the turn, teacher-forced after the whole conversation, has the log-prob
    # the continued slot sampled it with
    tokens = jnp.asarray([context + tuple(turn)])
    want, _ = completion_logprobs(graphdef, params, tokens, jnp.ones(tokens.shape, bool),
                                  len(context))
    np.testing.assert_allclose(logp, np.asarray(want[0]), atol=1e-5, rtol=0)
    context += tuple(turn)
  assert engine.stats["continued"] == 2 and engine.stats["admitted"] == 1 + fillers


def test_kept_slots_are_evicted_oldest_first_when_a_request_finds_none_free(model):
  _, params, sampler = model
  key = np.asarray(jax.random.key_data(jax.random.key(2)), np.uint32)
  engine = sampler.requests(params, context_width=16)
  outs = {}
  for tag in range(4):  # every slot ends up keeping a conversation
    engine.submit(Request(tag, (3, 4, 5 + tag), 4, key, tag))
  while engine.busy:
    outs.update({t: ids for t, ids, *_ in engine.poll()})
    engine.advance()
  assert len(engine._kept) == 4
  engine.submit(Request("new", (7, 8), 4, key, 9))  # evicts conversation 0's cache
  engine.advance()
  assert list(engine._kept) == [1, 2, 3]
  engine.submit(Request(0, (3, 4, 5) + tuple(outs[0]) + (9,), 4, key, 0))  # prefilled whole
  engine.submit(Request(1, (3, 4, 6) + tuple(outs[1]) + (9,), 4, key, 1))  # continued
  engine.advance()
  assert engine.stats["continued"] == 1 and engine.stats["admitted"] == 6
  # conversation 0's whole prefill found no free slot either: the oldest kept one went
  assert engine.stats["evicted"] == 2 and list(engine._kept) == [3]
  engine.release(3)
  assert not engine._kept
