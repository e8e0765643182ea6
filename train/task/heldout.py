"""Held-out evaluation of a policy on examples: scores, pass@k, lengths, and every sample.

One code path for the stages' held-out evaluation (`RunContext.evaluate`: greedy, one sample
per prompt, the mean score logged as `heldout_acc`) and for `jaxrl-eval` (train/cli/evaluate.py:
greedy, or `n` samples per prompt at a temperature, pass@k). Prompts go through the run's
encoding and length buckets in chunks of `eval.batch_size` (one compiled shape; the last chunk
padded by repeating its final prompt, whose extra rows are dropped), and are scored by the
run's reward (`rl.verifier`, or the environment's in multi-turn runs).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxrl.data.pipeline import prompt_batch
from jaxrl.data.tasks import Example
from train.rollout.generator import rollout_key


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased pass@k estimator (Chen et al., 2021): the chance that k of `n` samples, `c`
  of them correct, drawn without replacement include a correct one: 1 - C(n-c, k) / C(n, k)."""
  if not 1 <= k <= n:
    raise ValueError(f"pass@k: expected 1 <= k <= n={n}, got k={k}")
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclasses.dataclass
class Evaluation:
  """`n` samples of each example: scores [E, n], the policy's tokens per sample [E, n] and the
  decoded completions (E lists of n)."""
  examples: list[Example]
  scores_EN: np.ndarray
  lengths_EN: np.ndarray
  texts: list[list[str]]

  @property
  def n(self) -> int:
    return self.scores_EN.shape[1]

  def summary(self, ks=(1,), solved_at: float = 1.0) -> dict:
    """accuracy (the share of samples scoring >= `solved_at`), pass@k for each k (a prompt is
    solved by a sample scoring >= `solved_at`), the mean score and the mean length."""
    solved_EN = self.scores_EN >= solved_at
    out = {"examples": len(self.examples), "samples_per_example": self.n,
           "accuracy": float(solved_EN.mean())}
    correct_E = solved_EN.sum(1)
    for k in ks:
      out[f"pass@{k}"] = float(np.mean([pass_at_k(self.n, int(c), k) for c in correct_E]))
    out["reward_mean"] = float(self.scores_EN.mean())
    out["response_len"] = float(self.lengths_EN.mean())
    return out

  def records(self):
    """One dict per sample: example index, sample index, prompt, reference, completion, score,
    tokens."""
    for i, ex in enumerate(self.examples):
      for j in range(self.n):
        yield {"example": i, "sample": j, "prompt": ex.prompt, "answer": ex.answer,
               "completion": self.texts[i][j], "score": float(self.scores_EN[i, j]),
               "tokens": int(self.lengths_EN[i, j])}


def chunks(items: list, size: int):
  """Fixed-size chunks (one compiled shape) and how many items of each are real: the last is
  padded by repeating its final item."""
  for start in range(0, len(items), size):
    chunk = items[start:start + size]
    yield chunk + [chunk[-1]] * (size - len(chunk)), len(chunk)


def evaluate(generator, task, judge, params, examples: list[Example], *, batch_size: int,
             n: int = 1, temperature: float = 0.0, seed: int = 0) -> Evaluation:
  """`n` completions of each example from `params` (the sampler's copy, in its layout) on the
  run's `generator` (train/rollout/generator.py), prompts encoded as `task`'s, scored by `judge`
  (train/task/reward.py): greedy for `temperature` 0 (then n = 1), else sampled with
  `rollout_key(seed, chunk index)`."""
  if temperature == 0 and n != 1:
    raise ValueError(f"n: greedy decoding gives one completion per prompt, got n={n}")
  scores, lengths, texts = [], [], []
  for index, (chunk, real) in enumerate(chunks(examples, batch_size)):
    batch = prompt_batch(chunk, task.enc, task.prompt_len, task.buckets)
    if temperature == 0:
      rollout = generator.greedy(params, batch)
    else:
      rollout = generator.draw(params, batch, rollout_key(seed, index), n=n,
                               temperature=temperature)
    rows = [ex for ex in chunk for _ in range(n)]  # rows are group-major
    chunk_texts = judge.texts(rollout)
    scores.append(judge.rewards(rollout, rows, texts=chunk_texts)[:real * n])
    lengths.append(judge.lengths(rollout)[:real * n])
    texts += [chunk_texts[i * n:(i + 1) * n] for i in range(real)]
  return Evaluation(list(examples), np.concatenate(scores).astype(np.float64).reshape(-1, n),
                    np.concatenate(lengths).reshape(-1, n), texts)
