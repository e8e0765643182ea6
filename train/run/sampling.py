"""`Experiment.sample`: completions of text prompts from the current policy, for a look at it.

Prompts are encoded with the run's tokenizer and decoded on the sampler mesh from the sampler's
copy of the actor, by variants of the RL's samplers (train/rollout/generator.py), through their
bucketed front end (`Sampler.complete`), so prompt lists of similar size reuse one compiled
program.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl.data.files import DataError
from jaxrl.data.sources import DataOptions, render_prompt
from sampler.sampler import Sampler
from train.rollout.generator import rollout_key
from train.stages.context import RunContext


@dataclasses.dataclass(frozen=True)
class Completion:
  text: str
  tokens: list[int]  # up to and including EOS
  logprobs: list[float]  # log-prob of each token under the distribution it was drawn from


def _sampler(ctx: RunContext, n: int, greedy: bool, max_new_tokens: int) -> Sampler:
  """The RL's sampler (greedy or not) for `n` samples of up to `max_new_tokens`, always the
  static engine (a variant, compiled once per settings)."""
  rl = ctx.generator.greedy_sampler if greedy else ctx.generator.sampler
  return rl.variant(n=n, max_new_tokens=max_new_tokens, inflight_slots=0)


def as_prompt(ctx: RunContext, text: str) -> str:
  """`text` as the run's data renders a prompt: through the chat template (with the system
  prompt) when `data.chat` is set."""
  plain = dataclasses.replace(DataOptions.of(ctx.cfg.data), prompt_template="{prompt}")
  opts = DataOptions.of(ctx.cfg.data) if ctx.cfg.data.train_path else plain
  try:
    return render_prompt(text, ctx.tok, opts)
  except DataError:  # the template names other row fields, which a bare prompt lacks
    return render_prompt(text, ctx.tok, plain)


def sample(ctx: RunContext, prompts: list[str], *, n: int = 1, greedy: bool = False,
           max_new_tokens: int | None = None, seed: int = 0) -> list[list[Completion]]:
  """`n` completions per prompt (greedy: the same one `n` times)."""
  max_new = max_new_tokens or ctx.task.max_new_tokens
  sampler = _sampler(ctx, n, greedy, max_new)
  ids = [ctx.task.enc.prompt(as_prompt(ctx, p)) for p in prompts]
  rollout = sampler.complete(ctx.cluster.sampler_weights.fresh(), ids, rollout_key(seed, 0))
  p = rollout.tokens_BT.shape[1] - rollout.completion_mask_BN.shape[1]
  out = []
  for i in range(len(prompts)):
    rows = []
    for r in range(i * n, (i + 1) * n):
      mask = np.asarray(rollout.completion_mask_BN[r], bool)
      tokens = np.asarray(rollout.tokens_BT[r, p:])[mask].tolist()
      rows.append(Completion(ctx.tok.decode(tokens), tokens,
                             np.asarray(rollout.logprobs_BN[r])[mask].tolist()))
    out.append(rows)
  return out
