"""The synchronous experiment: SFT warm start, then GRPO (rollout -> score -> reference ->
advantage -> update), evaluating held-out greedy accuracy along the way."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.data.pipeline import answer_length, prompt_batch, prompt_dataset, prompt_length, sft_dataset
from jaxrl.data.tasks import Example, make_splits
from jaxrl.data.tokenizer import ByteTokenizer
from jaxrl.rewards.verifier import VERIFIERS
from sampler.engine import Rollout
from train.checkpoint import Checkpointer
from train.metrics import MetricsWriter, plot_metrics
from train.trainer import Trainer

log = logging.getLogger("jaxrl")


def score(tok: ByteTokenizer, rollout: Rollout, answers, verifier) -> tuple[np.ndarray, list[str]]:
  """Reward stage: decode completions on the host and verify each against its answer."""
  tokens_BT = np.asarray(rollout.tokens_BT)
  p = tokens_BT.shape[1] - rollout.completion_mask_BN.shape[1]
  texts = [tok.decode(row[p:]) for row in tokens_BT]
  return np.array([verifier(t, a) for t, a in zip(texts, answers)], np.float32), texts


def evaluate(trainer: Trainer, tok: ByteTokenizer, examples: list[Example], length: int,
             batch_size: int, verifier) -> float:
  """Held-out accuracy of greedy decoding; the last chunk is padded by repeating examples."""
  correct = 0.0
  for start in range(0, len(examples), batch_size):
    chunk = examples[start:start + batch_size]
    padded = chunk + [chunk[-1]] * (batch_size - len(chunk))
    batch = prompt_batch(padded, tok, length)
    rewards, _ = score(tok, trainer.greedy(batch), batch["answers"], verifier)
    correct += rewards[:len(chunk)].sum()
  return float(correct) / len(examples)


def rl_batch(trainer: Trainer, tok: ByteTokenizer, prompts: dict, key, reference, verifier,
             times: dict):
  """One rollout batch, ready for the update: group-major rows, G samples per prompt.

  Stages: rollout -> score -> reference/old log-probs -> advantages; `times` gets each one's
  wall time (seconds) as `time_<stage>`.
  """
  t0 = time.perf_counter()
  rollout = trainer.sample(prompts, key)
  t1 = time.perf_counter()
  answers_B = np.repeat(prompts["answers"], trainer.cfg.rl.group_size)
  rewards_B, _ = score(tok, rollout, answers_B, verifier)
  t2 = time.perf_counter()
  batch = {
      "tokens": rollout.tokens_BT, "valid": rollout.valid_BT,
      "completion_mask": rollout.completion_mask_BN,
      "old_logprobs": trainer.completion_logprobs(trainer.state.params, rollout),
      "ref_logprobs": trainer.completion_logprobs(reference, rollout),
      "advantages": trainer.advantages(rewards_B, rollout.completion_mask_BN),
  }
  batch = {k: np.asarray(v) for k, v in batch.items()}
  times.update(time_generate=t1 - t0, time_score=t2 - t1, time_logprobs=time.perf_counter() - t2)
  return batch, rewards_B, np.asarray(rollout.lengths_B)


def make_run_dir(cfg: ExperimentConfig) -> str:
  name = cfg.run_name or time.strftime("%Y%m%d-%H%M%S")
  run_dir = os.path.join(cfg.run_dir, name)
  if os.path.exists(os.path.join(run_dir, "checkpoints")):
    raise FileExistsError(f"config.run_name: {run_dir} already holds checkpoints; pick a new name")
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=2)
  return run_dir


def run(cfg: ExperimentConfig, run_dir: str) -> dict:
  """Runs SFT then GRPO; returns a summary (also written to run_dir/summary.json)."""
  tok = ByteTokenizer()
  if cfg.model.vocab_size < tok.vocab_size:
    raise ValueError(f"config.model.vocab_size: expected >= {tok.vocab_size} for the byte tokenizer")
  verifier = VERIFIERS[cfg.task.verifier]
  train_set, heldout = make_splits(cfg.task.name, cfg.task.num_digits, cfg.task.n_train,
                                   cfg.task.n_heldout, cfg.seed, cfg.task.teacher_error)
  p_len = prompt_length(train_set + heldout, tok)
  try:  # placement and divisibility problems are user errors, found before any compile
    trainer = Trainer(cfg, prompt_len=p_len,
                      max_new_tokens=answer_length(train_set + heldout, tok) + 2,
                      eos_id=tok.eos_id, pad_id=tok.pad_id)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  writer = MetricsWriter(run_dir)
  sft_ckpt, ckpt = Checkpointer(run_dir, "sft", 1), Checkpointer(run_dir, "rl", cfg.keep_checkpoints)
  evaluate_now = lambda: evaluate(trainer, tok, heldout, p_len, cfg.eval.batch_size, verifier)
  summary = {"run_dir": run_dir, "heldout_acc_init": evaluate_now()}
  try:
    # SFT warm start.
    sft_iter = iter(sft_dataset(train_set, tok, batch_size=cfg.sft.batch_size, seed=cfg.seed))
    bar = tqdm(range(cfg.sft.steps), desc="sft", disable=not cfg.progress, dynamic_ncols=True)
    for step in bar:
      t0 = time.perf_counter()
      m = jax.device_get(trainer.sft_step(next(sft_iter)))
      if step % 10 == 0 or step == cfg.sft.steps - 1:
        writer.write({"phase": "sft", "step": step, **m, "step_time": time.perf_counter() - t0})
        bar.set_postfix(loss=f"{m['loss']:.3f}")
    summary["heldout_acc_sft"] = acc = evaluate_now()
    writer.write({"phase": "rl", "step": 0, "heldout_acc": acc})
    sft_ckpt.save(cfg.sft.steps, trainer.state.params, {"phase": "sft", "heldout_acc": acc})
    log.info("after SFT: held-out greedy accuracy %.3f", acc)

    # GRPO.
    trainer.sync_sampler()
    reference = trainer.start_rl()
    prompts_iter = iter(prompt_dataset(train_set, tok, batch_size=cfg.rl.prompts_per_step,
                                       length=p_len, seed=cfg.seed + 1))
    key = jax.random.key(cfg.seed)
    bar = tqdm(range(1, cfg.rl.steps + 1), desc="grpo", disable=not cfg.progress, dynamic_ncols=True)
    for step in bar:
      t0 = time.perf_counter()
      key, sub = jax.random.split(key)
      times: dict = {}
      batch, rewards_B, lengths_B = rl_batch(trainer, tok, next(prompts_iter), sub, reference,
                                             verifier, times)
      t_update = time.perf_counter()
      n_mb = cfg.rl.num_minibatches
      metrics = [trainer.rl_step(trainer.put_batch({k: np.array_split(v, n_mb)[i]
                                                    for k, v in batch.items()}))
                 for i in range(n_mb)]
      m = {k: float(np.mean([jax.device_get(x[k]) for x in metrics])) for k in metrics[0]}
      times["time_update"] = time.perf_counter() - t_update
      transfer = trainer.sync_sampler()
      times.update(time_reshard=transfer.seconds, reshard_gbps=transfer.gbps)
      dt = time.perf_counter() - t0
      row = {"phase": "rl", "step": step, "reward_mean": float(rewards_B.mean()), **m, **times,
             "response_len": float(lengths_B.mean()), "step_time": dt,
             "tokens_per_s": float(lengths_B.sum()) / dt}
      if step % cfg.eval.every == 0 or step == cfg.rl.steps:
        row["heldout_acc"] = evaluate_now()
      if step % cfg.checkpoint_every == 0 or step == cfg.rl.steps:
        ckpt.save(step, trainer.state.params, {"phase": "rl", **{k: row[k] for k in row
                                                                   if k == "heldout_acc"}})
      writer.write(row)
      bar.set_postfix(reward=f"{row['reward_mean']:.2f}", step_s=f"{dt:.2f}",
                      acc=f"{row.get('heldout_acc', float('nan')):.2f}")
    summary["heldout_acc_rl"] = row["heldout_acc"] if cfg.rl.steps else acc
  finally:
    sft_ckpt.close()
    ckpt.close()
    writer.close()
  plot_metrics(writer.path, os.path.join(run_dir, "metrics.png"))
  summary["sft_checkpoint_step"] = sft_ckpt.latest_step()
  summary["rl_checkpoint_step"] = ckpt.latest_step()
  with open(os.path.join(run_dir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  return summary
