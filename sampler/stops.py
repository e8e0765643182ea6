"""What ends a row besides EOS, checked on the device at every emitted token.

- `SamplingConfig.stop_sequences`: token id sequences (a tokenizer's other end-of-turn ids);
  each row keeps its last K ids (`StopState.recent_BK`).
- `SamplingConfig.stop_text`: stop strings matched on the row's decoded text (a tool call's
  `</python>`), as vLLM matches them, whatever tokens spell them: a byte-level BPE merges a tag
  with what comes before (`)</`, `"}</`), so no id sequence of the tag alone ever appears. Each
  row keeps one automaton state (`StopState.text_B`): an Aho-Corasick automaton over the strings'
  UTF-8 bytes, lifted to tokens once on the host (the state after each token's bytes, for every
  state), so a step is two small gathers, no host round trip. A string ending inside a token
  (`>\\n`) ends the row at that token; the trained ids stay exactly the sampled ones.

Only the row's own tokens count (the state starts at 0 with each turn): text that a prompt or
an earlier turn ended with never completes a stop string.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


def _automaton(patterns: Sequence[bytes]) -> np.ndarray:
  """goto [S + 1, 256] int32 of the Aho-Corasick automaton of `patterns`: state S (the last)
  is "a pattern ended", absorbing; every state reaching a pattern's end goes there."""
  children, fail, ends = [{}], [0], [False]
  for pattern in patterns:
    node = 0
    for b in pattern:
      if b not in children[node]:
        children.append({})
        fail.append(0)
        ends.append(False)
        children[node][b] = len(children) - 1
      node = children[node][b]
    ends[node] = True
  s = len(children)
  goto = np.zeros((s + 1, 256), np.int32)
  goto[s] = s
  queue = [0]
  for node in queue:  # breadth first: a node's failure state is done before its children
    ends[node] = ends[node] or ends[fail[node]]
    for b in range(256):
      child = children[node].get(b)
      if child is None:
        goto[node, b] = goto[fail[node], b] if node else 0
        continue
      fail[child] = goto[fail[node], b] if node else 0
      goto[node, b] = child
      queue.append(child)
  goto[:s] = np.where(np.asarray(ends)[goto[:s]], s, goto[:s])
  return goto


def _token_table(goto: np.ndarray, token_bytes: Sequence[bytes]) -> np.ndarray:
  """[S + 1, V] int32: the state after each token's bytes, from each state (vectorised over
  the tokens: one pass per byte position, over the tokens that long)."""
  lengths = np.asarray([len(t) for t in token_bytes])
  width = max(1, int(lengths.max(initial=0)))
  data = np.zeros((len(token_bytes), width), np.uint8)
  for i, t in enumerate(token_bytes):
    data[i, :len(t)] = np.frombuffer(t, np.uint8)
  table = np.repeat(np.arange(goto.shape[0], dtype=np.int32)[:, None], len(token_bytes), 1)
  for j in range(width):
    at = np.nonzero(lengths > j)[0]
    table[:, at] = goto[table[:, at], data[at, j]]
  return table


class StopText:
  """Stop strings on a tokenizer's decoded text (module docstring): `class_V`, each token's
  column of the transition table, and `next_SC`, the state after a token of that column.
  Hashable by its strings and tables (it is part of a static SamplingConfig)."""

  def __init__(self, strings: Sequence[str], token_bytes: Sequence[bytes]):
    if not strings or any(not s for s in strings):
      raise ValueError(f"stop strings: expected non-empty strings, got {list(strings)!r}")
    self.strings = tuple(strings)
    # (one more token, of no text: the class of the ids past the tokenizer's, which a model's
    # padded vocabulary has, leaving the state unchanged)
    table = _token_table(_automaton([s.encode("utf-8") for s in self.strings]),
                         [*token_bytes, b""])
    columns, class_V = np.unique(table.T, axis=0, return_inverse=True)
    class_V = class_V.reshape(-1).astype(np.int32)
    self.next_SC = np.ascontiguousarray(columns.T, np.int32)
    self.class_V, self.unchanged = class_V[:-1], int(class_V[-1])
    self.matched = int(table.shape[0] - 1)
    digest = hashlib.sha256(repr(self.strings).encode())
    for array in (self.next_SC, self.class_V):
      digest.update(array.tobytes())
    self.key = digest.hexdigest()

  def __hash__(self) -> int:
    return hash(self.key)

  def __eq__(self, other) -> bool:
    return isinstance(other, StopText) and other.key == self.key

  def __repr__(self) -> str:
    return f"StopText({list(self.strings)!r})"

  def advance(self, text_B: jax.Array, tok_B: jax.Array) -> jax.Array:
    """Each row's state after its token `tok_B`."""
    class_B = jnp.take(jnp.asarray(self.class_V), tok_B, mode="fill", fill_value=self.unchanged)
    return jnp.asarray(self.next_SC)[text_B, class_B]


@flax.struct.dataclass
class StopState:
  """Per row: its last K ids (K the longest stop id sequence, at least 1) and its stop-text
  automaton state."""
  recent_BK: jax.Array
  text_B: jax.Array

  @classmethod
  def start(cls, rows: int, cfg) -> StopState:
    k = max([len(s) for s in cfg.stop_sequences], default=1)
    return cls(jnp.full((rows, k), -1, jnp.int32), jnp.zeros((rows,), jnp.int32))

  def after(self, tok_B: jax.Array, cfg) -> tuple[StopState, jax.Array]:
    """(the state after each row's token, whether a stop sequence or string just ended)."""
    recent_BK = jnp.concatenate([self.recent_BK[:, 1:], tok_B[:, None]], axis=1)
    hit_B = jnp.zeros(tok_B.shape, bool)
    for seq in cfg.stop_sequences:
      hit_B |= jnp.all(recent_BK[:, -len(seq):] == jnp.asarray(seq, jnp.int32), axis=1)
    text_B = self.text_B
    if cfg.stop_text is not None:
      text_B = cfg.stop_text.advance(text_B, tok_B)
      hit_B |= text_B == cfg.stop_text.matched
    return StopState(recent_BK, text_B), hit_B
