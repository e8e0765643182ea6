"""The run's data: its tokenizer, its examples (data files or the synthetic task) with their
encoding, the RL prompt batches and the reward they are scored by (train/task/reward.py):
`TaskData`, made by `load_task`."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import grain
import numpy as np

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.data.files import DataError
from jaxrl.data.pipeline import Encoding, prompt_dataset, prompt_length, target_length
from jaxrl.data.sources import DataOptions, load_examples
from jaxrl.data.tasks import Example, make_splits
from jaxrl.data.tokenizer import ByteTokenizer, Tokenizer, TokenizerError, load_tokenizer
from train.io.tally import Tally
from train.task.processes import UserProcesses
from train.task.reward import Reward, counter, make_reward

log = logging.getLogger("jaxrl")


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


def _synthetic(cfg: ExperimentConfig, tok: Tokenizer, enc: Encoding) -> tuple[list, list, dict]:
  """The synthetic task's examples; with `data.heldout_path`, that file's are held out."""
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
  if not cfg.data.heldout_path:
    return train, heldout, {}
  heldout, skipped = _load(cfg.data.heldout_path, "heldout_path", tok, _options(cfg))
  return train, heldout[:cfg.data.heldout_size], {f"heldout: {k}": v for k, v in skipped.items()}


def _options(cfg: ExperimentConfig) -> DataOptions:
  try:
    return dataclasses.replace(DataOptions.of(cfg.data),
                               max_completion_tokens=cfg.rl.rollout.max_new_tokens)
  except DataError as e:
    raise ConfigError(f"config.{e}") from None


def _load(path: str, field: str, tok: Tokenizer, opts: DataOptions, *, sft: bool = False):
  """`load_examples`, its errors naming the config field that gave the file."""
  try:
    return load_examples(path, tok, opts, sft=sft)
  except DataError as e:
    raise ConfigError(f"config.data.{field}: {e}") from None


def _from_files(cfg: ExperimentConfig, tok: Tokenizer, enc: Encoding
                ) -> tuple[list, list, dict]:
  d = cfg.data
  opts = _options(cfg)
  train, skipped = _load(d.train_path, "train_path", tok, opts, sft=cfg.sft.steps > 0)
  if d.heldout_path:
    heldout, held_skipped = _load(d.heldout_path, "heldout_path", tok, opts)
  else:  # a tenth of the file at most, so most of it still trains
    if len(train) < 10:
      raise ConfigError(f"config.data.heldout_path: {d.train_path} has {len(train)} usable "
                        f"rows, too few to split a held-out set off; give a heldout_path")
    order = np.random.default_rng(cfg.seed).permutation(len(train))
    n = min(d.heldout_size, len(train) // 10)
    heldout, held_skipped = [train[i] for i in order[:n]], {}
    train = [train[i] for i in sorted(order[n:])]
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
  load = _from_files if cfg.data.train_path else _synthetic
  train, heldout, skipped = load(cfg, tok, enc)
  for what, n in skipped.items():
    log.warning("data: skipped %d rows (%s)", n, what)
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
