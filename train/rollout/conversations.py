"""Multi-turn partial rollouts: a stream of batches of conversations whose turns are requests to
in-flight slots (sampler/requests.py) that outlive weight swaps, driven by
train/rollout/partial.py exactly as single-turn rows are: `ConversationStream` is a
`sampler.stream.BatchStream`, laid out as its `StreamGeometry` says.

A batch opens with one environment per row (reset with its example) and its first turns
waiting for slots. At each look between decode segments the turns that finished get their
environments' replies (in threads) and the conversations that go on submit their next turn at
once, to the slot that kept their cache; a batch leaves, in index order, once every
conversation in it has ended. Weights swapped in between segments reach the turns in flight;
every token records the policy version it was drawn from (an environment's tokens take the
version of the turn before them), so the off-policy correction sees where each came from.

Keys: row r of batch i draws turn t from `fold_in(fold_in(rollout_key(seed, i), t), r)`, as a
whole batch's conversations do (train/rollout/multiturn.py), so with unchanged weights a batch
has the same ids whether it is streamed or generated whole (their log-probs equal to rounding:
the slots' widths differ).

Run state (`snapshot` / `restore`): the engine's slots and caches (bit for bit), the requests in
flight and waiting, and each open conversation's ids, log-probs, versions and turn spans. An
environment's state is not saved: `restore` makes new environments and replays each
conversation's turns into them (reset, then every turn's ids), which must give back the saved
replies and rewards (`NotReplayable` otherwise). Replay works with any environment whose
replies are a function of its example and the turns, which the protocol (jaxrl/envs/base.py)
asks of every environment and every shipped one is; a save/restore method would have asked
each environment for more code, and restarting turns in flight would not continue bit for bit.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from jaxrl.config import ConfigError
from jaxrl.envs import ContainedEnvironment, EnvError, Environment
from sampler.requests import Request, Requests
from sampler.sampler import Sampler
from sampler.stream import StreamGeometry
from train.rollout.multiturn import Conversation, MultiTurn, Turns


class NotReplayable(RuntimeError):
  """A restored conversation's environment replied otherwise than before the save."""


@contextlib.contextmanager
def _user_errors():
  """A user's environment that misbehaved stops the run with one line, as in whole batches."""
  try:
    yield
  except EnvError as e:
    raise ConfigError(f"config.rl.environment.name: {e}") from None


@dataclasses.dataclass
class TalkBatch:
  """A batch of the stream: its conversations (rows group-major, `n` per prompt)."""
  index: int
  prompts: dict  # host prompt batch: prompt_tokens, prompt_valid, examples
  keys: list  # each turn's key data
  version: int  # the weights' version as it opened
  talks: list[Conversation]
  versions: list[list[int]]  # per conversation, each id's policy version
  asked: list[int]  # per conversation, the turns submitted
  ended: list[bool]  # per conversation: no turn will follow

  def versions_BN(self, n: int) -> np.ndarray:
    out = np.full((len(self.talks), n), self.version, np.int32)
    for r, v in enumerate(self.versions):
      out[r, :len(v)] = v
      out[r, len(v):] = v[-1] if v else self.version
    return out

  def meta(self) -> dict:
    talks = [{"ids": t.ids, "policy": t.policy, "logprobs": t.logprobs, "reward": t.reward,
              "done": t.done, "turns": t.turns} for t in self.talks]
    return {"index": self.index, "version": self.version, "talks": talks,
            "versions": self.versions, "asked": self.asked, "ended": self.ended}


class ConversationStream:
  """`sampler`'s in-flight slots (one sample per row, ending at the environment's stop
  strings) running batches of conversations laid out as `geometry` says (`n` per prompt): a
  `sampler.stream.BatchStream`. `finish(talks, prompts)` makes a finished batch's rollout;
  `multiturn`: the generator's, whose threads the environments step in."""

  def __init__(self, sampler: Sampler, params, geometry: StreamGeometry, *, n: int,
               environment: Callable[[], Environment], turns: Turns, keep_cache: bool,
               finish: Callable, multiturn: MultiTurn):
    geometry.check(sampler.spec, n, conversations=True)
    self.n, self.geometry, self.turns = n, geometry, turns
    self.multiturn = multiturn
    self.rows = geometry.rows
    self._environment, self._finish = environment, finish
    self.engine = Requests(sampler.spec, params, context_width=geometry.prompt_width,
                           keep=keep_cache)
    self.batches: dict[int, TalkBatch] = {}
    self.next_index = self.next_emit = 0
    self.stride = 1  # (sampler/stream.py `BatchStream`)

  # -- the host's look between segments -----------------------------------------------------
  def poll(self) -> list[tuple[TalkBatch, object]]:
    """The environments' replies to the turns that finished, the next turns submitted, and
    the batches now complete, in index order (each with its rollout)."""
    done = self.engine.poll()
    where = [self.batches[tag[0]] for tag, *_ in done]
    with _user_errors():
      self.multiturn.reply_all([(b.talks[tag[1]], ids, logp)
                                for b, (tag, ids, logp, _) in zip(where, done)],
                               self.turns.max_new_tokens)
    for b, (tag, ids, _, versions) in zip(where, done):
      row = b.versions[tag[1]]
      row += versions
      row += [row[-1] if row else b.version] * (len(b.talks[tag[1]].ids) - len(row))
      self._ask(b, tag[1])
    out = []
    while (b := self.batches.get(self.next_emit)) is not None and all(b.ended):
      out.append((self.batches.pop(self.next_emit), self._finish(b.talks, b.prompts)))
      self.next_emit += self.stride
    return out

  def _ask(self, b: TalkBatch, r: int) -> None:
    """Row r's next turn, or its slot freed: its conversation has ended."""
    talk, turns = b.talks[r], self.turns
    if turns.goes_on(talk, b.asked[r]):
      prompt = b.prompts["prompt_tokens"][r // self.n][b.prompts["prompt_valid"][r // self.n]]
      self.engine.submit(Request((b.index, r), tuple(prompt.tolist()) + tuple(talk.ids),
                                 turns.budget(talk), b.keys[b.asked[r]], r))
      b.asked[r] += 1
    else:
      self.engine.release((b.index, r))
      b.ended[r] = True

  @property
  def free(self) -> int:
    return self.engine.free

  @property
  def decoding(self) -> bool:
    return self.engine.busy

  @property
  def unadmitted(self) -> int:
    return self.engine.waiting

  @property
  def open_batches(self) -> int:
    return len(self.batches)

  @property
  def version(self) -> int:
    return self.engine.version

  # -- weights, batches, turns ----------------------------------------------------------------
  def install(self, params, version: int) -> None:
    self.engine.install(params, version)

  def swap(self, params, version: int) -> None:
    self.engine.swap(params, version)

  def open(self, prompts: dict, key: np.ndarray) -> None:
    """Batch `next_index` joins the stream: its environments reset, its first turns wait for
    free slots."""
    if len(self.batches) >= self.geometry.live:
      raise RuntimeError(f"at most {self.geometry.live} batches are open at once")
    b = self._batch(self.next_index, prompts, key, self.version)
    for r, talk in enumerate(b.talks):
      b.versions.append([b.version] * len(talk.ids))
      self._ask(b, r)
    self.batches[b.index] = b
    self.next_index += self.stride

  def _batch(self, index: int, prompts: dict, key: np.ndarray, version: int) -> TalkBatch:
    """Batch `index` with its environments reset and nothing asked yet."""
    with jax.transfer_guard_host_to_device("allow"):  # (two integers)
      keys = self.multiturn.turn_keys(jax.random.wrap_key_data(np.asarray(key, np.uint32)),
                                      self.turns.max_turns)
    talks = [Conversation(self._environment(), r) for r in range(self.rows)]
    with _user_errors():
      for r, talk in enumerate(talks):
        talk.reset(prompts["examples"][r // self.n], self.turns.max_new_tokens)
    return TalkBatch(index, prompts, keys, version, talks, [], [0] * self.rows,
                     [False] * self.rows)

  def admit(self) -> None:
    self.engine.admit()

  def decode(self) -> None:
    """Continues the kept conversations, admits waiting turns, and decodes one segment."""
    self.engine.advance()

  # -- run state ------------------------------------------------------------------------------
  def snapshot(self) -> tuple[dict, dict]:
    arrays, engine = self.engine.snapshot()
    meta = {"engine": engine, "next_index": self.next_index, "next_emit": self.next_emit,
            "batches": [b.meta() for b in self.batches.values()],
            "shape": self.geometry.meta()}
    return arrays, copy.deepcopy(meta)  # (the stream's lists go on changing)

  def restore(self, arrays: dict, meta: dict, prompts, keys) -> None:
    """Puts back a `snapshot`, the environments replayed (NotReplayable: one replied
    otherwise, and nothing was changed); `prompts(i)` and `keys(i)` give batch i's prompts
    and key data."""
    meta = copy.deepcopy(meta)  # (its lists become the stream's)
    batches = {m["index"]: self._replayed(m, prompts(m["index"]), keys(m["index"]))
               for m in meta["batches"]}
    self.engine.restore(arrays, meta["engine"])
    self.batches = batches
    self.next_index, self.next_emit = meta["next_index"], meta["next_emit"]

  def _replayed(self, m: dict, prompts: dict, key) -> TalkBatch:
    """Batch `m` of a snapshot, its environments reset and replayed through its turns (the
    conversations' k-th turns at once); NotReplayable if one replies otherwise or fails."""
    b = self._batch(m["index"], prompts, key, m["version"])
    b.versions, b.asked, b.ended = m["versions"], m["asked"], m["ended"]
    saved = m["talks"]
    try:
      with contextlib.ExitStack() as uncounted:  # (a failure replayed was counted the first time)
        for t in b.talks:
          if isinstance(t.env, ContainedEnvironment):
            uncounted.enter_context(t.env.uncounted())
        for k in range(max((len(s["turns"]) for s in saved), default=0)):
          self.multiturn.reply_all(
              [(t, s["ids"][a:e], s["logprobs"][a:e]) for t, s in zip(b.talks, saved)
               if len(s["turns"]) > k for a, e in [s["turns"][k]]], self.turns.max_new_tokens)
    except EnvError as e:
      raise NotReplayable(f"batch {b.index}: {e}") from None
    for r, (talk, s) in enumerate(zip(b.talks, saved)):
      if (talk.ids, talk.reward, talk.done) != (s["ids"], s["reward"], s["done"]):
        raise NotReplayable(f"batch {b.index}, conversation {r}: its environment replied "
                            "otherwise when its turns were replayed (its replies must be a "
                            "function of its example and the turns)")
    return b
