"""A byte-level tokenizer: ids 0..255 are UTF-8 bytes, then PAD, BOS, EOS."""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  pad_id: int = 256
  bos_id: int = 257
  eos_id: int = 258
  # Rounded up to a multiple of 8 so the vocab axis divides common mesh sizes.
  vocab_size: int = 264

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    ids = list(text.encode("utf-8"))
    return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

  def decode(self, ids) -> str:
    """Decodes up to the first EOS, skipping PAD and BOS."""
    out = bytearray()
    for i in np.asarray(ids).tolist():
      if i == self.eos_id:
        break
      if i < 256:
        out.append(i)
    return out.decode("utf-8", errors="replace")

  def pad_left(self, seqs: list[list[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens_BL, valid_BL) with each sequence right-aligned; raises if one is too long."""
    tokens = np.full((len(seqs), length), self.pad_id, np.int32)
    for row, s in enumerate(seqs):
      if len(s) > length:
        raise ValueError(f"sequence {row} has {len(s)} tokens, more than the {length} allowed")
      tokens[row, length - len(s):] = s
    return tokens, tokens != self.pad_id

  def pad_right(self, seqs: list[list[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full((len(seqs), length), self.pad_id, np.int32)
    for row, s in enumerate(seqs):
      if len(s) > length:
        raise ValueError(f"sequence {row} has {len(s)} tokens, more than the {length} allowed")
      tokens[row, :len(s)] = s
    return tokens, tokens != self.pad_id
