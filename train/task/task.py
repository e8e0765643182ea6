"""The run's task: its tokenizer, its examples (data files or the synthetic task) with their
encoding, the RL prompt batches, and its reward (a verifier, or a user's function, contained),
which `Judge` applies to rollouts; `UserProcesses`, a run's processes of user code."""
from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable

import grain
import jax
import numpy as np

from jaxrl.config import ConfigError, ExperimentConfig, first_line
from jaxrl.config_rl import RLConfig, UserCodeConfig
from jaxrl.data.files import DataError
from jaxrl.data.pipeline import Encoding, prompt_dataset, prompt_length, target_length
from jaxrl.data.sources import DataOptions, load_examples
from jaxrl.data.tasks import Example, make_splits
from jaxrl.data.tokenizer import ByteTokenizer, Tokenizer, TokenizerError, load_tokenizer
from jaxrl.envs import (ENVIRONMENTS, ContainedEnvironment, EnvError, EnvHosts,
                        environment_factory)
from jaxrl.envs.code_sandbox import SandboxUnavailable
from jaxrl.envs.hosted import EnvCallError, HostRestarted
from jaxrl.rewards.user import RewardFnError, call_reward_fn
from jaxrl.rewards.verifier import VERIFIERS
from jaxrl.user_code import UserCodePool, UserCodeTimeout, WorkerDied, check_importable
from train.io.host_transfers import HostTransfers
from train.io.tally import Tally

log = logging.getLogger("jaxrl")
# (prompts, completions, examples) -> [B] float32 rewards
Reward = Callable[[list[str], list[str], list[Example]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class TaskData:
  train: list[Example]
  heldout: list[Example]
  enc: Encoding  # prompt and target token ids
  # The longest prompt (at most data.max_prompt_tokens): batches are left-padded to a bucket of it
  prompt_len: int
  buckets: int  # rl.batching.length_buckets
  max_new_tokens: int  # rl.rollout.max_new_tokens
  reward: Reward  # rl.verifier: a verifier, or a user function of the rows' fields
  verifier: Callable[[str, str], float]  # one completion against one reference answer
  prompts: grain.MapDataset  # RL prompt batches, read by index (the data position)
  skipped: dict  # bad rows skipped, by reason (the summary's data_skipped_rows)
  # Calls of user code scored 0 or ended (rl.user_code.on_error="zero"): "reward", "environment"
  user_code_errors: Tally = dataclasses.field(default_factory=Tally)
  user_code: bool = False  # a user's reward function or environment runs (contained)


class UserProcesses:
  """A run's processes of user code: the worker pool of its reward function and the host
  processes of its environment (`rl.verifier`, `rl.environment.name` as "package.module:name"),
  each started for its run and stopped by `close` (or, failing that, when this object is
  collected or the process exits). Two runs in one process never share a worker."""

  def __init__(self):
    self._lock = threading.Lock()
    self._started: list = []  # what `close` stops (each has its own close())
    self._closer = weakref.finalize(self, _close_all, self._started, self._lock)

  def pool(self, limits: UserCodeConfig, spec: str) -> UserCodePool:
    """Worker processes running the function `spec` under `limits` (`rl.user_code`)."""
    return self._own(UserCodePool(workers=limits.workers, timeout_s=limits.timeout_s,
                                  memory_gb=limits.memory_gb, preload=(spec,)))

  def hosts(self, limits: UserCodeConfig, spec: str, tok: Tokenizer,
            verifier: str) -> EnvHosts:
    """Host processes of the environment class `spec` under `limits`, for tokenizer `tok` (and
    the run's `verifier`, which the class is constructed with)."""
    return self._own(EnvHosts(spec, tok, verifier, workers=limits.workers,
                              timeout_s=limits.timeout_s, memory_gb=limits.memory_gb))

  def _own(self, started):
    with self._lock:
      if self._closer.alive:
        self._started.append(started)
        return started
    started.close()
    raise RuntimeError("the run's user-code processes are closed")

  @property
  def closed(self) -> bool:
    return not self._closer.alive

  def close(self) -> None:
    """Stops every process started here (once; later calls do nothing)."""
    self._closer()

  def __enter__(self) -> UserProcesses:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _close_all(started: list, lock: threading.Lock) -> None:
  with lock:
    stopping = list(started)
    started.clear()
  for each in stopping:
    each.close()


def make_reward(name: str, processes: UserProcesses, rl: RLConfig | None = None,
                report: Callable[[int], None] | None = None
                ) -> tuple[Reward, Callable[[str, str], float]]:
  """(batch reward, per-sample verifier) of `rl.verifier`: a built-in verifier of completions
  against reference answers, or `package.module:function` called with the batch's prompts,
  completions and row fields (the reference answer as `answer`), in worker processes of
  `processes`, contained by `rl.user_code.timeout_s` and `rl.user_code.on_error` (its failures
  told to `report`)."""
  if ":" not in name:
    verifier = VERIFIERS[name]
    return (lambda prompts, completions, examples: np.array(
        [verifier(c, ex.answer) for c, ex in zip(completions, examples)], np.float32)), verifier
  rl = rl or RLConfig()
  try:  # imported in worker processes only: an import that hangs or allocates takes no run
    check_importable(name, "reward function", "package.module:function", RewardFnError,
                     timeout_s=rl.user_code.timeout_s, memory_gb=rl.user_code.memory_gb)
  except RewardFnError as e:
    raise ConfigError(f"config.rl.verifier: {e}") from None
  pool = processes.pool(rl.user_code, name)

  def reward(prompts, completions, examples):
    return call_reward_fn(None, prompts, completions,
                          [{**ex.fields, "answer": ex.answer} for ex in examples], pool=pool,
                          spec=name, group=rl.group_size, policy=rl.user_code.on_error,
                          report=report)
  return reward, lambda text, answer: float(reward([""], [text], [Example("", answer)])[0])


def load_tokenizer_for(cfg: ExperimentConfig) -> Tokenizer:
  path = cfg.data.tokenizer_path or cfg.model.hf_path
  field = "data.tokenizer_path" if cfg.data.tokenizer_path else "model.hf_path"
  try:
    tok = load_tokenizer(path)
  except (TokenizerError, OSError) as e:
    raise ConfigError(f"config.{field}: {e}") from None
  if (cfg.data.chat or cfg.data.messages_field) and isinstance(tok, ByteTokenizer):
    raise ConfigError("config.data.chat: the byte tokenizer has no chat template; set "
                      "model.hf_path or data.tokenizer_path to a Hugging Face directory")
  if cfg.model.vocab_size < tok.vocab_size:
    raise ConfigError(f"config.model.vocab_size: expected >= {tok.vocab_size} for the tokenizer "
                      f"{path or '(bytes)'}, got {cfg.model.vocab_size}")
  return tok


def _synthetic(cfg: ExperimentConfig, enc: Encoding) -> tuple[list, list]:
  t = cfg.task
  try:
    train, heldout = make_splits(t.name, t.num_digits, t.n_train, t.n_heldout, cfg.seed,
                                 t.teacher_error)
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  for field, limit, need in [
      ("data.max_prompt_tokens", cfg.data.max_prompt_tokens, prompt_length(train + heldout, enc)),
      ("rl.rollout.max_new_tokens", cfg.rl.rollout.max_new_tokens,
       target_length(train + heldout, enc))]:
    if need > limit:
      raise ConfigError(f"config.{field}: the task {t.name!r} needs {need} tokens, got {limit}")
  return train, heldout


def _from_files(cfg: ExperimentConfig, tok: Tokenizer) -> tuple[list, list, dict]:
  d = cfg.data
  try:
    opts = dataclasses.replace(DataOptions.of(d),
                               max_completion_tokens=cfg.rl.rollout.max_new_tokens)
    train, skipped = load_examples(d.train_path, tok, opts, sft=cfg.sft.steps > 0)
    if d.heldout_path:
      heldout, held_skipped = load_examples(d.heldout_path, tok, opts)
    else:  # a tenth of the file at most, so most of it still trains
      if len(train) < 10:
        raise ConfigError(f"config.data.heldout_path: {d.train_path} has {len(train)} usable "
                          f"rows, too few to split a held-out set off; give a heldout_path")
      order = np.random.default_rng(cfg.seed).permutation(len(train))
      n = min(d.heldout_size, len(train) // 10)
      heldout, held_skipped = [train[i] for i in order[:n]], {}
      train = [train[i] for i in sorted(order[n:])]
  except DataError as e:
    raise ConfigError(str(e)) from None
  skipped = {f"train: {k}": v for k, v in skipped.items()}
  skipped.update({f"heldout: {k}": v for k, v in held_skipped.items()})
  return train, heldout[:d.heldout_size], skipped


def load_task(cfg: ExperimentConfig, tok: Tokenizer, processes: UserProcesses) -> TaskData:
  """The run's examples (data files, or the synthetic task), their encoding and reward (a
  user's function runs in `processes`)."""
  enc = Encoding(tok, chat=cfg.data.chat or bool(cfg.data.messages_field))
  if enc.chat and not cfg.data.train_path:
    raise ConfigError("config.data.chat: the synthetic task's prompts are plain text; chat "
                      "templates apply to data files (set data.train_path)")
  if cfg.data.train_path:
    train, heldout, skipped = _from_files(cfg, tok)
    for what, n in skipped.items():
      log.warning("data: skipped %d rows (%s)", n, what)
  else:
    (train, heldout), skipped = _synthetic(cfg, enc), {}
  errors = Tally()  # user code that misbehaved, under the "zero" policy
  reward, verifier = make_reward(cfg.rl.verifier, processes, cfg.rl, counter(errors, "reward"))
  p_len, buckets = cfg.data.max_prompt_tokens, cfg.rl.batching.length_buckets
  if buckets:  # the buckets split the lengths that occur: up to the data's longest prompt
    p_len = min(p_len, prompt_length(train + heldout, enc))
  return TaskData(train=train, heldout=heldout, enc=enc, prompt_len=p_len, buckets=buckets,
                  max_new_tokens=cfg.rl.rollout.max_new_tokens, reward=reward, verifier=verifier,
                  prompts=prompt_dataset(train, enc, batch_size=cfg.rl.prompts_per_step,
                                         length=p_len, seed=cfg.seed + 1, buckets=buckets),
                  skipped=skipped, user_code_errors=errors,
                  user_code=":" in cfg.rl.verifier or ":" in cfg.rl.environment.name)


def counter(errors: Tally, name: str) -> Callable[[int], None]:
  """`report(n)` adding n to `errors[name]`, from any thread (a turn's environments, and the
  verifiers they call, step in threads: multiturn.py)."""
  return lambda n: errors.add({name: n})


def environment_for(cfg: ExperimentConfig, tok: Tokenizer, task: TaskData,
                    processes: UserProcesses):
  """A zero-argument factory of the run's environment (`rl.environment.name`), or None; a user's
  class lives in host processes of `processes` (jaxrl/envs/hosted.py), contained
  (jaxrl/envs/contained.py),
  its failures counted in the task's `user_code_errors`. One environment is made here, so a
  constructor that fails (or a sandbox the kernel refuses) is a one-line config error."""
  rl = cfg.rl
  if not rl.environment.name:
    return None
  try:
    if rl.environment.name in ENVIRONMENTS or ":" not in rl.environment.name:
      factory = environment_factory(rl.environment.name)
      factory(tok, task.verifier)
      return lambda: factory(tok, task.verifier)
    # a user's class: imported in its host processes only (`hosts.new()`, within the time limit)
    hosts = processes.hosts(rl.user_code, rl.environment.name, tok, rl.verifier)
    hosts.new()
  except (EnvError, SandboxUnavailable) as e:
    raise ConfigError(f"config.rl.environment.name: {e}") from None
  except (EnvCallError, UserCodeTimeout, WorkerDied, HostRestarted) as e:
    raise ConfigError(f"config.rl.environment.name: {rl.environment.name}: the constructor failed: "
                      f"{first_line(e)}") from None
  count = counter(task.user_code_errors, "environment")
  return lambda: ContainedEnvironment(_new(hosts), name=rl.environment.name,
                                      policy=rl.user_code.on_error, report=count)


def _new(hosts: EnvHosts):
  """A new hosted environment; a failure to make it is the conversation's first failure."""
  try:
    return hosts.new()
  except Exception as e:  # noqa: BLE001 - user code: contained at its first call
    return _Failed(e)


class _Failed:
  """An environment whose construction failed: every call raises what it raised."""
  stop_strings = ()

  def __init__(self, error: Exception):
    self.error = error

  def reset(self, example):
    raise self.error

  def step(self, turn_ids):
    raise self.error


@jax.jit
def completion_tokens(rollout) -> jax.Array:
  """The generated part of a rollout's tokens, [B, N], sliced where the rollout lives."""
  return rollout.tokens_BT[:, rollout.tokens_BT.shape[1] - rollout.completion_mask_BN.shape[1]:]


def completion_texts(tok: Tokenizer, completions_BN: np.ndarray) -> list[str]:
  """Decoded completions (host); decoding stops at EOS."""
  return [tok.decode(row) for row in completions_BN]


class Judge:
  """The run's reward of rollouts: their environments' (multi-turn) or the task's reward of
  their completions, decoded on the host (the completions' token ids are all it fetches, as
  the run's named host transfers `transfers`)."""

  def __init__(self, tok: Tokenizer, task: TaskData, transfers: HostTransfers):
    self.tok, self.task, self.transfers = tok, task, transfers

  def rewards(self, rollout, examples, texts: list[str] | None = None) -> np.ndarray:
    """[B] rewards of a rollout of `examples` (group-major rows): its environments', or the
    task reward of its decoded `texts` (decoded here when not given)."""
    if rollout.rewards_B is not None:
      return self.transfers.to_host(rollout.rewards_B, "rewards")
    return self.score(self.texts(rollout) if texts is None else texts, examples)

  def texts(self, rollout) -> list[str]:
    """The rollout's completions, decoded on the host."""
    return completion_texts(self.tok, self.transfers.to_host(completion_tokens(rollout),
                                                             "completions"))

  def lengths(self, rollout) -> np.ndarray:
    """[B] the tokens the policy emitted in each row (an environment's replies left out)."""
    mask_BN = rollout.completion_mask_BN if rollout.loss_mask_BN is None else rollout.loss_mask_BN
    return self.transfers.to_host(mask_BN, "lengths").sum(1)

  def score(self, texts: list[str], examples) -> np.ndarray:
    """[B] rewards of completions `texts` of `examples` (rl.verifier)."""
    examples = list(examples)
    try:
      return self.task.reward([ex.prompt for ex in examples], texts, examples)
    except RewardFnError as e:  # the user's function misbehaved: a user error, named
      raise ConfigError(f"config.rl.verifier: {e}") from None
