"""grain pipelines: SFT batches (prompt-masked) and RL prompt batches (left-padded, to a bucket of
the batch's longest prompt).

Every token id goes through an `Encoding`: a plain prompt gets the tokenizer's own special tokens
(a BOS where it has one), a chat-rendered prompt already holds them in its text (as transformers
tokenizes `apply_chat_template`'s output), and a target ends with EOS.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grain
import numpy as np

from jaxrl.data.tasks import Example
from jaxrl.data.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Encoding:
  tok: Tokenizer
  chat: bool = False  # prompts are chat-rendered text

  def prompt(self, text: str) -> list[int]:
    return self.tok.encode(text, bos=not self.chat)

  def target(self, text: str) -> list[int]:
    return self.tok.encode(text, eos=True)


def prompt_length(examples: Sequence[Example], enc: Encoding) -> int:
  return max(len(enc.prompt(e.prompt)) for e in examples)


def target_length(examples: Sequence[Example], enc: Encoding) -> int:
  return max(len(enc.target(e.target)) for e in examples)


def _sft_row(ex: Example, enc: Encoding, seq_len: int) -> dict[str, np.ndarray]:
  prompt = enc.prompt(ex.prompt)
  full = prompt + enc.target(ex.target)
  tokens, valid = enc.tok.pad_right([full], seq_len)
  loss_mask = valid.copy()
  loss_mask[0, :len(prompt)] = False  # only the answer (and EOS) is learned
  return {"tokens": tokens[0], "valid": valid[0], "loss_mask": loss_mask[0]}


def pack_rows(examples: Sequence[Example], enc: Encoding, row_len: int,
              seed: int) -> list[dict[str, np.ndarray]]:
  """Packs examples (in a seeded random order) greedily into rows of `row_len` tokens.

  Each row: `tokens`, `valid`, `loss_mask` (answer tokens) and `segment_ids` (1, 2, ... per
  example, 0 for padding); attention and positions stay within a segment."""
  order = np.random.default_rng(seed).permutation(len(examples))
  rows, current = [], []

  def flush():
    tokens = np.full(row_len, enc.tok.pad_id, np.int32)
    loss_mask, segment_ids = np.zeros(row_len, bool), np.zeros(row_len, np.int32)
    at = 0
    for seg, (prompt, answer) in enumerate(current, 1):
      n = len(prompt) + len(answer)
      tokens[at:at + n] = prompt + answer
      loss_mask[at + len(prompt):at + n] = True
      segment_ids[at:at + n] = seg
      at += n
    rows.append({"tokens": tokens, "valid": segment_ids > 0, "loss_mask": loss_mask,
                 "segment_ids": segment_ids})
    current.clear()

  used = 0
  for i in order:
    ex = examples[i]
    pair = (enc.prompt(ex.prompt), enc.target(ex.target))
    n = len(pair[0]) + len(pair[1])
    if n > row_len:
      raise ValueError(f"sft.pack_length: example {ex.prompt!r} has {n} tokens, more than "
                       f"{row_len}")
    if used + n > row_len:
      flush()
      used = 0
    current.append(pair)
    used += n
  if current:
    flush()
  return rows


def sft_dataset(examples: Sequence[Example], enc: Encoding, *, batch_size: int, seq_len: int,
                seed: int, pack_length: int = 0) -> grain.MapDataset:
  """Shuffled, repeated SFT batches (reshuffled every epoch; batch i is read by index, so the
  data position is one integer): one example per row of `seq_len` tokens, or with
  `pack_length > 0` several examples packed per row of that many tokens."""
  if pack_length:
    return (grain.MapDataset.source(pack_rows(examples, enc, pack_length, seed)).seed(seed)
            .shuffle().repeat().batch(batch_size, drop_remainder=True))
  return (grain.MapDataset.source(list(examples)).seed(seed).shuffle().repeat()
          .map(lambda ex: _sft_row(ex, enc, seq_len)).batch(batch_size, drop_remainder=True))


BUCKET_STEP = 8  # the finest length granularity: padded lengths stay multiples of 8


def bucket_length(n: int, maximum: int, buckets: int) -> int:
  """`n` rounded up to one of at most `buckets` lengths in (0, maximum]: multiples of
  max(8, maximum / buckets) (rounded up to a multiple of 8), capped at `maximum`. A batch padded
  to its longest row's bucket wastes little, and each jitted program compiles for at most
  `buckets` lengths. `buckets=0`: always `maximum` (one shape)."""
  if buckets <= 0 or n >= maximum:
    return maximum
  step = -(-max(BUCKET_STEP, -(-maximum // buckets)) // BUCKET_STEP) * BUCKET_STEP
  return min(maximum, max(step, -(-n // step) * step))


def prompt_batch(examples: Sequence[Example], enc: Encoding, length: int,
                 buckets: int = 0) -> dict[str, np.ndarray]:
  """Prompt ids left-padded to `length` or, with `buckets`, only to the bucket of the batch's
  longest prompt (`bucket_length`), and the examples themselves (for the reward: answers and
  fields)."""
  ids = [enc.prompt(e.prompt) for e in examples]
  length = bucket_length(max(map(len, ids)), length, buckets)
  tokens, valid = enc.tok.pad_left(ids, length)
  return {"prompt_tokens": tokens, "prompt_valid": valid,
          "examples": np.array(list(examples), dtype=object)}


def prompt_dataset(examples: Sequence[Example], enc: Encoding, *, batch_size: int, length: int,
                   seed: int, buckets: int = 0) -> grain.MapDataset:
  """Shuffled, repeated batches of `batch_size` prompts, each left-padded to `length` (with
  `buckets`: to the batch's bucket, see `prompt_batch`)."""
  batch_fn = lambda exs: prompt_batch(exs, enc, length, buckets)
  return (grain.MapDataset.source(list(examples)).seed(seed).shuffle().repeat()
          .batch(batch_size, drop_remainder=True, batch_fn=batch_fn))
