"""Preference pairs for reward-model training and DPO: jsonl in, padded token batches out.

A pairs file has one JSON object per line: `{"prompt": str, "chosen": str, "rejected": str}`
(`write_jsonl`; sources.load_pairs reads it, as it reads users' pairs files).
`synthetic_pairs` builds such a set offline from a verifiable task: `chosen` is the verified
answer, `rejected` a wrong one (the teacher's systematic mistake or a small corruption of the
answer), so the verifier prefers chosen over rejected on every pair.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence

import grain
import numpy as np

from jaxrl.data.pipeline import Encoding
from jaxrl.data.tasks import Example


@dataclasses.dataclass(frozen=True)
class Pair:
  prompt: str
  chosen: str
  rejected: str


def _corruptions(answer: str, rng: np.random.Generator) -> list[str]:
  """Near and far misses of `answer`: one or two characters changed, one dropped, two
  neighbours swapped, all characters shuffled."""
  out = []
  alphabet = sorted(set(answer) | set("0123456789abcdefghij"))
  substitute = lambda s, i: s[:i] + rng.choice([c for c in alphabet if c != s[i]]) + s[i + 1:]
  if answer:
    i = int(rng.integers(len(answer)))
    out += [substitute(answer, i), answer[:i] + answer[i + 1:]]
  if len(answer) > 1:
    i, j = rng.choice(len(answer), 2, replace=False)
    out += [substitute(substitute(answer, int(i)), int(j)),
            "".join(rng.permutation(list(answer)))]
    j = int(rng.integers(len(answer) - 1))
    out.append(answer[:j] + answer[j + 1] + answer[j] + answer[j + 2:])
  return out


def synthetic_pairs(examples: Sequence[Example], verifier: Callable[[str, str], float], *,
                    per_prompt: int, seed: int,
                    samples: Mapping[str, Sequence[str]] | None = None) -> list[Pair]:
  """Up to `per_prompt` pairs per example, each rejected answer checked wrong by `verifier`.

  Rejected candidates: the teacher's mistake, near misses of the answer and, when given, a
  policy's own `samples[prompt]` (its wrong ones), so a reward model also sees the mistakes the
  policy it will score actually makes."""
  rng = np.random.default_rng(seed)
  pairs = []
  for ex in examples:
    sampled = list((samples or {}).get(ex.prompt, ()))
    wrong = ([ex.mistake] if ex.mistake else []) + sampled + _corruptions(ex.answer, rng)
    wrong = [w for w in dict.fromkeys(wrong) if w.strip() and not verifier(w, ex.answer)]
    if not wrong:
      continue
    picks = rng.permutation(len(wrong))[:per_prompt]
    # The teacher's mistake is always kept when it exists: it is what the SFT policy produces.
    if ex.mistake and ex.mistake in wrong and 0 not in picks:
      picks[0] = 0
    pairs += [Pair(ex.prompt, ex.answer, wrong[k]) for k in picks]
  return pairs


def write_jsonl(pairs: Sequence[Pair], path: str) -> None:
  with open(path, "w", encoding="utf-8") as f:
    for p in pairs:
      f.write(json.dumps(dataclasses.asdict(p)) + "\n")


def pair_lengths(pairs: Sequence[Pair], enc: Encoding) -> tuple[int, int]:
  """(prompt_len, response_len) covering every pair: prompts as `enc` encodes them (a BOS, or a
  chat template's tokens), responses with EOS."""
  prompt = max(len(enc.prompt(p.prompt)) for p in pairs)
  response = max(len(enc.target(r)) for p in pairs for r in (p.chosen, p.rejected))
  return prompt, response


def pair_batch(pairs: Sequence[Pair], enc: Encoding, prompt_len: int,
               response_len: int) -> dict[str, np.ndarray]:
  """Chosen rows then rejected rows, [2B, P + R]: left-padded prompt, right-padded response.

  `completion_mask` [2B, R] marks the response tokens (incl. EOS), the layout of a rollout.
  """
  prompts = [enc.prompt(p.prompt) for p in pairs]
  responses = [enc.target(p.chosen) for p in pairs] + [enc.target(p.rejected) for p in pairs]
  prompt_tokens, prompt_valid = enc.tok.pad_left(prompts + prompts, prompt_len)
  resp_tokens, resp_valid = enc.tok.pad_right(responses, response_len)
  return {"tokens": np.concatenate([prompt_tokens, resp_tokens], 1),
          "valid": np.concatenate([prompt_valid, resp_valid], 1),
          "completion_mask": resp_valid}


def pair_dataset(pairs: Sequence[Pair], enc: Encoding, *, batch_size: int, prompt_len: int,
                 response_len: int, seed: int) -> grain.MapDataset:
  """Shuffled, repeated batches of `batch_size` pairs (2 * batch_size rows each)."""
  batch_fn = lambda ps: pair_batch(ps, enc, prompt_len, response_len)
  return (grain.MapDataset.source(list(pairs)).seed(seed).shuffle().repeat()
          .batch(batch_size, drop_remainder=True, batch_fn=batch_fn))
