"""Preference pairs: synthetic from the verifier, jsonl round trip, checked input, batch layout."""
import json

import numpy as np
import pytest

from jaxrl.data.pipeline import Encoding
from jaxrl.data.files import DataError
from jaxrl.data.preferences import Pair, pair_batch, pair_lengths, synthetic_pairs, write_jsonl
from jaxrl.data.sources import DataOptions, load_pairs
from jaxrl.data.tasks import make_splits
from jaxrl.data.tokenizer import ByteTokenizer
from jaxrl.rewards.verifier import exact_match


@pytest.mark.parametrize("task", ["reverse", "addition", "sort_digits"])
def test_synthetic_pairs_are_verified(task):
  train, _ = make_splits(task, 3, 200, 10, seed=0, teacher_error=0.5)
  pairs = synthetic_pairs(train, exact_match, per_prompt=2, seed=0)
  assert len(pairs) > 300
  for p in pairs:
    assert exact_match(p.chosen, p.chosen) and exact_match(p.chosen, next(
        e.answer for e in train if e.prompt == p.prompt))
    assert not exact_match(p.rejected, p.chosen)
  # The teacher's systematic mistake is among the rejected answers wherever it exists.
  mistakes = {e.prompt: e.mistake for e in train if e.mistake}
  rejected = {}
  for p in pairs:
    rejected.setdefault(p.prompt, set()).add(p.rejected)
  assert all(m in rejected[q] for q, m in mistakes.items())


def test_jsonl_round_trip(tmp_path):
  pairs = [Pair("rev ab=", "ba", "ab"), Pair("1+1=", "2", "3")]
  path = str(tmp_path / "p.jsonl")
  write_jsonl(pairs, path)
  assert load_pairs(path, ByteTokenizer(), DataOptions(on_bad_row="error")) == (pairs, {})


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "a", "chosen": "b"}', ":2: field 'rejected': missing"),
    ('{"prompt": "a", "chosen": 3, "rejected": "c"}', ":2: field 'chosen': not a string (got int)"),
    ('{"prompt": "a", "chosen": "b", "rejected": " "}', ":2: field 'rejected': empty"),
    ('{"prompt": "a", "chosen": "b", "rejected": "b"}', ":2: 'chosen' and 'rejected' are identical"),
    ('[1, 2]', ":2: not a JSON object"),
    ('{"prompt": "a",', ":2: not valid JSON"),
])
def test_bad_rows_are_named(tmp_path, line, message):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps({"prompt": "x", "chosen": "y", "rejected": "z"}) + "\n" + line + "\n")
  with pytest.raises(DataError) as e:
    load_pairs(str(path), ByteTokenizer(), DataOptions(on_bad_row="error"))
  assert str(path) + message in str(e.value) and "\n" not in str(e.value)


def test_pair_batch_layout():
  tok = ByteTokenizer()
  pairs = [Pair("rev abc=", "cba", "bca"), Pair("rev ab=", "ba", "abx")]
  p_len, r_len = pair_lengths(pairs, Encoding(tok))
  assert (p_len, r_len) == (9, 4)
  b = pair_batch(pairs, Encoding(tok), p_len, r_len)
  assert b["tokens"].shape == (4, 13) and b["completion_mask"].shape == (4, 4)
  # Rows: chosen of each pair, then rejected; prompts left-padded, responses right-padded + EOS.
  assert tok.decode(b["tokens"][0, p_len:]) == "cba" and tok.decode(b["tokens"][3, p_len:]) == "abx"
  assert tok.decode(b["tokens"][1, :p_len][b["valid"][1, :p_len]][1:]) == "rev ab="
  np.testing.assert_array_equal(b["completion_mask"].sum(1), [4, 3, 4, 4])
  np.testing.assert_array_equal(b["valid"][:, p_len:], b["completion_mask"])
