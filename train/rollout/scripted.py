"""Recorded conversations played again: `rl.rollout.exact="replay"` with an environment.

A conversation's row holds its environment's first message, then the model's turns (loss mask
1) each followed by the environment's reply (loss mask 0). `scripts` cuts a row back into
those pieces, and a `ScriptedEnv` answers each turn with the reply recorded after it, ending
the conversation after its last turn. With the turns emitted again in a forced sampler's
in-flight slots (train/rollout/multiturn.py `forced_B`), every request is submitted, continued
in its kept cache and prefilled as when the conversation was drawn, so the log-probs come out
of the same programs in the same shapes (train/loop/engine_replay.py).

A reply of no tokens leaves two turns adjacent, which the row cannot tell from one: such a
conversation replays as one longer turn (other shapes), and the mismatch metrics show it.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from jaxrl.envs.base import Step


@dataclasses.dataclass(frozen=True)
class Script:
  reset: list[int]  # the environment's first message
  turns: list[list[int]]  # the model's turns
  replies: list[list[int]]  # the environment's reply after each turn (maybe none)


def script(ids: list[int], policy: list[bool]) -> Script:
  """One conversation's pieces from its ids and which of them the model emitted."""
  runs = [(bool(k), [i for i, _ in group])
          for k, group in itertools.groupby(zip(ids, policy), key=lambda x: x[1])]
  reset = runs.pop(0)[1] if runs and not runs[0][0] else []
  turns, replies = [], []
  for is_policy, run in runs:
    if is_policy:
      turns.append(run)
      replies.append([])
    else:
      replies[-1] = run
  return Script(reset, turns, replies)


def scripts(tokens_BN: np.ndarray, mask_BN: np.ndarray, policy_BN: np.ndarray) -> list[Script]:
  """Each row's `Script` from a conversations rollout's completion slots (host arrays)."""
  out = []
  for ids, mask, policy in zip(tokens_BN, mask_BN, policy_BN):
    n = int(mask.sum())
    out.append(script(ids[:n].tolist(), policy[:n].tolist()))
  return out


class ScriptedEnv:
  """An environment that says what was recorded: its first message, then after turn t the
  reply recorded after it, done after the last turn (whatever the turn's ids: a replay feeds
  the recorded ones)."""
  stop_strings = ()

  def __init__(self, recorded: Script):
    self.recorded, self.turn = recorded, 0

  def reset(self, example) -> list[int]:
    del example
    self.turn = 0
    return list(self.recorded.reset)

  def step(self, turn_ids: list[int]) -> Step:
    del turn_ids
    t, self.turn = self.turn, self.turn + 1
    return Step(list(self.recorded.replies[t]), 0.0, t + 1 >= len(self.recorded.turns))
