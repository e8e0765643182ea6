import json
import time
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

from jaxrl.data.preferences import Pair
from jaxrl.data.files import DataError
from jaxrl.data.sources import DataOptions, last_boxed, load_examples, load_pairs
from jaxrl.data.tokenizer import ByteTokenizer, HFTokenizer

BYTES = ByteTokenizer()
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GSM8K = [
    {"question": "Natalia sold 48 clips. How many?", "answer": "48 + 24 = 72\n#### 72"},
    {"question": "Big sum?", "answer": "It is large.\n#### 1,234"},
    {"question": "Negative?", "answer": "#### -5"},
]


def _jsonl(path, rows, extra_lines=()):
  path.write_text("\n".join([json.dumps(r) for r in rows] + list(extra_lines)) + "\n")
  return str(path)


def _parquet(path, rows):
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  return str(path)


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
  """A byte-level tokenizer with no merges: one token per byte, plus ChatML specials."""
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
  directory = tmp_path_factory.mktemp("tok")
  tok.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}))
  return HFTokenizer.from_dir(str(directory))


@pytest.mark.parametrize("write", [_jsonl, _parquet])
def test_gsm8k_rows(tmp_path, write):
  path = write(tmp_path / ("d.jsonl" if write is _jsonl else "d.parquet"), GSM8K)
  examples, counts = load_examples(path, BYTES)
  assert counts == {}
  assert [e.answer for e in examples] == ["72", "1234", "-5"]
  assert [e.prompt for e in examples] == [r["question"] for r in GSM8K]
  assert examples[0].demo == GSM8K[0]["answer"]  # SFT target: the worked solution
  assert examples[1].fields == GSM8K[1]


def test_boxed_and_field_mapping(tmp_path):
  rows = [{"problem": "Half?", "solution": r"So $\boxed{1}$ no, \boxed{\frac{1}{2}}.", "level": 2},
          {"problem": "Root?", "solution": r"\boxed{\frac{\sqrt{3}}{2}}", "level": 5}]
  opts = DataOptions(prompt_field="problem", answer_field="solution", answer_format="boxed",
                     prompt_template="Level {level}: {prompt}\nAnswer:")
  examples, _ = load_examples(_jsonl(tmp_path / "m.jsonl", rows), BYTES, opts)
  assert [e.answer for e in examples] == [r"\frac{1}{2}", r"\frac{\sqrt{3}}{2}"]
  assert examples[0].prompt == "Level 2: Half?\nAnswer:"
  assert last_boxed(r"\boxed{a{b}") is None and last_boxed("no box") is None
  assert last_boxed(r"\fbox{7} then \boxed{ {x} }") == "{x}"


def test_plain_answers_and_completion_field(tmp_path):
  rows = [{"q": "2+2", "a": 4, "sol": "2+2 is 4"}, {"q": "name", "a": " Ada ", "sol": "Ada"}]
  opts = DataOptions(prompt_field="q", answer_field="a", answer_format="plain",
                     completion_field="sol")
  examples, _ = load_examples(_jsonl(tmp_path / "p.jsonl", rows), BYTES, opts, sft=True)
  assert [(e.answer, e.demo) for e in examples] == [("4", "2+2 is 4"), ("Ada", "Ada")]


def test_chat_prompts(tmp_path, hf_tok):
  path = _jsonl(tmp_path / "c.jsonl", GSM8K[:1])
  opts = DataOptions(chat=True, system_prompt="Think step by step.")
  [ex], _ = load_examples(path, hf_tok, opts)
  assert ex.prompt == ("<|im_start|>system\nThink step by step.<|im_end|>\n<|im_start|>user\n"
                       f"{GSM8K[0]['question']}<|im_end|>\n<|im_start|>assistant\n")
  conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
  path = _jsonl(tmp_path / "m.jsonl", [{"messages": conversation}])
  opts = DataOptions(messages_field="messages", answer_field="")
  [sft], _ = load_examples(path, hf_tok, opts, sft=True)
  assert sft.prompt == hf_tok.chat(conversation[:1]) and sft.demo == "Hello!" and sft.answer == ""
  with pytest.raises(Exception, match="byte tokenizer has no chat template"):
    load_examples(path, BYTES, opts)


def _bad_rows(tmp_path):
  rows = [GSM8K[0],
          {"question": "", "answer": "#### 1"},
          {"answer": "#### 1"},
          {"question": 7, "answer": "#### 1"},
          {"question": "ok", "answer": "no marker"},
          {"question": "x" * 50, "answer": "#### 1"},
          {"question": "long solution", "answer": "y" * 50 + "#### 1"}]
  return _jsonl(tmp_path / "bad.jsonl", rows, extra_lines=['{"question": ', "[1, 2]"])


def test_bad_rows_are_counted(tmp_path):
  opts = DataOptions(max_prompt_tokens=40, max_completion_tokens=40)
  path = _bad_rows(tmp_path)
  examples, counts = load_examples(path, BYTES, opts, sft=True)
  assert [e.prompt for e in examples] == [GSM8K[0]["question"]]
  # each reason with the first row it skipped (its line in the file), as the log says
  assert counts == {f"field 'question': empty (first {path}:2)": 1,
                    f"field 'question': missing (first {path}:3)": 1,
                    f"field 'question': not a string (first {path}:4 (got int))": 1,
                    f"answer: no '#### ANSWER' (first {path}:5)": 1,
                    f"prompt longer than data.max_prompt_tokens (first {path}:6 (51 > 40))": 1,
                    f"completion longer than rl.rollout.max_new_tokens (first {path}:7 "
                    f"(57 > 40))": 1,
                    f"not valid JSON (first {path}:8 (Expecting value))": 1,
                    f"not a JSON object (first {path}:9 (got list))": 1}
  # Without sft, completions are not limited.
  assert len(load_examples(_bad_rows(tmp_path), BYTES, opts)[0]) == 2


@pytest.mark.parametrize("opts,message", [
    (DataOptions(), r"bad.jsonl:2: field 'question': empty$"),
    (DataOptions(prompt_field="nope"), r"bad.jsonl:1: field 'nope': missing$"),
    (DataOptions(answer_format="boxed"), r"bad.jsonl:1: answer: no \\boxed\{ANSWER\}$"),
])
def test_bad_row_error_is_one_line(tmp_path, opts, message):
  path = _bad_rows(tmp_path)
  with pytest.raises(DataError, match=message) as info:
    load_examples(path, BYTES, DataOptions(**{**vars(opts), "on_bad_row": "error"}))
  assert str(info.value).startswith(path) and "\n" not in str(info.value)


def test_error_messages_for_json_and_limits(tmp_path):
  path = _jsonl(tmp_path / "t.jsonl", [GSM8K[0], {"question": "x" * 50, "answer": "#### 1"}],
                extra_lines=["{oops"])
  opts = DataOptions(on_bad_row="error", max_prompt_tokens=40)
  with pytest.raises(DataError, match=r"t.jsonl:3: not valid JSON \(Expecting property name"):
    load_examples(path, BYTES, opts)
  path = _jsonl(tmp_path / "u.jsonl", [GSM8K[0], {"question": "x" * 50, "answer": "#### 1"}])
  with pytest.raises(DataError, match=r"u.jsonl:2: prompt longer than data.max_prompt_tokens "
                                      r"\(51 > 40\)$"):
    load_examples(path, BYTES, opts)
  with pytest.raises(DataError,
                     match=r"u.jsonl: no usable rows \(2 skipped: field 'nope': missing, "
                           r"first \S+u.jsonl:1\)"):
    load_examples(path, BYTES, DataOptions(prompt_field="nope"))
  with pytest.raises(DataError, match=r"missing.jsonl: no such file"):
    load_examples(str(tmp_path / "missing.jsonl"), BYTES)


def test_option_errors():
  assert DataOptions.of(types.SimpleNamespace(prompt_field="problem", other=1)) == DataOptions(
      prompt_field="problem")
  with pytest.raises(DataError, match=r"data.answer_format: expected one of \['gsm8k', 'boxed', "):
    DataOptions(answer_format="latex")
  with pytest.raises(DataError, match="data.prompt_template: use named fields"):
    DataOptions(prompt_template="Q: {}")
  with pytest.raises(DataError, match="data.prompt_template: Single '}'"):
    DataOptions(prompt_template="Q: }")


def test_json_array_and_parquet_glob(tmp_path):
  (tmp_path / "a.json").write_text(json.dumps(GSM8K))
  assert len(load_examples(str(tmp_path / "a.json"), BYTES)[0]) == 3
  for shard in range(2):
    _parquet(tmp_path / f"train-{shard}.parquet", GSM8K)
  examples, _ = load_examples(str(tmp_path / "train-*.parquet"), BYTES)
  assert [e.answer for e in examples] == ["72", "1234", "-5"] * 2


def test_ten_thousand_rows_load_quickly(tmp_path, hf_tok):
  rows = [{"question": f"What is {i} plus {i}? Show your work.", "answer": f"#### {2 * i:,}"}
          for i in range(10_000)]
  path = _parquet(tmp_path / "big.parquet", rows)
  start = time.perf_counter()
  examples, counts = load_examples(path, hf_tok, DataOptions(max_prompt_tokens=40))
  elapsed = time.perf_counter() - start
  assert len(examples) == 10_000 and counts == {} and examples[-1].answer == "19998"
  print(f"10k rows in {elapsed:.3f} s")


def test_preference_pairs(tmp_path, hf_tok):
  rows = [{"prompt": "2+2=", "chosen": "4", "rejected": "5"},
          {"prompt": "3+3=", "chosen": "6", "rejected": "6"},
          {"prompt": "x", "chosen": [{"role": "assistant", "content": "a"}],
           "rejected": [{"role": "assistant", "content": "b"}]}]
  path = _jsonl(tmp_path / "p.jsonl", rows)
  pairs, counts = load_pairs(path, BYTES)
  assert pairs == [Pair("2+2=", "4", "5")]
  assert counts == {f"'chosen' and 'rejected' are identical (first {path}:2)": 1,
                    f"chat messages need data.chat=True (first {path}:3)": 1}
  user = {"role": "user", "content": "Hi"}
  conversational = [
      {"prompt": [user], "chosen": [{"role": "assistant", "content": "Hello"}],
       "rejected": [{"role": "assistant", "content": "Go away"}]},
      {"chosen": [user, {"role": "assistant", "content": "Hello"}],
       "rejected": [user, {"role": "assistant", "content": "Go away"}]},
      {"prompt": "Hi", "chosen": "Hello", "rejected": "Go away"}]
  pairs, counts = load_pairs(_jsonl(tmp_path / "c.jsonl", conversational), hf_tok,
                             DataOptions(chat=True))
  assert counts == {} and pairs == [Pair(hf_tok.chat([user]), "Hello", "Go away")] * 3
  with pytest.raises(DataError, match=r"c.jsonl:1: response longer than rl.rollout."
                                      r"max_new_tokens \(8 > 5\)$"):
    load_pairs(str(tmp_path / "c.jsonl"), hf_tok,
               DataOptions(chat=True, max_completion_tokens=5, on_bad_row="error"))
