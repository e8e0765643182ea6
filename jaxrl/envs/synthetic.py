"""`synthetic`: a workload for measuring multi-turn speed (benchmarks/multiturn.py), not a task.
Every model turn is answered with the same `REPLY_TOKENS` token ids, and the conversation ends after
`TURNS` turns; with `rl.rollout.ignore_eos` and `rl.environment.max_turn_tokens` every turn has the
same length, so each rollout has a known shape: the agentic pattern of long tool outputs between
short model turns. `synthetic_longtail` ends a conversation after each turn with probability 1/4 (at
most `TURNS` turns): conversations of 1 to 8 turns, the long tail that holds a whole batch back.
`synthetic_short` is a small one for CPU tests. Its reward (the last step's) is a stand-in that
varies between rollouts (a function of the turn's ids), so the update has advantages to train on."""
from __future__ import annotations

from collections.abc import Callable

from jaxrl.data.tasks import Example
from jaxrl.data.tokenizer import Tokenizer
from jaxrl.envs.base import Step

TURNS = 8
REPLY_TOKENS = 100
_TEXT = " the tool printed the following lines of output, one value a line:"


class FixedReplies:
  turns_per_conversation, reply_tokens = TURNS, REPLY_TOKENS

  def __init__(self, tok: Tokenizer, verifier: Callable[[str, str], float]):
    del verifier  # nothing is checked
    ids, n = tok.encode(_TEXT, bos=False, eos=False), self.reply_tokens
    self.reply = (ids * (n // len(ids) + 1))[:n]
    self.stop_strings = ()
    self.turns = 0

  def reset(self, example: Example) -> list[int]:
    self.turns = 0
    return []

  def step(self, turn_ids: list[int]) -> Step:
    self.turns += 1
    done = self.turns >= self.turns_per_conversation
    return Step(list(self.reply), (sum(turn_ids) % 7) / 6 if done else 0.0, done)


class ShortReplies(FixedReplies):
  """`synthetic_short`: 3 turns answered with 4 ids each, conversations small enough for a
  multi-turn run on a laptop CPU (the kill-and-resume tests)."""
  turns_per_conversation, reply_tokens = 3, 4


class LongTail(FixedReplies):
  """`synthetic_longtail`: a turn whose ids sum to a multiple of 4 ends the conversation (a
  random policy: each turn with probability ~1/4), as does the 8th."""

  def step(self, turn_ids: list[int]) -> Step:
    step = super().step(turn_ids)
    if step.done or sum(turn_ids) % 4:
      return step
    return Step(step.observation, (sum(turn_ids) % 7) / 6, True)
