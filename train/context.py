"""What every stage shares: config, tokenizer, task data, cluster, generator, logs, summary.

`RunContext` is built once per experiment (train/experiment.py) and handed to each stage; a stage
never reaches another stage, only this context.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import grain
import jax

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.data.pipeline import answer_length, prompt_batch, prompt_dataset, prompt_length
from jaxrl.data.tasks import Example, make_splits
from jaxrl.data.tokenizer import ByteTokenizer
from jaxrl.rewards.verifier import VERIFIERS
from train.cluster import RoleCluster
from train.experience import completion_texts, completion_tokens, verify
from train.generator import Generator
from train.metrics import MetricsWriter
from train.timeline import Timeline
from train.transfers import to_host


@dataclasses.dataclass(frozen=True)
class TaskData:
  train: list[Example]
  heldout: list[Example]
  prompt_len: int  # every prompt (BOS included) fits; prompts are left-padded to it
  max_new_tokens: int
  verifier: Callable[[str, str], float]
  prompts: grain.MapDataset  # RL prompt batches, read by index (the data position)


def load_task(cfg: ExperimentConfig, tok: ByteTokenizer) -> TaskData:
  if cfg.model.vocab_size < tok.vocab_size:
    raise ConfigError(f"config.model.vocab_size: expected >= {tok.vocab_size} for the byte "
                      f"tokenizer, got {cfg.model.vocab_size}")
  t = cfg.task
  try:
    train, heldout = make_splits(t.name, t.num_digits, t.n_train, t.n_heldout, cfg.seed,
                                 t.teacher_error)
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  p_len = prompt_length(train + heldout, tok)
  return TaskData(train=train, heldout=heldout, prompt_len=p_len,
                  max_new_tokens=answer_length(train + heldout, tok) + 2,
                  verifier=VERIFIERS[cfg.rl.verifier],
                  prompts=prompt_dataset(train, tok, batch_size=cfg.rl.prompts_per_step,
                                         length=p_len, seed=cfg.seed + 1))


class RunContext:

  def __init__(self, cfg: ExperimentConfig, run_dir: str, *, initialize: bool = True):
    """`initialize=False`: the actor stays abstract (a restore fills it)."""
    self.cfg, self.run_dir = cfg, run_dir
    self.tok = ByteTokenizer()
    self.task = load_task(cfg, self.tok)
    self.cluster = RoleCluster(cfg, initialize=initialize)
    self.generator = Generator(self.cluster, max_new_tokens=self.task.max_new_tokens,
                               eos_id=self.tok.eos_id, pad_id=self.tok.pad_id, rl=cfg.rl)
    self.timeline = Timeline()
    self.writer = MetricsWriter(run_dir, enabled=jax.process_index() == 0)
    self.summary: dict = {"run_dir": run_dir}
    self.samplers: dict = {}  # Experiment.sample's compiled samplers, by settings

  def texts(self, rollout) -> list[str]:
    """The rollout's completions, decoded on the host (their token ids are all it fetches)."""
    return completion_texts(self.tok, to_host(completion_tokens(rollout), "completions"))

  def evaluate(self, examples: list[Example] | None = None) -> float:
    """Held-out greedy accuracy of the newest policy."""
    examples = self.task.heldout if examples is None else examples
    params, correct = self.cluster.fresh_sampler_params(), 0.0
    for chunk, n in chunks(examples, self.cfg.eval.batch_size):
      batch = prompt_batch(chunk, self.tok, self.task.prompt_len)
      texts = self.texts(self.generator.greedy(params, batch))
      correct += verify(texts, batch["answers"], self.task.verifier)[:n].sum()
    return float(correct) / len(examples)


def chunks(items: list, size: int):
  """Fixed-size chunks (one compiled shape) and how many items of each are real: the last is
  padded by repeating its final item."""
  for start in range(0, len(items), size):
    chunk = items[start:start + size]
    yield chunk + [chunk[-1]] * (size - len(chunk)), len(chunk)
