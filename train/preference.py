"""Preference stages: Bradley-Terry reward-model training and DPO of the actor.

Both read pairs from jsonl (`pairs_path`) or, when none is given, generate them from the task's
verifier and write them to the run dir first (`STAGE_pairs_train.jsonl`, `STAGE_pairs_heldout.jsonl`),
so the data a run used is always on disk in the format users supply.
"""
from __future__ import annotations

import logging
import os

import grain
import jax
import numpy as np
from tqdm.auto import tqdm

from jaxrl.config import ExperimentConfig
from jaxrl.data.pipeline import prompt_batch
from jaxrl.data.preferences import (Pair, pair_batch, pair_dataset, pair_lengths, read_jsonl,
                                    synthetic_pairs, write_jsonl)
from jaxrl.data.tasks import Example
from jaxrl.data.tokenizer import ByteTokenizer
from train.metrics import MetricsWriter

log = logging.getLogger("jaxrl")
HELDOUT_FRACTION = 0.1  # of a user's pairs file, held out for the accuracy / margin metric


def _chunks(items: list, size: int):
  """Fixed-size chunks (one compiled shape); the last is padded by repeating its final item."""
  for start in range(0, len(items), size):
    chunk = items[start:start + size]
    yield chunk + [chunk[-1]] * (size - len(chunk)), len(chunk)


def policy_samples(trainer, tok: ByteTokenizer, examples: list[Example], prompt_len: int,
                   seed: int) -> dict[str, list[str]]:
  """`group_size` completions per prompt from the current actor (the sampler's temperature)."""
  out, key, g = {}, jax.random.key(seed), trainer.cfg.rl.group_size
  for chunk, n in _chunks(examples, trainer.cfg.rl.prompts_per_step):
    key, sub = jax.random.split(key)
    rollout = trainer.sample(prompt_batch(chunk, tok, prompt_len), sub)
    completions_BN = np.asarray(rollout.tokens_BT)[:, prompt_len:]
    for i, ex in enumerate(chunk[:n]):
      out[ex.prompt] = [tok.decode(row) for row in completions_BN[i * g:(i + 1) * g]]
  return out


def load_pairs(pairs_path: str, train_set: list[Example], heldout: list[Example], verifier, *,
               per_prompt: int, seed: int, run_dir: str, stage: str,
               sample=None) -> tuple[list[Pair], list[Pair]]:
  """(train pairs, held-out pairs). A user's file is split 90/10 after a seeded shuffle;
  synthetic pairs come from the train and held-out prompts (disjoint) and are written out.
  `sample(examples, seed) -> {prompt: [completion, ...]}` adds the policy's wrong answers to
  the rejected candidates."""
  if pairs_path:
    pairs = read_jsonl(pairs_path)
    order = np.random.default_rng(seed).permutation(len(pairs))
    n_held = max(1, int(len(pairs) * HELDOUT_FRACTION))
    return [pairs[i] for i in order[n_held:]], [pairs[i] for i in order[:n_held]]
  out = []
  for name, examples, s in [("train", train_set, seed), ("heldout", heldout, seed + 1)]:
    path = os.path.join(run_dir, f"{stage}_pairs_{name}.jsonl")
    if not os.path.exists(path):
      samples = sample(examples, s) if sample is not None else None
      write_jsonl(synthetic_pairs(examples, verifier, per_prompt=per_prompt, seed=s,
                                  samples=samples), path)
    out.append(read_jsonl(path))
  return out[0], out[1]


def reward_accuracy(trainer, tok: ByteTokenizer, pairs: list[Pair], lengths, batch_size: int):
  """Held-out pairwise accuracy (score(chosen) > score(rejected)) and mean score margin."""
  correct, margin = 0.0, 0.0
  for chunk, n in _chunks(pairs, batch_size):
    b = pair_batch(chunk, tok, *lengths)
    chosen_B, rejected_B = np.split(np.asarray(trainer.reward_scores(b["tokens"], b["valid"])), 2)
    correct += float((chosen_B > rejected_B)[:n].sum())
    margin += float((chosen_B - rejected_B)[:n].sum())
  return correct / len(pairs), margin / len(pairs)


def train_reward_model(trainer, tok: ByteTokenizer, cfg: ExperimentConfig, train_pairs,
                       heldout_pairs, writer: MetricsWriter) -> dict:
  """Bradley-Terry training of a reward model initialised from the actor's trunk."""
  rm = cfg.reward_model
  trainer.init_reward_model()
  lengths = pair_lengths(train_pairs + heldout_pairs, tok)
  acc0, _ = reward_accuracy(trainer, tok, heldout_pairs, lengths, rm.batch_size)
  data = iter(pair_dataset(train_pairs, tok, batch_size=rm.batch_size, prompt_len=lengths[0],
                           response_len=lengths[1], seed=cfg.seed + 2))
  _train("reward_model", rm.steps, trainer.reward_model_step, data, writer, cfg.progress,
         {"loss": "loss", "accuracy": "acc"})
  acc, margin = reward_accuracy(trainer, tok, heldout_pairs, lengths, rm.batch_size)
  writer.write({"phase": "reward_model", "step": rm.steps, "heldout_pair_acc": acc,
                "heldout_margin": margin})
  log.info("reward model: held-out pairwise accuracy %.3f -> %.3f (%d pairs)", acc0, acc,
           len(heldout_pairs))
  return {"rm_heldout_pair_acc_init": acc0, "rm_heldout_pair_acc": acc,
          "rm_train_pairs": len(train_pairs), "rm_heldout_pairs": len(heldout_pairs)}


def _train(phase: str, steps: int, step_fn, data, writer: MetricsWriter, progress: bool,
           shown: dict[str, str]) -> None:
  """`steps` calls of `step_fn(next(data))`, logging every 10th (and the last) to `writer` and
  the bar; `shown` maps metric -> short name on the bar."""
  bar = tqdm(range(steps), desc=phase.replace("_", " "), disable=not progress,
             dynamic_ncols=True)
  for step in bar:
    m = jax.device_get(step_fn(next(data)))
    if step % 10 == 0 or step == steps - 1:
      writer.write({"phase": phase, "step": step, **m})
      bar.set_postfix({short: f"{m[key]:.3f}" for key, short in shown.items()})


def _sequence_logprobs(trainer, role, tok, pairs, lengths, batch_size) -> np.ndarray:
  """[n, 2] summed response log-probs (chosen, rejected) of each pair under `role`."""
  out = []
  for chunk, n in _chunks(pairs, batch_size):
    b = pair_batch(chunk, tok, *lengths)
    c, r = np.split(np.asarray(trainer.sequence_logprobs(role, b, lengths[0])), 2)
    out.append(np.stack([c, r], 1)[:n])
  return np.concatenate(out)


def run_dpo(trainer, tok: ByteTokenizer, cfg: ExperimentConfig, train_pairs, heldout_pairs,
            writer: MetricsWriter) -> dict:
  """DPO of the actor against a frozen copy of itself; reference log-probs computed once."""
  d = cfg.dpo
  lengths = pair_lengths(train_pairs + heldout_pairs, tok)
  mesh = trainer.placement.mesh("reference", trainer.devices)
  reference = trainer.actor.frozen_copy("reference", mesh, trainer.model_factory("reference"))
  ref_train = _sequence_logprobs(trainer, reference, tok, train_pairs, lengths, d.batch_size)
  ref_held = _sequence_logprobs(trainer, reference, tok, heldout_pairs, lengths, d.batch_size)
  del reference

  def batch_fn(items):
    b = pair_batch([p for p, _ in items], tok, *lengths)
    ref_N2 = np.stack([r for _, r in items])
    b["ref_logprobs"] = np.concatenate([ref_N2[:, 0], ref_N2[:, 1]]).astype(np.float32)
    return b

  data = iter(grain.MapDataset.source(list(zip(train_pairs, ref_train))).seed(cfg.seed + 3)
              .shuffle().repeat().batch(d.batch_size, drop_remainder=True, batch_fn=batch_fn))

  def heldout_margins() -> tuple[float, float]:
    """(chosen - rejected log-prob margin, DPO implicit-reward margin), held-out means."""
    pi = _sequence_logprobs(trainer, trainer.actor, tok, heldout_pairs, lengths, d.batch_size)
    implicit = d.beta * ((pi[:, 0] - ref_held[:, 0]) - (pi[:, 1] - ref_held[:, 1]))
    return float((pi[:, 0] - pi[:, 1]).mean()), float(implicit.mean())

  margin0, _ = heldout_margins()
  trainer.start_dpo(lengths[0])
  _train("dpo", d.steps, trainer.dpo_step, data, writer, cfg.progress,
         {"loss": "loss", "margin": "margin"})
  margin, implicit = heldout_margins()
  writer.write({"phase": "dpo", "step": d.steps, "heldout_logp_margin": margin,
                "heldout_implicit_margin": implicit})
  log.info("DPO: held-out chosen-rejected log-prob margin %.3f -> %.3f", margin0, margin)
  return {"dpo_heldout_logp_margin_init": margin0, "dpo_heldout_logp_margin": margin,
          "dpo_heldout_implicit_margin": implicit}
