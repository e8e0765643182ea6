"""Preference pairs for the DPO and reward-model stages: a user's jsonl, or synthetic ones.

Synthetic pairs come from the task's verifier (chosen: the answer; rejected: the teacher's
mistake, near misses and, with `policy_negatives`, the current policy's own wrong samples) and
are written to the run dir first (`STAGE_pairs_train.jsonl`, `STAGE_pairs_heldout.jsonl`), so the
data a run used is on disk in the format users supply, and a resumed run reads the same pairs.
"""
from __future__ import annotations

import dataclasses
import glob
import logging
import os
from typing import Any, Protocol

import jax
import numpy as np

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.data import sources
from jaxrl.data.files import DataError
from jaxrl.data.pipeline import prompt_batch
from jaxrl.data.preferences import Pair, synthetic_pairs, write_jsonl
from jaxrl.data.sources import DataOptions
from jaxrl.data.tasks import Example
from jaxrl.data.tokenizer import Tokenizer
from train.rollout.generator import Generator, rollout_key
from train.task.heldout import chunks
from train.task.data import TaskData
from train.task.reward import Judge

log = logging.getLogger("jaxrl")
HELDOUT_FRACTION = 0.1  # of a user's pairs file, held out for the accuracy / margin metric


class PairsContext(Protocol):
  """What the pairs read of the run (a `train.stages.context.RunContext` is one)."""
  cfg: ExperimentConfig
  tok: Tokenizer
  task: TaskData
  judge: Judge
  generator: Generator
  run_dir: str
  cluster: Any  # its `sampler_weights`: the current actor, to sample negatives from


def policy_samples(ctx: PairsContext, examples: list[Example],
                   seed: int) -> dict[str, list[str]]:
  """`group_size` completions per prompt from the current actor (the RL temperature)."""
  out, g, p = {}, ctx.cfg.rl.group_size, ctx.task.prompt_len
  params = ctx.cluster.sampler_weights.fresh()
  for i, (chunk, n) in enumerate(chunks(examples, ctx.cfg.rl.prompts_per_step)):
    texts = ctx.judge.texts(ctx.generator.sample(params, prompt_batch(chunk, ctx.task.enc, p),
                                                 rollout_key(seed, i)))
    for j, ex in enumerate(chunk[:n]):
      out[ex.prompt] = texts[j * g:(j + 1) * g]
  return out


def check_pairs_file(stage: str, path: str) -> None:
  """Fails before anything runs when a configured pairs file (`STAGE.pairs_path`: the stage's
  config section) does not exist."""
  if path and not glob.glob(path):
    raise ConfigError(f"config.{stage}.pairs_path: {path}: no such file")


def read_pairs_file(ctx: PairsContext, stage: str, path: str) -> tuple[list[Pair], dict]:
  """A user's pairs (jsonl / parquet; text, or chat messages with data.chat), prompts rendered
  as the RL prompts are, and the bad rows skipped, counted by reason (or they stop the run:
  data.on_bad_row)."""
  try:  # no token limits: the pair batches are sized from the pairs themselves
    opts = dataclasses.replace(DataOptions.of(ctx.cfg.data), max_prompt_tokens=0,
                               max_completion_tokens=0)
    pairs, skipped = sources.load_pairs(path, ctx.tok, opts)
  except DataError as e:
    raise ConfigError(f"config.{stage}.pairs_path: {e}") from None
  for reason, n in skipped.items():
    log.warning("%s: skipped %d rows of %s (%s)", stage, n, path, reason)
  return pairs, skipped


def load_pairs(ctx: PairsContext, stage: str, pairs_path: str, *, per_prompt: int,
               policy_negatives: bool) -> tuple[list[Pair], list[Pair], dict]:
  """(train pairs, held-out pairs, the summary entry of a user file's skipped rows: the stage
  keeps it). A user's file is split 90/10 after a seeded shuffle; synthetic pairs come from the
  train and held-out prompts (disjoint)."""
  seed = ctx.cfg.seed
  if pairs_path:
    pairs, skipped = read_pairs_file(ctx, stage, pairs_path)
    order = np.random.default_rng(seed).permutation(len(pairs))
    n_held = max(1, int(len(pairs) * HELDOUT_FRACTION))
    return ([pairs[i] for i in order[n_held:]], [pairs[i] for i in order[:n_held]],
            {f"{stage}_pairs_skipped_rows": skipped} if skipped else {})
  out = []
  for name, examples, s in [("train", ctx.task.train, seed), ("heldout", ctx.task.heldout, seed + 1)]:
    path = os.path.join(ctx.run_dir, f"{stage}_pairs_{name}.jsonl")
    if os.path.exists(path):
      try:  # as written: whole, by this run, in the users' format
        out.append(sources.load_pairs(path, ctx.tok, DataOptions(on_bad_row="error"))[0])
      except DataError as e:
        raise ConfigError(f"{e} (remove the file to generate the pairs again)") from None
      continue
    samples = policy_samples(ctx, examples, s) if policy_negatives else None
    pairs = synthetic_pairs(examples, ctx.task.verifier, per_prompt=per_prompt, seed=s,
                            samples=samples)
    if jax.process_index() == 0:  # whole or not at all: a killed run never leaves half a file
      write_jsonl(pairs, path + ".tmp")
      os.replace(path + ".tmp", path)
    out.append(pairs)
  return out[0], out[1], {}
