"""Stop strings matched on decoded text (sampler/stops.py): a byte-level BPE merges a tool's
closing tag with what comes before (`)</`), so the tag's own ids never appear; the row still
ends at the token that completes the string, in the static engine, in in-flight slots and in a
conversation continued in its kept cache."""
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.data import tiny_tokenizer
from jaxrl.data.tasks import Example
from jaxrl.data.tokenizer import load_tokenizer
from jaxrl.envs import Step
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import LanguageModel
from sampler.methods import SamplingConfig
from sampler.sampler import Sampler
from sampler.stops import StopText, _automaton
from train.rollout.multiturn import MultiTurn

TEXTS = [f"print({i} * 7)</python> then {{\"k\": {word}}}</tool> ok, the {word} is here"
         for i in range(40) for word in ("answer", "tool", "result", "value", "python")]


def test_the_automaton_finds_every_string_in_any_tokenization():
  """Against Python's substring search: random strings over a small alphabet, split into
  random tokens, each token's state taken from the token table."""
  rng = random.Random(0)
  for _ in range(40):
    patterns = [bytes(rng.choice(b"ab</>") for _ in range(rng.randint(1, 4)))
                for _ in range(rng.randint(1, 3))]
    tokens = sorted({bytes(rng.choice(b"ab</>x") for _ in range(rng.randint(0, 3)))
                     for _ in range(30)})
    stop = StopText([p.decode() for p in patterns], tokens)
    for _ in range(20):
      ids = [rng.randrange(len(tokens)) for _ in range(rng.randint(0, 8))]
      state, hits = jnp.zeros((1,), jnp.int32), []
      for i in ids:
        state = stop.advance(state, jnp.asarray([i]))
        hits.append(int(state[0]) == stop.matched)
      text = b"".join(tokens[i] for i in ids)
      want = [any(p in b"".join(tokens[i] for i in ids[:n + 1]) for p in patterns)
              for n in range(len(ids))]
      assert hits == want, (patterns, text)
  assert _automaton([b"ab"]).shape == (4, 256)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  directory = tmp_path_factory.mktemp("bpe")
  tiny_tokenizer.train_bpe(TEXTS, 400, directory)
  return load_tokenizer(str(directory))


def test_token_bytes_join_to_the_decoded_text(bpe):
  pieces = bpe.token_bytes()
  for text in ["print(3 * 7)</python>", '{"k": 5}</tool> ok', "héllo 🙂 wörld\n\tx"]:
    ids = bpe.encode(text)
    assert b"".join(pieces[i] for i in ids).decode() == bpe.decode(ids) == text
  ids = bpe.encode("print(3 * 7)</python>")  # the merge the issue met: `)</`, no `</python>`
  tag = bpe.encode("</python>")
  assert not any(ids[i:i + len(tag)] == tag for i in range(len(ids)))


def _first_end(pieces, ids, strings) -> int | None:
  """How many of `ids` it takes for their text to hold one of `strings` (None: never)."""
  return next((n + 1 for n in range(len(ids)) if any(
      s.encode() in b"".join(pieces[i] for i in ids[:n + 1]) for s in strings)), None)


def _merged_string(pieces, row) -> str:
  """A string of `row`'s text starting inside one of its tokens and ending in a later one."""
  for j in range(1, len(row) - 2):
    for k in range(1, len(pieces[row[j]])):
      for m in (j + 1, j + 2, j + 3):
        try:
          text = (pieces[row[j]][k:] + b"".join(pieces[i] for i in row[j + 1:m])).decode()
        except UnicodeDecodeError:
          continue
        if len(text) > 1 and pieces[row[m - 1]]:
          return text
  raise AssertionError(f"no merged token in {row}")


class Echo:
  """Two model turns, each answered with the same observation."""
  stop_strings = ()  # (the sampler's are the test's)
  turns: list = []

  def __init__(self, tok):
    self.tok = tok

  def reset(self, example):
    Echo.turns.append([])
    self.mine = Echo.turns[-1]
    return []

  def step(self, turn_ids):
    self.mine.append(list(turn_ids))
    return Step(self.tok.encode(" ok"), 0.0, len(self.mine) >= 2)


def _converse(sampler, params, prompts, tok):
  Echo.turns = []
  with MultiTurn() as multiturn:
    multiturn.converse(sampler, params, prompts, [Example("x", "1")] * len(prompts),
                       [Echo(tok) for _ in prompts], jax.random.key(2), max_new_tokens=24,
                       max_turns=2, keep_cache=True)
  return Echo.turns


def test_a_stop_string_inside_merged_tokens_ends_the_row_in_every_engine(bpe):
  """The static engine, in-flight slots and a conversation in its kept cache, each run free
  and then with stop strings taken from the free runs (each starting inside a merged token):
  a row ends at the token where its text first holds one, its ids the free run's up to there,
  and each of a conversation's turns likewise."""
  pieces = bpe.token_bytes()  # (the model's padded vocabulary's last ids: no text)
  pieces = pieces + [b""] * (400 - len(pieces))
  cfg = ModelConfig(vocab_size=400, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16,
                    d_ff=64)
  graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(1)))
  prompts = [bpe.encode("print(5 * 7)"), bpe.encode('{"k": 3}')]
  tokens, valid = bpe.pad_left(prompts, 8)
  args = (params, jnp.asarray(tokens), jnp.asarray(valid), jax.random.key(0))
  base = SamplingConfig(max_new_tokens=16, eos_id=-1, pad_id=bpe.pad_id, temperature=1.0)
  static, inflight = Sampler(graphdef, base), Sampler(graphdef, base, inflight_slots=2)
  free = {"static": np.asarray(static.generate(*args).tokens_BT[:, 8:]).tolist(),
          "inflight": np.asarray(inflight.generate(*args).tokens_BT[:, 8:]).tolist()}
  talks = _converse(Sampler(graphdef, base), params, prompts, bpe)
  strings = [_merged_string(pieces, rows[0]) for rows in (*free.values(), [talks[0][0]])]
  stop = StopText(strings, bpe.token_bytes())
  for name, sampler in (("static", static), ("inflight", inflight)):
    out = sampler.variant(stop_text=stop).generate(*args)
    for r, row in enumerate(free[name]):
      end = _first_end(pieces, row, strings) or 16
      assert int(out.lengths_B[r]) == end, (name, r)
      np.testing.assert_array_equal(np.asarray(out.tokens_BT)[r, 8:8 + end], row[:end])
  # the static row's text holds its string, but not the string's own ids
  row, tag = free["static"][0], bpe.encode(strings[0])
  row = row[:_first_end(pieces, row, strings)]
  assert not any(row[i:i + len(tag)] == tag for i in range(len(row)))
  stopped = _converse(Sampler(graphdef, base).variant(stop_text=stop), params, prompts, bpe)
  first = talks[0][0]
  assert stopped[0][0] == first[:_first_end(pieces, first, strings)]
  for turns in stopped:
    for turn in turns:
      assert _first_end(pieces, turn, strings) in (len(turn), None)


def test_token_bytes_of_a_sentencepiece_style_tokenizer(tmp_path):
  """Gemma's and Llama 2's form: "▁" for a space, `<0xAB>` byte fallback pieces."""
  import json
  from tokenizers import Tokenizer, decoders, models, normalizers
  vocab = {"<eos>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
  for piece in ("▁", "t", "h", "e", "▁t", "he", "▁the", "<", "/", ">", "</", "p", "y"):
    vocab[piece] = len(vocab)
  tok = Tokenizer(models.BPE(vocab, [("▁", "t"), ("h", "e"), ("▁t", "he"), ("<", "/")],
                             byte_fallback=True))
  tok.normalizer = normalizers.Replace(" ", "▁")
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse()])
  tok.add_special_tokens(["<eos>"])
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
  ours = load_tokenizer(str(tmp_path))
  pieces = ours.token_bytes()
  for text in (" the</py> héllo 🙂", "the<eos>"):
    ids = ours.encode(text)
    assert b"".join(pieces[i] for i in ids).decode() == ours.decode(ids)
  assert pieces[vocab["<0xC3>"]] == b"\xc3" and pieces[vocab["▁the"]] == b" the"
