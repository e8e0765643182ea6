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


def sft_dataset(examples: Sequence[Example], tok: ByteTokenizer, *, batch_size: int,
                seed: int) -> grain.MapDataset:
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
