"""The environment protocol of multi-turn rollouts: token ids in, token ids out.

An environment holds one conversation. `reset(example)` starts it on a dataset row and returns
the token ids to append before the model's first turn ([] for none). `step(turn_ids)` takes the
ids the model emitted in its turn (ending at EOS or at one of `stop_strings`, e.g. a tool call's
closing tag) and returns a `Step`: the observation ids appended after the turn (trained with
loss mask 0), a reward and whether the conversation is over. The ids the trainer sees are
exactly the ones the sampler emitted and the environment returned, never a re-tokenisation of
decoded text: an environment reads the model's turn as text if it likes, but what it appends it
encodes once, itself.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

from jaxrl.data.tasks import Example
from jaxrl.data.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Step:
  observation: list[int]  # token ids appended after the model's turn (loss mask 0)
  reward: float
  done: bool


class Environment(Protocol):
  stop_strings: Sequence[str]  # besides EOS, what ends a model turn

  def reset(self, example: Example) -> list[int]:
    ...

  def step(self, turn_ids: list[int]) -> Step:
    ...


# A tool's output, cut before it is encoded (the default of rl.environment.max_output_chars)
MAX_OUTPUT_CHARS = 2000


def cut(text: str, limit: int = MAX_OUTPUT_CHARS) -> str:
  """`text`, or its first `limit` characters and how many more there were."""
  if len(text) <= limit:
    return text
  return f"{text[:limit]} ... [{len(text) - limit} more characters cut]"


# (tokenizer, verifier(completion_text, answer) -> reward, **keywords) -> a new environment. The
# factory's keyword-only parameters are what it reads besides (jaxrl/registry.py
# `declared`): hyperparameters, fields of `rl.environment` by the same name (`max_output_chars`),
# and what the run provides (`sandbox`: the run's code sandbox, train/task/processes.py).
EnvironmentFactory = Callable[..., Environment]


class ToolEnvironment:
  """A model that calls one tool: `<TAG>input</TAG>` at the end of a turn is run by `run(input)`
  and answered with ` <RESULT>output</RESULT>` (errors too, as text the model can read; cut to
  `max_output_chars`, `rl.environment.max_output_chars`, before it is encoded); a turn
  without a call ends the conversation, scored by the verifier on the whole transcript (the
  model's turns and the tool's replies) against the row's answer."""
  tag = result_tag = ""

  def __init__(self, tok: Tokenizer, verifier: Callable[[str, str], float], *,
               max_output_chars: int = MAX_OUTPUT_CHARS):
    self.tok, self.verifier, self.max_output_chars = tok, verifier, max_output_chars
    self.stop_strings = (f"</{self.tag}>",)
    self.example: Example | None = None
    self.transcript: list[str] = []

  def run(self, text: str) -> str:
    raise NotImplementedError

  def reset(self, example: Example) -> list[int]:
    self.example, self.transcript = example, []
    return []

  def step(self, turn_ids: list[int]) -> Step:
    text = self.tok.decode(turn_ids)
    self.transcript.append(text)
    opening, closing = f"<{self.tag}>", f"</{self.tag}>"
    start = text.rfind(opening)
    if not text.rstrip().endswith(closing) or start < 0:
      return Step([], float(self.verifier("".join(self.transcript), self.example.answer)), True)
    # The leading space keeps the call's closing tag its own tokens (a BPE would merge "><").
    output = cut(str(self.run(text[start + len(opening):text.rfind(closing)])),
                 self.max_output_chars)
    reply = f" <{self.result_tag}>{output}</{self.result_tag}>"
    self.transcript.append(reply)
    return Step(self.tok.encode(reply, bos=False, eos=False), 0.0, False)
