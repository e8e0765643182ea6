"""The procedural GSM8K-format data set and the tiny BPE tokenizer with its ChatML template."""
import re

import numpy as np
import pytest

from jaxrl.data import gsm8k_synth as gs
from jaxrl.data import tiny_tokenizer as tt

# One calculation as rendered in a solution: `12+7 = <<12+7=19>>19`, or `12+7 = 19` unannotated.
CALC = re.compile(r"([\d,]+)([-+*])([\d,]+) = (?:<<(\d+)([-+*])(\d+)=(\d+)>>)?(\d+)")
OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


def _num(s: str) -> int:
  return int(s.replace(",", ""))


def _check_row(row: dict[str, str], annotate: bool) -> int:
  """Re-does the arithmetic; returns the number of calculation steps."""
  question_numbers = [_num(s) for s in re.findall(r"\d[\d,]*", row["question"])]
  calcs = CALC.findall(row["answer"])
  assert calcs, row
  results, used = [], []
  for x, op, y, ax, aop, ay, az, z in calcs:
    x, y, z = _num(x), _num(y), int(z)
    assert z == OPS[op](x, y) >= 0, row
    if annotate:
      assert (int(ax), aop, int(ay), int(az)) == (x, op, y, z), row
    else:
      assert ax == "" and "<<" not in row["answer"], row
    for operand in (x, y):
      # Each operand comes from the question or from an earlier step, never from nowhere.
      assert operand in question_numbers or operand in results, row
    used += [x, y]
    results.append(z)
  assert sorted(set(question_numbers)) == sorted(set(question_numbers) & set(used)), row
  assert row["answer"].endswith(f"\n#### {results[-1]}"), row
  assert gs.final_answer(row["answer"]) == str(results[-1])
  return len(calcs)


def test_generate_is_deterministic_and_prefix_stable():
  rows = gs.generate(300, seed=7)
  assert rows == gs.generate(300, seed=7)
  assert rows[:50] == gs.generate(50, seed=7)
  assert rows != gs.generate(300, seed=8)
  assert all(set(r) == {"question", "answer"} for r in rows)


def test_questions_unique_and_split_disjoint():
  rows = gs.generate(1000, seed=0)
  assert len({r["question"] for r in rows}) == 1000
  train, heldout = gs.split(rows, 200, seed=0)
  assert (len(train), len(heldout)) == (800, 200)
  assert not {r["question"] for r in train} & {r["question"] for r in heldout}
  assert (train, heldout) == gs.split(rows, 200, seed=0)
  # Duplicated rows must not leak a held-out question into train.
  train, heldout = gs.split(rows + rows[:100], 500, seed=1)
  assert not {r["question"] for r in train} & {r["question"] for r in heldout}


@pytest.mark.parametrize("difficulty", sorted(gs.DIFFICULTIES))
@pytest.mark.parametrize("annotate", [True, False])
def test_answers_redo_the_arithmetic(difficulty, annotate):
  rows = gs.generate(1000, seed=1, difficulty=difficulty, annotate=annotate)
  steps = np.array([_check_row(r, annotate) for r in rows])
  assert set(steps) <= {1, 2}
  # The two_step knob sets the mix (binomial sd at n=1000 is under 0.016).
  assert abs(np.mean(steps == 2) - gs.DIFFICULTIES[difficulty].two_step) < 0.06
  if gs.DIFFICULTIES[difficulty].big_numbers:
    assert any("," in r["question"] for r in rows)


def test_difficulty_rejects_bad_fields():
  with pytest.raises(ValueError, match="max_operand"):
    gs.Difficulty(max_operand=1)
  with pytest.raises(ValueError, match="two_step"):
    gs.Difficulty(two_step=1.5)
  with pytest.raises(ValueError, match="expected one of"):
    gs.generate(3, seed=0, difficulty="medum")


def test_cli_writes_train_and_test(tmp_path):
  gs.main(["--out", str(tmp_path), "--n_train", "50", "--n_heldout", "10", "--seed", "3"])
  train, test = gs.split(gs.generate(60, seed=3), 10, seed=3)
  assert gs.read_jsonl(tmp_path / "train.jsonl") == train
  assert gs.read_jsonl(tmp_path / "test.jsonl") == test
  assert sorted(p.name for p in tmp_path.iterdir()) == ["test.jsonl", "train.jsonl"]


def _texts(rows):
  return [t for r in rows for t in (r["question"], r["answer"])]


def _chat(row):
  return [{"role": "user", "content": row["question"]},
          {"role": "assistant", "content": row["answer"]}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  out = tmp_path_factory.mktemp("tok")
  tt.train_bpe(_texts(gs.generate(2000, seed=0)), 512, out)
  return out


def test_tokenizer_is_deterministic(tok_dir, tmp_path):
  tt.train_bpe(_texts(gs.generate(2000, seed=0)), 512, tmp_path)
  for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    assert (tmp_path / name).read_bytes() == (tok_dir / name).read_bytes(), name


def test_tokenizer_round_trips_and_splits_digits(tok_dir):
  from tokenizers import Tokenizer
  tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
  assert tok.get_vocab_size() == 512
  assert [tok.token_to_id(t) for t in tt.SPECIAL_TOKENS] == [0, 1, 2]
  for row in gs.generate(200, seed=5, difficulty="hard"):
    text = tt.chat_format(_chat(row))
    enc = tok.encode(text)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert all(len(t) == 1 for t in enc.tokens if any(c.isdigit() for c in t)), enc.tokens


def test_transformers_loads_it_and_renders_chatml(tok_dir):
  from transformers import AutoTokenizer
  tok = AutoTokenizer.from_pretrained(str(tok_dir))
  assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
  ids = (tok.pad_token_id, tok.convert_tokens_to_ids("<|im_start|>"), tok.eos_token_id)
  assert ids == (0, 1, 2)
  msgs = [{"role": "user", "content": "Tom has 3 apples."}]
  got = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
  assert got == "<|im_start|>user\nTom has 3 apples.<|im_end|>\n<|im_start|>assistant\n"
  row = gs.generate(1, seed=0)[0]
  assert tok.apply_chat_template(_chat(row), tokenize=False) == tt.chat_format(_chat(row))
  ids = tok(tt.chat_format(_chat(row)), add_special_tokens=False)["input_ids"]
  assert ids[0] == 1 and ids[-2] == tok.eos_token_id  # no BOS is prepended
  assert tok.decode(ids) == tt.chat_format(_chat(row))


def test_default_system_prompt_only_when_given(tmp_path):
  from transformers import AutoTokenizer
  system = 'Answer after "####".\nBe brief.'
  tt.train_bpe(_texts(gs.generate(100, seed=0)), 300, tmp_path, system_prompt=system)
  tok = AutoTokenizer.from_pretrained(str(tmp_path))
  user = [{"role": "user", "content": "Hi"}]
  for msgs in (user, [{"role": "system", "content": "Other."}] + user):
    got = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert got == tt.chat_format(msgs, add_generation_prompt=True, system_prompt=system)
  assert tok.apply_chat_template(user, tokenize=False).startswith(
      f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nHi")


def test_chat_token_lengths_fit_96(tok_dir):
  from tokenizers import Tokenizer
  tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
  rows = gs.generate(2000, seed=11)  # unseen by the tokenizer's training
  lengths = np.array([len(tok.encode(tt.chat_format(_chat(r))).ids) for r in rows])
  print(f"chat tokens, medium: min {lengths.min()} median {np.median(lengths):.0f} "
        f"p90 {np.percentile(lengths, 90):.0f} max {lengths.max()}")
  assert lengths.max() < 96


def test_teacher_demos_slip_on_two_step_problems_only():
  rows = gs.generate(400, seed=5)
  demos = gs.with_teacher_demos(rows, 1.0, seed=0)
  assert [{k: r[k] for k in ("question", "answer")} for r in demos] == rows  # references intact
  slipped = [(r, d) for r, d in zip(rows, demos) if d["demo"] != r["answer"]]
  assert slipped
  for row, demo in slipped:
    first = re.search(r"<<[^=>]+=(\d+)>>\1", row["answer"])
    assert demo["demo"] == row["answer"][:first.end()] + f".\n#### {first.group(1)}"
    assert gs.final_answer(demo["demo"]) != gs.final_answer(row["answer"])
  one_step = [r for r in rows if r["answer"].count("<<") == 1]
  assert one_step and all(gs.teacher_slip(r["answer"]) is None for r in one_step)
  assert all(d["demo"] == r["answer"] for r, d in zip(rows, gs.with_teacher_demos(rows, 0.0, 0)))


def test_tool_calls_in_each_tool_form():
  answer = "Tom earns 56*35 = <<56*35=1960>>1960 dollars.\n#### 1960"
  assert gs.tool_calls(answer) == (
      "Tom earns 56*35 = <calc>56*35</calc> <result>1960</result> dollars.\n#### 1960")
  assert gs.tool_calls(answer, "python") == (
      "Tom earns 56*35 = <python>print(56*35)</python> <output>1960\n</output> dollars.\n#### 1960")


def test_the_assets_are_the_same_whoever_makes_them(tmp_path):
  """`gsm8k_tiny.ensure` from this process (the tests' XLA_FLAGS: a lower optimisation level)
  makes the assets a process at XLA's defaults makes, byte for byte: a run's held-out
  accuracy does not depend on which process made them first."""
  import os
  import subprocess
  import sys

  from jaxrl.data.gsm8k_tiny import ensure
  assert "--xla_backend_optimization_level=0" in os.environ["XLA_FLAGS"]  # (tests/conftest.py)
  here = ensure(str(tmp_path / "here"))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  subprocess.run([sys.executable, "-c", "from jaxrl.data.gsm8k_tiny import ensure; "
                  f"ensure({str(tmp_path / 'default')!r})"], env=env, check=True, timeout=300)
  for name in ("model/model.safetensors", "train.jsonl", "test.jsonl"):
    with open(os.path.join(here, name), "rb") as a, \
        open(tmp_path / "default" / name, "rb") as b:
      assert a.read() == b.read(), name
