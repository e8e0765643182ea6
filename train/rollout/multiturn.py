"""Multi-turn rollouts: the model and an environment (jaxrl/envs) take turns, token ids in and out.

Each row (a prompt's sample) holds its own environment. A turn decodes every unfinished row's
conversation so far (prompt, then the turns and replies, as ids) with the turn sampler, which
stops at EOS or at an environment's stop string (a tool call's closing tag); the environment
reads the turn's ids and returns the ids it appends, a reward and whether it is done. The
completion the trainer sees is the concatenation of exactly those ids: the model's (loss mask 1,
with the log-prob each was sampled with) and the environment's (loss mask 0). Nothing is
decoded and encoded again. A conversation ends when its environment says so, when
`max_turns` turns have run, or when it fills the `max_new_tokens` budget (replies are cut to
it). Its reward is the sum of its steps' rewards (the shipped tool environments reward only the
last step, so a conversation cut short scores 0 there).

With in-flight slots (`rl.rollout.inflight_slots > 0`) the turns are requests to
`sampler.requests.Requests`: a conversation's next turn is submitted as soon as its environment
has replied and takes the next free slot while the other rows keep decoding, so no row waits for
the others' turns (in-flight batching across turns). Otherwise turns decode as static batches
of the rows still talking (`Sampler.complete`: bucketed, so the batch shrinks through a few
compiled shapes). A turn's environment steps run at once, in threads (a hosted environment
or the Python tool waits on its process, so the processes work in parallel). Either way every
turn's key is fixed (`fold_in(key, turn)`, row r drawing from it as row r), so a batch's
conversations are a function of its key.

`MultiTurn` drives them and owns what they share: the threads the environments step in, and the
counts of what the conversations decoded (`stats`, read by benchmarks/multiturn.py). A run's is
its Generator's (train/rollout/generator.py), closed with it.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from jaxrl.envs import EnvError, Environment
from sampler import lowering
from sampler.engine import Rollout
from sampler.requests import WIDTH_STEP, Request
from sampler.sampler import Sampler
from sharding.rules import batch_ways
from train.io.host_transfers import HostTransfers
from train.io.tally import Tally


@dataclasses.dataclass
class Conversation:
  env: Environment
  index: int = 0  # its row (named when its environment fails)
  ids: list[int] = dataclasses.field(default_factory=list)
  policy: list[bool] = dataclasses.field(default_factory=list)  # which ids the model emitted
  logprobs: list[float] = dataclasses.field(default_factory=list)
  reward: float = 0.0  # summed over the steps
  done: bool = False
  turns: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # the model's spans

  def add(self, ids: Sequence[int], logprobs: Sequence[float] | None, budget: int) -> bool:
    """Appends up to the budget; False when the budget is full."""
    room = budget - len(self.ids)
    ids = list(ids)[:room]
    self.ids += ids
    self.policy += [logprobs is not None] * len(ids)
    self.logprobs += list(logprobs[:len(ids)]) if logprobs is not None else [0.0] * len(ids)
    return len(self.ids) < budget

  def reset(self, example, budget: int) -> None:
    with self._named():
      self.add(self.env.reset(example), None, budget)

  @contextlib.contextmanager
  def _named(self):
    try:
      yield
    except EnvError as e:
      raise EnvError(f"conversation {self.index}: {e}") from None

  def reply(self, turn_ids: list[int], logprobs: list[float], budget: int) -> bool:
    """Adds the model's turn and the environment's answer to it; whether the model goes on."""
    self.turns.append((len(self.ids), len(self.ids) + len(turn_ids)))
    room = self.add(turn_ids, logprobs, budget)
    with self._named():
      step = self.env.step(turn_ids)
    self.done, self.reward = step.done, self.reward + step.reward
    if room and not step.done:
      room = self.add(step.observation, None, budget)
    return room and not self.done


@dataclasses.dataclass(frozen=True)
class Turns:
  max_new_tokens: int  # a conversation's budget: the model's tokens and the replies
  max_turns: int
  max_turn_tokens: int = 0  # one turn's most tokens (0: what is left of the budget)

  def goes_on(self, talk: Conversation, asked: int) -> bool:
    """Whether `talk`, after `asked` turns, has a next one: not done, in budget, turns left."""
    return asked < self.max_turns and not talk.done and len(talk.ids) < self.max_new_tokens

  def budget(self, talk: Conversation) -> int:
    left = self.max_new_tokens - len(talk.ids)
    return min(left, self.max_turn_tokens) if self.max_turn_tokens else left


def pow2_multiple(n: int, unit: int) -> int:
  """The least `unit` * 2^k that is at least `n` (a few compiled sizes)."""
  return unit << max(0, -(-n // unit) - 1).bit_length()


def turn_engine(sampler: Sampler, rows: int, keep_cache: bool) -> Sampler:
  """The sampler a batch of `rows` conversations takes its turns with: with `keep_cache`, turns
  continue in the in-flight slots that kept their caches (as many slots as rows, unless the
  sampler has its own); else `sampler` as it is (its in-flight slots, or static batches of each
  conversation's whole context)."""
  if keep_cache and not sampler.inflight_slots:
    return sampler.variant(inflight_slots=slots_for(sampler, rows))
  return sampler


def context_width(longest_prompt: int) -> int:
  """The width of the in-flight slots' contexts for prompts of up to `longest_prompt` tokens (a
  few widths, each compiling the engine's programs once)."""
  return pow2_multiple(longest_prompt, WIDTH_STEP)


def turn_lowerings(sampler: Sampler, params, *, rows: int, prompt_width: int,
                   keep_cache: bool) -> lowering.Lowerings:
  """The programs `MultiTurn.converse` runs for `rows` conversations of prompts up to
  `prompt_width` tokens, lowered from abstract arguments (a target compile)."""
  turn = turn_engine(sampler, rows, keep_cache)
  if turn.inflight_slots:
    return lowering.requests(turn.spec, params, context_width(prompt_width))
  width = prompt_width + turn.cfg.max_new_tokens  # a turn's whole conversation, at the most
  return [("turns: generate (whole contexts)", lambda: turn.lower_complete(params, rows, width))]


def slots_for(sampler: Sampler, rows: int) -> int:
  """In-flight slots for `rows` conversations: the data shards times a power of two."""
  return pow2_multiple(rows, batch_ways(sampler.mesh, sampler.rules))


class MultiTurn:
  """Drives conversations (`converse`) and owns what they share: the threads a turn's
  environment steps run in at once (a hosted environment or the Python tool waits on its
  process, so the processes work in parallel), and `stats()`, what the conversations decoded
  (prefill_tokens (padded), new_tokens, admitted, continued, evicted, and emitted: the model's
  tokens). Used from any thread; `close` stops the threads. `transfers`: the run's named host
  transfers (the turns' keys come to the host)."""

  def __init__(self, transfers: HostTransfers | None = None, *, threads: int = 8):
    self.transfers = HostTransfers() if transfers is None else transfers
    self._steppers = concurrent.futures.ThreadPoolExecutor(threads,
                                                           thread_name_prefix="env-step")
    self._stats = Tally()
    self.closed = False

  def count(self, counts: Mapping[str, int]) -> None:
    self._stats.add(counts)

  def stats(self) -> dict[str, int]:
    """What the conversations decoded so far (a copy)."""
    return self._stats.snapshot()

  def clear_stats(self) -> None:
    self._stats.clear()

  def close(self) -> None:
    """Stops the threads (after the steps they run); later replies raise RuntimeError."""
    self.closed = True
    self._steppers.shutdown(wait=True, cancel_futures=True)

  def __enter__(self) -> MultiTurn:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def reply_all(self, turns: Sequence[tuple[Conversation, list, list]], budget: int
                ) -> list[bool]:
    """Each (conversation, turn ids, log-probs)'s reply, the environments' steps at once;
    whether each goes on, in order."""
    return list(self._steppers.map(lambda t: t[0].reply(t[1], t[2], budget), turns))

  def turn_keys(self, key: jax.Array, max_turns: int) -> list[np.ndarray]:
    """The key data of each turn of a batch drawn with `key`: turn t's is `fold_in(key, t)`."""
    return [self.transfers.to_host(jax.random.key_data(jax.random.fold_in(key, t)), "keys")
            for t in range(max_turns)]

  def converse(self, sampler: Sampler, params, prompts_B: Sequence[Sequence[int]],
               examples_B: Sequence, envs_B: Sequence[Environment], key: jax.Array, *,
               max_new_tokens: int, max_turns: int, max_turn_tokens: int = 0,
               keep_cache: bool = True, forced_B=None) -> list[Conversation]:
    """Runs each row's conversation (prompt ids `prompts_B[i]`, dataset row `examples_B[i]`)
    to its end; each turn's budget is what is left of the row's `max_new_tokens`, at most
    `max_turn_tokens` (0: no cap). `keep_cache`: turns continue in the slots that kept their
    conversations' caches (in-flight slots, as many as the rows unless the sampler has its
    own); else each turn prefills its whole conversation (in-flight slots if the sampler has
    them, else static batches). `forced_B[i][t]`: row i's turn t emitted again (a replay in a
    forced sampler's slots, `Sampler(forced=True)`, its environments replaying theirs)."""
    talks = [Conversation(env, i) for i, env in enumerate(envs_B)]
    for talk, example in zip(talks, examples_B):
      talk.reset(example, max_new_tokens)
    turns = Turns(max_new_tokens, max_turns, max_turn_tokens)
    sampler = turn_engine(sampler, len(talks), keep_cache)
    if sampler.inflight_slots:
      return self._inflight(sampler, params, prompts_B, talks, key, turns, keep_cache, forced_B)
    if forced_B is not None:
      raise ValueError("a replay of conversations runs in in-flight slots")
    for turn in range(max_turns):
      live = [i for i, t in enumerate(talks) if turns.goes_on(t, turn)]
      if not live:
        break
      self._static_turn(sampler, params, [list(prompts_B[i]) for i in live],
                        [talks[i] for i in live], jax.random.fold_in(key, turn), turns)
    return talks

  def _static_turn(self, sampler: Sampler, params, prompts: list[list[int]],
                   talks: list[Conversation], key: jax.Array, turns: Turns) -> None:
    """One turn of the conversations `talks` (prompt ids `prompts`) as a static batch."""
    out = sampler.complete(params, [q + t.ids for q, t in zip(prompts, talks)], key,
                           max_new_tokens=[turns.budget(t) for t in talks])
    p = out.tokens_BT.shape[1] - out.completion_mask_BN.shape[1]
    self.count(dict(prefill_tokens=out.tokens_BT.shape[0] * p, admitted=len(talks),
                    new_tokens=sum(len(q) + len(t.ids) for q, t in zip(prompts, talks)),
                    emitted=int(np.asarray(out.completion_mask_BN)[:len(talks)].sum())))
    masks = [np.asarray(out.completion_mask_BN[row], bool) for row in range(len(talks))]
    self.reply_all([(talk, np.asarray(out.tokens_BT[row, p:])[masks[row]].tolist(),
                     np.asarray(out.logprobs_BN[row])[masks[row]].tolist())
                    for row, talk in enumerate(talks)], turns.max_new_tokens)

  def _inflight(self, sampler: Sampler, params, prompts_B, talks: list[Conversation], key,
                turns: Turns, keep_cache: bool, forced_B=None) -> list[Conversation]:
    """The conversations' turns as requests to in-flight slots, each submitted as soon as the
    previous one's reply is in (to the slot that kept its cache, with `keep_cache`); turns
    given in `forced_B` are emitted again, each within its own length."""
    keys = self.turn_keys(key, turns.max_turns)
    engine = sampler.requests(params, context_width=context_width(max(map(len, prompts_B))),
                              keep=keep_cache)
    asked = [0] * len(talks)

    def ask(i: int) -> None:
      """Row i's next turn, or its slot freed: its conversation has ended."""
      talk = talks[i]
      if turns.goes_on(talk, asked[i]):
        forced = () if forced_B is None else tuple(forced_B[i][asked[i]])
        engine.submit(Request(i, tuple(prompts_B[i]) + tuple(talk.ids),
                              len(forced) or turns.budget(talk), keys[asked[i]], i, forced))
        asked[i] += 1
      else:
        engine.release(i)

    for i in range(len(talks)):
      ask(i)
    while engine.busy:
      done = engine.poll()
      self.reply_all([(talks[i], ids, logp) for i, ids, logp, _ in done], turns.max_new_tokens)
      for i, ids, *_ in done:
        self.count({"emitted": len(ids)})
        ask(i)  # (a conversation that is over, done or out of budget, frees its slot)
      engine.advance()
    self.count(engine.stats)
    return talks


def as_rollout(talks: Sequence[Conversation], tokens_BP: np.ndarray, valid_BP: np.ndarray, *,
               budget: int, pad_id: int) -> Rollout:
  """Host arrays of the conversations after their (left-padded) prompts, `budget` slots each."""
  b = len(talks)
  tokens_BN = np.full((b, budget), pad_id, np.int32)
  mask_BN, policy_BN = np.zeros((b, budget), bool), np.zeros((b, budget), bool)
  logprobs_BN = np.zeros((b, budget), np.float32)
  for r, talk in enumerate(talks):
    n = len(talk.ids)
    tokens_BN[r, :n], mask_BN[r, :n] = talk.ids, True
    policy_BN[r, :n], logprobs_BN[r, :n] = talk.policy, talk.logprobs
  return Rollout(tokens_BT=np.concatenate([tokens_BP, tokens_BN], 1),
                 valid_BT=np.concatenate([valid_BP, mask_BN], 1), completion_mask_BN=mask_BN,
                 logprobs_BN=logprobs_BN, lengths_B=mask_BN.sum(1).astype(np.int32),
                 loss_mask_BN=policy_BN,
                 rewards_B=np.array([t.reward for t in talks], np.float32))


