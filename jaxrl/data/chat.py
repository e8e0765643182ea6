"""Chat templates rendered exactly as `transformers` renders them, without importing it.

A chat template is untrusted Jinja from a model repository, so it runs in jinja2's immutable
sandbox with the environment of `transformers.utils.chat_template_utils`: `trim_blocks`,
`lstrip_blocks`, the `loopcontrols` extension, the globals `raise_exception`, `strftime_now`,
`dict` and an underscore-refusing `namespace`, and a `tojson` filter that does not escape HTML.
`tests/test_tokenizer_hf.py` checks the rendered strings against `AutoTokenizer`.
"""
from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils
import numpy as np


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt text.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(format):
  return datetime.datetime.now().strftime(format)


class _TemplateDict:
  """`dict(...)` for templates, without exposing the dict type itself to attribute tricks."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
  """A jinja namespace that refuses underscore names, which could reach CPython internals."""

  def __init__(*args, **kwargs):  # `self` is in args so that `namespace(self=...)` still works
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _Namespace._check_name(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _Namespace._check_name(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check_name(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(
          f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}")


class _GenerationTag(jinja2.ext.Extension):
  """Accepts `{% generation %}...{% endgeneration %}` (assistant-mask markers) and renders the
  body unchanged, as transformers does when it is not collecting an assistant mask."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

  def _render(self, caller):
    return caller()


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  env.globals["dict"] = _TemplateDict()
  env.globals["namespace"] = _Namespace
  return env.from_string(source)


def _plain(value: Any) -> Any:
  """Plain JSON-like copies of the inputs: the template sees no caller objects it could mutate."""
  if value is None or type(value) in (str, int, float, bool):
    return value
  if isinstance(value, np.generic):
    return _plain(value.item())
  if isinstance(value, Mapping):
    return {_plain(k): _plain(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_plain(v) for v in value]
  if isinstance(value, tuple):
    return tuple(_plain(v) for v in value)
  for kind in (str, int, float):
    if isinstance(value, kind):  # enums and other subclasses: back to the base type
      return kind(value)
  return f"<{type(value).__name__}>"


# Names a message's reasoning goes by; templates read `reasoning_content` (Qwen3) or `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _message(i: int, message: Any) -> dict:
  """Like transformers: None-valued keys dropped (templates test for a key's presence and would
  render a literal 'None'), and the reasoning filled in under both names templates read."""
  if not isinstance(message, Mapping):
    raise ValueError(f"chat: message {i} is a {type(message).__name__}, not a dict")
  message = _plain({k: v for k, v in message.items() if v is not None})
  reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
  if reasoning is not None:
    message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
  return message


def render(source: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
           special_tokens: Mapping[str, str], **template_kwargs: Any) -> str:
  """The chat text; `special_tokens` maps 'bos_token', 'eos_token', ... to their strings, and
  `template_kwargs` (e.g. Qwen3's `enable_thinking`) override them, as in transformers."""
  if not messages:
    raise ValueError("chat: the conversation is empty")
  chat = [_message(i, m) for i, m in enumerate(messages)]
  return compile_template(source).render(
      messages=chat, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
      **_plain({**special_tokens, **template_kwargs}))
