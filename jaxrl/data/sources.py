"""Dataset files -> `Example`s (SFT, RL) and `Pair`s (reward model, DPO).

Rows come from files.py (JSON lines or parquet, globs), and every problem is reported as
`FILE:ROW: reason`.

A row that cannot be used (a missing, empty or non-string field, a reference answer that cannot
be extracted, a prompt or completion over its token limit) is skipped and counted by reason, or
with `on_bad_row="error"` raises `DataError` on the first one. `Example.fields` keeps the whole
row for user reward functions.
"""
from __future__ import annotations

import collections
import dataclasses
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jinja2

from jaxrl.data.files import BadRow, DataError, read_rows
from jaxrl.data.preferences import Pair
from jaxrl.data.tasks import Example
from jaxrl.data.tokenizer import Tokenizer

ANSWER_FORMATS = ("gsm8k", "boxed", "plain")
BAD_ROW_POLICIES = ("skip", "error")


@dataclasses.dataclass(frozen=True)
class DataOptions:
  """How rows become prompts, reference answers and SFT completions (mirrors config `data`)."""
  prompt_field: str = "question"
  answer_field: str = "answer"  # "": no reference answer (e.g. rewards from a user function)
  messages_field: str = ""  # chat messages used as the prompt instead of prompt_field
  completion_field: str = ""  # SFT target; "": the last assistant message, or the answer field
  answer_format: str = "gsm8k"  # gsm8k: after the last '####' | boxed: last \boxed{} | plain
  prompt_template: str = "{prompt}"  # str.format with `prompt` and every row field by name
  chat: bool = False  # render the prompt through the tokenizer's chat template
  system_prompt: str = ""
  max_prompt_tokens: int = 0  # 0: no limit
  max_completion_tokens: int = 0  # SFT completions (and preference responses); 0: no limit
  on_bad_row: str = "skip"  # skip | error

  def __post_init__(self):
    for name, options in (("answer_format", ANSWER_FORMATS), ("on_bad_row", BAD_ROW_POLICIES)):
      if getattr(self, name) not in options:
        raise DataError(f"data.{name}: expected one of {list(options)}, "
                        f"got {getattr(self, name)!r}")
    try:
      names = [f[1] for f in string.Formatter().parse(self.prompt_template) if f[1] is not None]
    except ValueError as e:
      raise DataError(f"data.prompt_template: {e}") from None
    if any(not n or n.isdigit() for n in names):
      raise DataError("data.prompt_template: use named fields such as {prompt}, not {} or {0}")

  @classmethod
  def of(cls, config: Any) -> DataOptions:
    """The options read from any object with these attribute names (e.g. the `data` config)."""
    return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)
                  if hasattr(config, f.name)})

  @property
  def renders_chat(self) -> bool:
    """Prompts are chat-rendered text, holding their special tokens: encode with bos=False."""
    return self.chat or bool(self.messages_field)


class _Tally:
  """Counts bad rows by reason, each with the first row it skipped, or raises on the first."""

  def __init__(self, policy: str):
    self.policy, self.counts, self.first = policy, collections.Counter(), {}

  def bad(self, where: str, reason: str, detail: str = "") -> None:
    if self.policy == "error":
      raise DataError(f"{where}: {reason}{detail}")
    self.counts[reason] += 1
    self.first.setdefault(reason, f"{where}{detail}")

  def by_reason(self) -> dict[str, int]:
    """{'REASON (first FILE:ROW)': count}: what a log line or the run summary says."""
    return {f"{reason} (first {self.first[reason]})": n for reason, n in self.counts.items()}


# --- fields -------------------------------------------------------------------------------------

def _text(row: Mapping, field: str, *, numbers: bool = False) -> str:
  """The non-empty string in `row[field]`; `numbers` also takes ints and floats (answers)."""
  if field not in row or row[field] is None:
    raise BadRow(f"field {field!r}: missing")
  value = row[field]
  if numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
    value = str(value)
  if not isinstance(value, str):
    raise BadRow(f"field {field!r}: not a string", f" (got {type(value).__name__})")
  if not value.strip():
    raise BadRow(f"field {field!r}: empty")
  return value


def _messages(row: Mapping, field: str) -> list[dict]:
  value = row.get(field)
  if value is None:
    raise BadRow(f"field {field!r}: missing")
  if not isinstance(value, list) or not all(
      isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
      for m in value):
    raise BadRow(f"field {field!r}: not a list of {{'role', 'content'}} messages")
  if not value:
    raise BadRow(f"field {field!r}: empty")
  return [dict(m) for m in value]


def last_boxed(text: str) -> str | None:
  """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if none."""
  starts = [text.rfind(tag) for tag in ("\\boxed{", "\\fbox{")]
  start = max(starts)
  if start < 0:
    return None
  depth, begin = 0, text.index("{", start)
  for at in range(begin, len(text)):
    depth += {"{": 1, "}": -1}.get(text[at], 0)
    if depth == 0:
      return text[begin + 1:at].strip()
  return None


def reference_answer(text: str, answer_format: str) -> str:
  """The reference answer in an answer field; raises BadRow if the format finds none."""
  if answer_format == "gsm8k":
    at = text.rfind("####")
    answer = text[at + 4:].strip().replace(",", "") if at >= 0 else ""
    if not answer:
      raise BadRow("answer: no '#### ANSWER'")
    return answer
  if answer_format == "boxed":
    answer = last_boxed(text)
    if not answer:
      raise BadRow("answer: no \\boxed{ANSWER}")
    return answer
  return text.strip()


def _with_system(messages: list[dict], opts: DataOptions) -> list[dict]:
  if opts.system_prompt and messages[0]["role"] != "system":
    return [{"role": "system", "content": opts.system_prompt}, *messages]
  return messages


def _render(tok: Tokenizer, messages: list[dict]) -> str:
  try:
    return tok.chat(messages, add_generation_prompt=True)
  except jinja2.TemplateError as e:  # e.g. the template's raise_exception on alternating roles
    raise BadRow("chat template failed", f" ({e})") from None


def _prompt(row: Mapping, prompt: Any, tok: Tokenizer, opts: DataOptions) -> str:
  """The prompt text from a plain string (templated, optionally chat-rendered) or messages."""
  if isinstance(prompt, list):
    return _render(tok, _with_system(prompt, opts))
  try:
    text = opts.prompt_template.format_map({**row, "prompt": prompt})
  except KeyError as e:
    raise BadRow(f"prompt_template: no field {e}") from None
  except (AttributeError, IndexError, TypeError, ValueError) as e:
    raise BadRow("prompt_template failed", f" ({e})") from None
  if not opts.renders_chat:
    return text
  return _render(tok, _with_system([{"role": "user", "content": text}], opts))


def render_prompt(text: str, tok: Tokenizer, opts: DataOptions) -> str:
  """A prompt given as text, outside any dataset row, rendered as a row's prompt field is."""
  try:
    return _prompt({}, text, tok, opts)
  except BadRow as e:
    raise DataError(f"prompt: {e}{e.detail}") from None


# --- examples -----------------------------------------------------------------------------------

def _example(row: Mapping, tok: Tokenizer, opts: DataOptions, sft: bool) -> Example:
  assistant = None
  if opts.messages_field:
    messages = _messages(row, opts.messages_field)
    if messages[-1]["role"] == "assistant":
      assistant, messages = messages[-1]["content"], messages[:-1]
    if not messages:
      raise BadRow(f"field {opts.messages_field!r}: no message before the assistant's")
    prompt = _prompt(row, messages, tok, opts)
  else:
    prompt = _prompt(row, _text(row, opts.prompt_field), tok, opts)
  raw_answer = _text(row, opts.answer_field, numbers=True) if opts.answer_field else None
  answer = reference_answer(raw_answer, opts.answer_format) if raw_answer is not None else ""
  try:
    demo = _completion(row, opts, assistant, raw_answer)
  except BadRow:
    if sft:
      raise
    demo = ""  # RL needs no completion
  return Example(prompt, answer, demo=demo, fields=dict(row))


def _completion(row: Mapping, opts: DataOptions, assistant: str | None,
                raw_answer: str | None) -> str:
  """The SFT target: the completion field, else the last assistant message, else the answer
  field's full text (e.g. GSM8K's worked solution)."""
  if opts.completion_field:
    return _text(row, opts.completion_field)
  if assistant is not None:
    if not assistant.strip():
      raise BadRow(f"field {opts.messages_field!r}: empty assistant message")
    return assistant
  if raw_answer is not None:
    return raw_answer
  raise BadRow("no completion (set data.completion_field, or use a messages field that ends "
                "with an assistant message)")


def _parse_rows(path: str, tally: _Tally, parse: Callable[[dict], Any]) -> tuple[list, list]:
  """(items, their 'FILE:ROW's) for the rows `parse` accepts; the others go to `tally`."""
  items, wheres = [], []
  for where, row in read_rows(path):
    try:
      if isinstance(row, BadRow):
        raise row
      items.append(parse(row))
      wheres.append(where)
    except BadRow as e:
      tally.bad(where, e.reason, e.detail)
  return items, wheres


def _over_limit(tok: Tokenizer, texts: Sequence[str], limit: int, *, bos: bool,
                eos: bool) -> list[int]:
  """Token counts of `texts` (0 where within `limit`); tokenized in one batch for speed."""
  if not limit or not texts:
    return [0] * len(texts)
  return [n if n > limit else 0 for n in map(len, tok.encode_batch(texts, bos=bos, eos=eos))]


def load_examples(path: str, tok: Tokenizer, opts: DataOptions = DataOptions(), *,
                  sft: bool = False) -> tuple[list[Example], dict[str, int]]:
  """(examples, bad-row counts by reason). With `sft`, a row without a completion is bad and
  completions over `max_completion_tokens` (with EOS) are too.

  Chat-rendered prompts hold their own special tokens, so their length is counted without the
  post-processor's; plain prompts are counted with it (`encode(bos=True)`)."""
  tally = _Tally(opts.on_bad_row)
  examples, wheres = _parse_rows(path, tally, lambda row: _example(row, tok, opts, sft))
  prompt_over = _over_limit(tok, [e.prompt for e in examples], opts.max_prompt_tokens,
                            bos=not opts.renders_chat, eos=False)
  demo_over = _over_limit(tok, [e.demo for e in examples] if sft else [],
                          opts.max_completion_tokens, bos=False, eos=True)
  kept = []
  for n, (ex, where) in enumerate(zip(examples, wheres)):
    if prompt_over[n]:
      tally.bad(where, "prompt longer than data.max_prompt_tokens",
                f" ({prompt_over[n]} > {opts.max_prompt_tokens})")
    elif sft and demo_over[n]:
      tally.bad(where, "completion longer than rl.rollout.max_new_tokens",
                f" ({demo_over[n]} > {opts.max_completion_tokens})")
    else:
      kept.append(ex)
  return _nonempty(path, kept, tally, opts), tally.by_reason()


def _nonempty(path: str, items: list, tally: _Tally, opts: DataOptions) -> list:
  """`items`, or a DataError saying how many rows were skipped for what (with the limit a length
  rule used)."""
  if not items:
    limits = {"prompt longer than data.max_prompt_tokens": opts.max_prompt_tokens,
              "completion longer than rl.rollout.max_new_tokens": opts.max_completion_tokens,
              "response longer than rl.rollout.max_new_tokens": opts.max_completion_tokens}
    skipped = "; ".join(f"{n} skipped: {reason}" + (f"={limits[reason]}" if reason in limits
                                                      else "") + f", first {tally.first[reason]}"
                        for reason, n in tally.counts.most_common())
    raise DataError(f"{path}: no usable rows" + (f" ({skipped})" if skipped else ""))
  return items


# --- preference pairs ---------------------------------------------------------------------------

def _response(messages: list[dict], field: str) -> str:
  if len(messages) != 1 or messages[0]["role"] != "assistant":
    raise BadRow(f"field {field!r}: expected one assistant message after the prompt")
  if not messages[0]["content"].strip():
    raise BadRow(f"field {field!r}: empty")
  return messages[0]["content"]


def _pair(row: Mapping, tok: Tokenizer, opts: DataOptions) -> Pair:
  """A pair from text fields, or from chat messages: `prompt` messages with one-message
  `chosen`/`rejected`, or (no `prompt`) two conversations whose shared head is the prompt."""
  prompt = row.get("prompt")
  if any(isinstance(row.get(f), list) for f in ("prompt", "chosen", "rejected")) \
      and not opts.renders_chat:
    raise BadRow("chat messages need data.chat=True")
  if isinstance(row.get("chosen"), list) or isinstance(row.get("rejected"), list):
    chosen, rejected = _messages(row, "chosen"), _messages(row, "rejected")
    if prompt is None:
      n = 0
      while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
        n += 1
      if not n:
        raise BadRow("'chosen' and 'rejected' share no prompt messages")
      prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    elif isinstance(prompt, str):
      prompt = _text(row, "prompt")
    else:
      prompt = _messages(row, "prompt")
    texts = _response(chosen, "chosen"), _response(rejected, "rejected")
  else:
    if not isinstance(prompt, (str, list)):
      raise BadRow("field 'prompt': missing" if prompt is None else "field 'prompt': not a string")
    if isinstance(prompt, list):
      prompt = _messages(row, "prompt")
    texts = _text(row, "chosen"), _text(row, "rejected")
  if texts[0] == texts[1]:
    raise BadRow("'chosen' and 'rejected' are identical")
  return Pair(_prompt(row, prompt, tok, opts), *texts)


def load_pairs(path: str, tok: Tokenizer,
               opts: DataOptions = DataOptions()) -> tuple[list[Pair], dict[str, int]]:
  """(pairs, bad-row counts). Fields are `prompt`, `chosen`, `rejected`; prompts are rendered as
  RL prompts are (template, chat), so a reward model scores what the policy sees."""
  tally = _Tally(opts.on_bad_row)
  pairs, wheres = _parse_rows(path, tally, lambda row: _pair(row, tok, opts))
  prompt_over = _over_limit(tok, [p.prompt for p in pairs], opts.max_prompt_tokens,
                            bos=not opts.renders_chat, eos=False)
  responses = [r for p in pairs for r in (p.chosen, p.rejected)]
  response_over = _over_limit(tok, responses, opts.max_completion_tokens, bos=False, eos=True)
  kept = []
  for n, (pair, where) in enumerate(zip(pairs, wheres)):
    longest = max(response_over[2 * n:2 * n + 2])
    if prompt_over[n]:
      tally.bad(where, "prompt longer than data.max_prompt_tokens",
                f" ({prompt_over[n]} > {opts.max_prompt_tokens})")
    elif longest:
      tally.bad(where, "response longer than rl.rollout.max_new_tokens",
                f" ({longest} > {opts.max_completion_tokens})")
    else:
      kept.append(pair)
  return _nonempty(path, kept, tally, opts), tally.by_reason()
