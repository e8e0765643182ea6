"""Tokenizers behind one small protocol: a byte-level one for the synthetic tasks, and a Hugging
Face `tokenizer.json` one (with its chat template) for real models.

`encode(text, bos=True)` means "with the tokenizer's own special tokens": BOS for the byte
tokenizer, the `tokenizer.json` post-processor for a Hugging Face one (a BOS for Llama 3, nothing
for Qwen), as `AutoTokenizer(text)` does. Text rendered by a chat template already holds its
special tokens, so it is encoded with `bos=False`, as `apply_chat_template(tokenize=True)` does.
Padding masks are positional, never `tokens != pad_id`: a Hugging Face pad id may equal EOS.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from jaxrl.data import chat as chat_lib

Messages = Sequence[Mapping[str, Any]]


class TokenizerError(ValueError):
  """A tokenizer directory that cannot be used; the message names the file."""


class Tokenizer(Protocol):
  pad_id: int
  bos_id: int | None
  eos_id: int
  vocab_size: int

  @property
  def stop_ids(self) -> tuple[int, ...]: ...
  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]: ...
  def encode_batch(self, texts: Sequence[str], *, bos: bool = False,
                   eos: bool = False) -> list[list[int]]: ...
  def decode(self, ids) -> str: ...
  def token_bytes(self) -> list[bytes]: ...
  def pad_left(self, seqs: Sequence[Sequence[int]],
               length: int) -> tuple[np.ndarray, np.ndarray]: ...
  def pad_right(self, seqs: Sequence[Sequence[int]],
                length: int) -> tuple[np.ndarray, np.ndarray]: ...
  def chat(self, messages: Messages, *, add_generation_prompt: bool = True,
           **template_kwargs: Any) -> str: ...


def pad(seqs: Sequence[Sequence[int]], length: int, pad_id: int, *,
        left: bool) -> tuple[np.ndarray, np.ndarray]:
  """(tokens_BL, valid_BL), each sequence right-aligned if `left` else left-aligned."""
  tokens = np.full((len(seqs), length), pad_id, np.int32)
  valid = np.zeros((len(seqs), length), bool)
  for row, s in enumerate(seqs):
    if len(s) > length:
      raise ValueError(f"sequence {row} has {len(s)} tokens, more than the {length} allowed")
    at = slice(length - len(s), length) if left else slice(0, len(s))
    tokens[row, at] = s
    valid[row, at] = True
  return tokens, valid


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """Ids 0..255 are UTF-8 bytes, then PAD, BOS, EOS."""
  pad_id: int = 256
  bos_id: int = 257
  eos_id: int = 258
  # Rounded up to a multiple of 8 so the vocab axis divides common mesh sizes.
  vocab_size: int = 264

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return (self.eos_id,)

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    ids = list(text.encode("utf-8"))
    return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

  def encode_batch(self, texts: Sequence[str], *, bos: bool = False,
                   eos: bool = False) -> list[list[int]]:
    return [self.encode(t, bos=bos, eos=eos) for t in texts]

  def decode(self, ids) -> str:
    """Decodes up to the first EOS, skipping PAD and BOS."""
    out = bytearray()
    for i in np.asarray(ids).tolist():
      if i == self.eos_id:
        break
      if i < 256:
        out.append(i)
    return out.decode("utf-8", errors="replace")

  def token_bytes(self) -> list[bytes]:
    """Each id's bytes in decoded text (none for PAD, BOS, EOS)."""
    return [bytes([i]) if i < 256 else b"" for i in range(self.vocab_size)]

  def pad_left(self, seqs, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens_BL, valid_BL) with each sequence right-aligned; raises if one is too long."""
    return pad(seqs, length, self.pad_id, left=True)

  def pad_right(self, seqs, length: int) -> tuple[np.ndarray, np.ndarray]:
    return pad(seqs, length, self.pad_id, left=False)

  def chat(self, messages: Messages, *, add_generation_prompt: bool = True,
           **template_kwargs: Any) -> str:
    raise TokenizerError("the byte tokenizer has no chat template; set data.chat=False or "
                         "point data.tokenizer_path at a directory with one")


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except json.JSONDecodeError as e:
    raise TokenizerError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
  if not isinstance(data, dict):
    raise TokenizerError(f"{path}: expected a JSON object")
  return data


def _token_str(value: Any) -> str | None:
  """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) and value else None


def _special_tokens(directory: str) -> dict[str, str]:
  """'bos_token', 'eos_token', ... from tokenizer_config.json, then special_tokens_map.json for
  the ones it lacks."""
  found: dict[str, str] = {}
  for name in ("tokenizer_config.json", "special_tokens_map.json"):
    path = os.path.join(directory, name)
    if not os.path.exists(path):
      continue
    config = _read_json(path)
    for key in _SPECIAL_KEYS:
      if key not in found and (token := _token_str(config.get(key))) is not None:
        found[key] = token
  return found


# The named special tokens transformers hands to a chat template (its SPECIAL_TOKENS_ATTRIBUTES).
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")


def _chat_template(directory: str) -> str | None:
  """chat_template.jinja wins over tokenizer_config.json's `chat_template`, as in transformers;
  a list of named templates gives its 'default'."""
  jinja_path = os.path.join(directory, "chat_template.jinja")
  if os.path.exists(jinja_path):
    with open(jinja_path, encoding="utf-8") as f:
      return f.read()
  config_path = os.path.join(directory, "tokenizer_config.json")
  template = _read_json(config_path).get("chat_template") if os.path.exists(config_path) else None
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if "default" not in named:
      raise TokenizerError(f"{config_path}: 'chat_template' lists {sorted(map(str, named))} "
                           "but no 'default'")
    template = named["default"]
  return template if isinstance(template, str) and template else None


def _generation_eos_ids(directory: str) -> list[int]:
  path = os.path.join(directory, "generation_config.json")
  if not os.path.exists(path):
    return []
  eos = _read_json(path).get("eos_token_id")
  eos = eos if isinstance(eos, list) else [eos]
  return [i for i in eos if isinstance(i, int)]


def _byte_of() -> dict[str, int]:
  """GPT-2's byte-level alphabet: the printable character standing for each byte."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
               *range(ord("\xae"), ord("\xff") + 1)]
  others = [b for b in range(256) if b not in printable]
  return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


_BYTE_OF = _byte_of()


class HFTokenizer:
  """A Hugging Face tokenizer directory: tokenizer.json, tokenizer_config.json and, if present,
  chat_template.jinja, special_tokens_map.json and generation_config.json."""

  def __init__(self, backend, *, directory: str, special_tokens: Mapping[str, str],
               template: str | None, extra_stop_ids: Iterable[int] = ()):
    self._tok = backend
    self.directory = directory
    self.special_tokens = dict(special_tokens)
    self.template = template
    ids = {k: backend.token_to_id(v) for k, v in self.special_tokens.items()}
    eos = ids.get("eos_token")
    extra = list(extra_stop_ids)
    if eos is None and not extra:
      raise TokenizerError(f"{directory}: no 'eos_token' in tokenizer_config.json and no "
                           "eos_token_id in generation_config.json")
    self.eos_id: int = eos if eos is not None else extra[0]
    self.bos_id: int | None = ids.get("bos_token")
    self.pad_id: int = ids["pad_token"] if ids.get("pad_token") is not None else self.eos_id
    self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
    self._stop_ids = tuple(dict.fromkeys([self.eos_id, *extra]))

  @classmethod
  def from_dir(cls, directory: str) -> HFTokenizer:
    import tokenizers  # only runs with a Hugging Face tokenizer; the byte tokenizer needs none

    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
      raise TokenizerError(f"{directory}: no tokenizer.json (data.tokenizer_path or "
                           "model.hf_path must be a Hugging Face tokenizer directory, or empty "
                           "for the byte tokenizer)")
    try:
      backend = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust loader raises plain Exception subclasses
      raise TokenizerError(f"{path}: cannot load ({str(e).splitlines()[0]})") from None
    # Truncation or padding saved in tokenizer.json would silently cut or pad every encode.
    backend.no_truncation()
    backend.no_padding()
    special = _special_tokens(directory)
    missing = [t for t in dict.fromkeys(special.values()) if backend.token_to_id(t) is None]
    if missing:  # as transformers does: named special tokens the vocab lacks are added
      backend.add_special_tokens(
          [tokenizers.AddedToken(t, special=True, normalized=False) for t in missing])
    return cls(backend, directory=directory, special_tokens=special,
               template=_chat_template(directory), extra_stop_ids=_generation_eos_ids(directory))

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """EOS, then generation_config.json's other eos ids (e.g. <|eot_id|>, <|im_end|>)."""
    return self._stop_ids

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    return self.encode_batch([text], bos=bos, eos=eos)[0]

  def encode_batch(self, texts: Sequence[str], *, bos: bool = False,
                   eos: bool = False) -> list[list[int]]:
    """`bos=True` applies the tokenizer's post-processor (its own special tokens)."""
    encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=bos)
    tail = [self.eos_id] if eos else []
    return [e.ids + tail for e in encodings]

  def decode(self, ids) -> str:
    """Decodes up to the first stop id, skipping special tokens."""
    ids = np.asarray(ids).reshape(-1).tolist()
    stops = set(self._stop_ids)
    end = next((n for n, i in enumerate(ids) if i in stops), len(ids))
    return self._tok.decode(ids[:end], skip_special_tokens=True)

  @functools.cached_property
  def _token_bytes(self) -> list[bytes]:
    spec = json.loads(self._tok.to_str())
    byte_level = '"ByteLevel"' in json.dumps(spec.get("decoder"))
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    out = []
    for i in range(self.vocab_size):
      piece = self._tok.id_to_token(i)
      if i in added:  # as written; a special one is skipped by decoding
        out.append(b"" if added[i].get("special") else added[i]["content"].encode())
      elif piece is None:
        out.append(b"")
      elif byte_level:  # GPT-2's printable stand-ins for bytes
        out.append(bytes(_BYTE_OF.get(c, 32) for c in piece))
      elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # byte fallback
        out.append(bytes([int(piece[3:5], 16)]))
      else:  # SentencePiece: "▁" is a space
        out.append(piece.replace("\u2581", " ").encode())
    return out

  def token_bytes(self) -> list[bytes]:
    """Each id's bytes in decoded text (none for special tokens, which decoding skips)."""
    return self._token_bytes

  def pad_left(self, seqs, length: int) -> tuple[np.ndarray, np.ndarray]:
    return pad(seqs, length, self.pad_id, left=True)

  def pad_right(self, seqs, length: int) -> tuple[np.ndarray, np.ndarray]:
    return pad(seqs, length, self.pad_id, left=False)

  def chat(self, messages: Messages, *, add_generation_prompt: bool = True,
           **template_kwargs: Any) -> str:
    """The chat text as `apply_chat_template(tokenize=False)` renders it; `template_kwargs`
    are extra template variables (e.g. `enable_thinking=False` for Qwen3)."""
    if self.template is None:
      raise TokenizerError(f"{self.directory}: the tokenizer has no chat template (no "
                           "chat_template.jinja, no 'chat_template' in tokenizer_config.json); "
                           "set data.chat=False")
    return chat_lib.render(self.template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.special_tokens, **template_kwargs)


def load_tokenizer(path: str) -> Tokenizer:
  """The byte tokenizer for "", else the Hugging Face tokenizer in directory `path`."""
  if not path:
    return ByteTokenizer()
  if os.path.basename(path) == "tokenizer.json":
    path = os.path.dirname(path) or "."
  return HFTokenizer.from_dir(path)
