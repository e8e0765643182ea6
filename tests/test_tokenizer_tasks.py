import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl.data.pipeline import Encoding, prompt_dataset, prompt_length, sft_dataset
from jaxrl.data.tasks import TASKS, make_splits
from jaxrl.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


@given(st.text(max_size=64))
def test_tokenizer_round_trip(text):
  ids = TOK.encode(text, bos=True, eos=True)
  assert ids[0] == TOK.bos_id and ids[-1] == TOK.eos_id
  assert all(0 <= i < TOK.vocab_size for i in ids)
  assert TOK.decode(ids) == text


def test_decode_stops_at_eos_and_skips_pad():
  ids = [TOK.pad_id, *TOK.encode("12"), TOK.eos_id, *TOK.encode("junk")]
  assert TOK.decode(ids) == "12"


def test_pad_left_right():
  tokens, valid = TOK.pad_left([[1, 2], [3]], 3)
  np.testing.assert_array_equal(tokens, [[256, 1, 2], [256, 256, 3]])
  np.testing.assert_array_equal(valid, [[False, True, True], [False, False, True]])
  tokens, _ = TOK.pad_right([[1, 2], [3]], 3)
  np.testing.assert_array_equal(tokens, [[1, 2, 256], [3, 256, 256]])
  with pytest.raises(ValueError, match="sequence 0 has 4 tokens"):
    TOK.pad_left([[1, 2, 3, 4]], 3)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_tasks_are_deterministic_disjoint_and_correct(task):
  train, held = make_splits(task, 3, 200, 50, seed=7)
  train2, held2 = make_splits(task, 3, 200, 50, seed=7)
  assert train == train2 and held == held2
  assert len(train) == 200 and len(held) == 50
  assert not {e.prompt for e in train} & {e.prompt for e in held}
  for ex in train[:20]:
    body = ex.prompt.rstrip("=")
    if task == "addition":
      a, b = body.split("+")
      assert ex.answer == str(int(a) + int(b))
    elif task in ("reverse", "reverse_tail"):
      assert ex.answer == body.split()[1][::-1]
    else:
      assert ex.answer == "".join(sorted(body.split()[1]))


def test_reverse_tail_has_a_long_tail_of_lengths():
  train, _ = make_splits("reverse_tail", 32, 2000, 10, seed=0)
  lengths = np.array([len(ex.answer) for ex in train])
  assert lengths.min() == 2 and lengths.max() == 32
  assert np.median(lengths) <= 6 and (lengths >= 20).mean() > 0.02  # most short, some long


def test_task_space_too_small():
  with pytest.raises(ValueError, match="fewer than"):
    make_splits("addition", 1, 500, 10, seed=0)


def test_pipelines_shapes_and_masks():
  train, _ = make_splits("addition", 2, 64, 8, seed=0)
  batch = sft_dataset(train, Encoding(TOK), batch_size=8, seq_len=16, seed=0)[0]
  assert batch["tokens"].shape == batch["loss_mask"].shape
  for row in range(8):
    learned = batch["tokens"][row][batch["loss_mask"][row]]
    assert learned[-1] == TOK.eos_id  # the answer and its EOS are learned, the prompt is not
    prompt_end = list(batch["tokens"][row]).index(ord("="))
    assert not batch["loss_mask"][row][:prompt_end + 1].any()
  length = prompt_length(train, Encoding(TOK))
  prompts = next(iter(prompt_dataset(train, Encoding(TOK), batch_size=4, length=length, seed=0)))
  assert prompts["prompt_tokens"].shape == (4, length)
  assert (prompts["prompt_tokens"][:, -1] == ord("=")).all()  # left padded: prompts end aligned


@pytest.mark.parametrize("task", sorted(TASKS))
def test_teacher_error_corrupts_only_training_demos(task):
  clean, held = make_splits(task, 3, 300, 50, seed=3)
  assert all(e.target == e.answer for e in clean)
  noisy, held_noisy = make_splits(task, 3, 300, 50, seed=3, teacher_error=1.0)
  assert held_noisy == held and all(e.target == e.answer for e in held_noisy)
  assert [e.prompt for e in noisy] == [e.prompt for e in clean]
  wrong = [e for e in noisy if e.target != e.answer]
  assert len(wrong) == sum(bool(e.mistake) for e in noisy) > 50
  assert all(e.target == e.mistake for e in wrong)


def test_addition_mistake_is_a_dropped_carry():
  train, _ = make_splits("addition", 2, 200, 10, seed=0, teacher_error=1.0)
  for ex in train:
    a, b = (int(x) for x in ex.prompt.rstrip("=").split("+"))
    carry = a % 10 + b % 10 >= 10
    assert ex.target == str(a + b - 10 * carry)
