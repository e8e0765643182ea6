"""grain pipelines: SFT batches (prompt-masked) and RL prompt batches (left-padded)."""
from __future__ import annotations

from collections.abc import Sequence

import grain
import numpy as np

from jaxrl.data.tasks import Example
from jaxrl.data.tokenizer import ByteTokenizer


def prompt_length(examples: Sequence[Example], tok: ByteTokenizer) -> int:
  return max(len(tok.encode(e.prompt, bos=True)) for e in examples)


def answer_length(examples: Sequence[Example], tok: ByteTokenizer) -> int:
  return max(len(tok.encode(e.answer, eos=True)) for e in examples)


def _sft_row(ex: Example, tok: ByteTokenizer, seq_len: int) -> dict[str, np.ndarray]:
  prompt = tok.encode(ex.prompt, bos=True)
  full = prompt + tok.encode(ex.target, eos=True)
  tokens, valid = tok.pad_right([full], seq_len)
  loss_mask = valid.copy()
  loss_mask[0, :len(prompt)] = False  # only the answer (and EOS) is learned
  return {"tokens": tokens[0], "valid": valid[0], "loss_mask": loss_mask[0]}


def pack_rows(examples: Sequence[Example], tok: ByteTokenizer, row_len: int,
              seed: int) -> list[dict[str, np.ndarray]]:
  """Packs examples (in a seeded random order) greedily into rows of `row_len` tokens.

  Each row: `tokens`, `valid`, `loss_mask` (answer tokens) and `segment_ids` (1, 2, ... per
  example, 0 for padding); attention and positions stay within a segment."""
  order = np.random.default_rng(seed).permutation(len(examples))
  rows, current = [], []

  def flush():
    tokens = np.full(row_len, tok.pad_id, np.int32)
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
    pair = (tok.encode(ex.prompt, bos=True), tok.encode(ex.target, eos=True))
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


def sft_dataset(examples: Sequence[Example], tok: ByteTokenizer, *, batch_size: int,
                seed: int, pack_length: int = 0) -> grain.MapDataset:
  """Shuffled, repeated SFT batches: one example per row, or with `pack_length > 0` several
  examples packed per row of that many tokens (fewer pad tokens for mixed lengths)."""
  if pack_length:
    return (grain.MapDataset.source(pack_rows(examples, tok, pack_length, seed)).seed(seed)
            .shuffle().repeat().batch(batch_size, drop_remainder=True))
  seq_len = prompt_length(examples, tok) + answer_length(examples, tok)
  return (grain.MapDataset.source(list(examples)).seed(seed).shuffle().repeat()
          .map(lambda ex: _sft_row(ex, tok, seq_len)).batch(batch_size, drop_remainder=True))


def prompt_batch(examples: Sequence[Example], tok: ByteTokenizer, length: int) -> dict[str, np.ndarray]:
  tokens, valid = tok.pad_left([tok.encode(e.prompt, bos=True) for e in examples], length)
  return {"prompt_tokens": tokens, "prompt_valid": valid,
          "answers": np.array([e.answer for e in examples], dtype=object)}


def prompt_dataset(examples: Sequence[Example], tok: ByteTokenizer, *, batch_size: int, length: int,
                   seed: int) -> grain.MapDataset:
  """Shuffled, repeated batches of `batch_size` prompts, each left-padded to `length`."""
  return (grain.MapDataset.source(list(examples)).seed(seed).shuffle().repeat()
          .batch(batch_size, drop_remainder=True, batch_fn=lambda exs: prompt_batch(exs, tok, length)))
