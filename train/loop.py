"""The experiment: SFT warm start, optional DPO, a reward model when the RL reward comes from
one, then RL driven by the single controller (train/controller.py, sync or async), evaluating
held-out greedy accuracy along the way.

A stop request (SIGTERM, or Ctrl-C) ends the run at the next step boundary with a checkpoint; a
failed executor stops it with the executor named; either way saved checkpoints stay intact.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.data.pipeline import (answer_length, prompt_batch, prompt_dataset, prompt_length,
                                 sft_dataset)
from jaxrl.data.preferences import read_jsonl
from jaxrl.data.tasks import Example, make_splits
from jaxrl.data.tokenizer import ByteTokenizer
from jaxrl.rewards.verifier import VERIFIERS
from train.checkpoint import Checkpointer, load_params
from train.controller import Controller, run_rl
from train.experience import verify
from train.metrics import MetricsWriter, plot_metrics
from train.preference import load_pairs, policy_samples, run_dpo, train_reward_model
from train.timeline import Timeline
from train.trainer import Trainer

log = logging.getLogger("jaxrl")


def evaluate(trainer: Trainer, tok: ByteTokenizer, examples: list[Example], length: int,
             batch_size: int, verifier, params=None) -> float:
  """Held-out accuracy of greedy decoding (with `params` in the sampler layout, default the
  sampler's copy); the last chunk is padded by repeating examples."""
  correct = 0.0
  for start in range(0, len(examples), batch_size):
    chunk = examples[start:start + batch_size]
    padded = chunk + [chunk[-1]] * (batch_size - len(chunk))
    batch = prompt_batch(padded, tok, length)
    rollout = trainer.greedy(batch, params)
    correct += verify(tok, rollout, batch["answers"], verifier)[:len(chunk)].sum()
  return float(correct) / len(examples)


def make_run_dir(cfg: ExperimentConfig) -> str:
  name = cfg.run_name or time.strftime("%Y%m%d-%H%M%S")
  run_dir = os.path.join(cfg.run_dir, name)
  if os.path.exists(os.path.join(run_dir, "checkpoints")):
    raise FileExistsError(f"config.run_name: {run_dir} already holds checkpoints; pick a new name")
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=2)
  return run_dir


class _Stopped(Exception):
  """Unwinds the remaining stages after a stop request (checkpoints already saved)."""


class StopRequest:
  """Set by SIGTERM / SIGINT (main thread only); the RL loop checks it between steps."""

  def __init__(self):
    self.event, self.signal, self._old = threading.Event(), None, {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    if self.event.is_set():  # a second Ctrl-C: stop now
      raise KeyboardInterrupt
    self.signal = signal.Signals(signum).name
    log.warning("%s: stopping after the current step and saving a checkpoint", self.signal)
    self.event.set()

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


def run(cfg: ExperimentConfig, run_dir: str) -> dict:
  """Runs the stages; returns a summary (also written to run_dir/summary.json)."""
  with StopRequest() as stop:
    return _run(cfg, run_dir, stop)


def _run(cfg: ExperimentConfig, run_dir: str, stop: StopRequest) -> dict:
  tok = ByteTokenizer()
  if cfg.model.vocab_size < tok.vocab_size:
    raise ConfigError(f"config.model.vocab_size: expected >= {tok.vocab_size} for the byte "
                      f"tokenizer, got {cfg.model.vocab_size}")
  verifier = VERIFIERS[cfg.task.verifier]
  train_set, heldout = make_splits(cfg.task.name, cfg.task.num_digits, cfg.task.n_train,
                                   cfg.task.n_heldout, cfg.seed, cfg.task.teacher_error)
  p_len = prompt_length(train_set + heldout, tok)
  # Users' pairs files are checked now, not after SFT: a bad row should cost seconds, not a run.
  for needed, path in [(cfg.dpo.steps > 0, cfg.dpo.pairs_path),
                       (cfg.rl.reward == "reward_model", cfg.reward_model.pairs_path)]:
    if needed and path:
      read_jsonl(path)
  try:  # placement and divisibility problems are user errors, found before any compile
    trainer = Trainer(cfg, prompt_len=p_len,
                      max_new_tokens=answer_length(train_set + heldout, tok) + 2,
                      eos_id=tok.eos_id, pad_id=tok.pad_id)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if cfg.init_checkpoint:
    try:
      params, step = load_params(cfg.init_checkpoint, trainer.actor.params)
    except ValueError as e:
      raise ConfigError(str(e)) from None
    trainer.actor.load(params)
    trainer.sync_sampler()
    log.info("actor initialised from %s (step %d)", cfg.init_checkpoint, step)
  writer = MetricsWriter(run_dir)
  sft_ckpt = Checkpointer(run_dir, "sft", 1)
  ckpt = Checkpointer(run_dir, "rl", cfg.keep_checkpoints)
  evaluate_now = lambda params=None: evaluate(trainer, tok, heldout, p_len, cfg.eval.batch_size,
                                              verifier, params)
  timeline = Timeline()
  summary = {"run_dir": run_dir, "heldout_acc_init": evaluate_now()}
  try:
    # SFT warm start.
    try:
      sft_iter = iter(sft_dataset(train_set, tok, batch_size=cfg.sft.batch_size, seed=cfg.seed,
                                  pack_length=cfg.sft.pack_length))
    except ValueError as e:  # an example longer than sft.pack_length
      raise ConfigError(str(e)) from None
    bar = tqdm(range(cfg.sft.steps), desc="sft", disable=not cfg.progress, dynamic_ncols=True)
    sft_done = 0
    for step in bar:
      if stop.event.is_set():
        break
      t0 = time.perf_counter()
      m = jax.device_get(trainer.sft_step(next(sft_iter)))
      sft_done = step + 1
      if step % 10 == 0 or step == cfg.sft.steps - 1:
        writer.write({"phase": "sft", "step": step, **m, "step_time": time.perf_counter() - t0})
        bar.set_postfix(loss=f"{m['loss']:.3f}")
    summary["heldout_acc_sft"] = acc = evaluate_now()
    writer.write({"phase": "rl", "step": 0, "heldout_acc": acc})
    sft_ckpt.save(sft_done, trainer.state.params, {"phase": "sft", "heldout_acc": acc})
    log.info("after SFT: held-out greedy accuracy %.3f", acc)
    if stop.event.is_set():
      raise _Stopped

    sample = lambda examples, seed: policy_samples(trainer, tok, examples, p_len, seed)
    if cfg.dpo.steps:
      pairs = load_pairs(cfg.dpo.pairs_path, train_set, heldout, verifier,
                         per_prompt=cfg.dpo.pairs_per_prompt, seed=cfg.seed, run_dir=run_dir,
                         stage="dpo",
                         sample=sample if cfg.dpo.policy_negatives else None)
      summary.update(run_dpo(trainer, tok, cfg, *pairs, writer))
      trainer.sync_sampler()
      summary["heldout_acc_dpo"] = acc = evaluate_now()
      dpo_ckpt = Checkpointer(run_dir, "dpo", 1)
      dpo_ckpt.save(cfg.dpo.steps, trainer.state.params, {"phase": "dpo", "heldout_acc": acc})
      dpo_ckpt.close()
      log.info("after DPO: held-out greedy accuracy %.3f", acc)
    if cfg.rl.reward == "reward_model":
      pairs = load_pairs(cfg.reward_model.pairs_path, train_set, heldout, verifier,
                         per_prompt=cfg.reward_model.pairs_per_prompt, seed=cfg.seed,
                         run_dir=run_dir, stage="reward_model",
                         sample=sample if cfg.reward_model.policy_negatives else None)
      summary.update(train_reward_model(trainer, tok, cfg, *pairs, writer))
      rm_ckpt = Checkpointer(run_dir, "reward_model", 1)
      rm_ckpt.save(cfg.reward_model.steps, trainer.reward.params,
                   {"phase": "reward_model", "heldout_pair_acc": summary["rm_heldout_pair_acc"]})
      rm_ckpt.close()

    # RL.
    trainer.sync_sampler()
    trainer.start_rl()
    prompts_iter = iter(prompt_dataset(train_set, tok, batch_size=cfg.rl.prompts_per_step,
                                       length=p_len, seed=cfg.seed + 1))
    controller = Controller(trainer, tok, verifier, timeline)
    bar = tqdm(total=cfg.rl.steps, desc=f"{cfg.rl.advantage} ({cfg.rl.mode})",
               disable=not cfg.progress, dynamic_ncols=True)
    rl_start = time.perf_counter()
    row: dict = {}

    def on_step(step: int, info: dict, metrics: dict) -> None:
      nonlocal row
      rewards_B, lengths_B = info["rewards_B"], info["lengths_B"]
      row = {"phase": "rl", "step": step, "reward_mean": float(rewards_B.mean()),
             "verified_mean": float(info["verified_B"].mean()), **metrics,
             "response_len": float(lengths_B.mean()),
             "samples": step * len(rewards_B),
             "tokens_per_s": float(lengths_B.sum()) / metrics["step_time"]}
      if step % cfg.eval.every == 0 or step == cfg.rl.steps:
        row["heldout_acc"] = evaluate_now(controller.sampler_params())
      if step % cfg.checkpoint_every == 0 or step == cfg.rl.steps:
        ckpt.save(step, trainer.state.params, {"phase": "rl", "policy_version": controller.version,
                                               **{k: row[k] for k in row if k == "heldout_acc"}})
      writer.write(row)
      bar.update(1)
      bar.set_postfix(reward=f"{row['reward_mean']:.2f}", step_s=f"{metrics['step_time']:.2f}",
                      lag=row["policy_lag"], acc=f"{row.get('heldout_acc', float('nan')):.2f}")

    try:
      controller.start(prompts_iter, cfg.seed)
      done = run_rl(controller, cfg.rl.steps, on_step, stop.event.is_set)
    finally:
      controller.close()
      bar.close()
    if done < cfg.rl.steps and done and ckpt.latest_step() != done:
      ckpt.save(done, trainer.state.params, {"phase": "rl", "policy_version": controller.version,
                                             "stopped": stop.signal})
    timeline_summary = timeline.summary(rl_start)
    summary.update(rl_steps_done=done, rl_wall_s=timeline_summary["wall_s"],
                   bubble=timeline_summary["bubble"],
                   **{f"busy_{k}": v for k, v in timeline_summary["busy"].items()})
    if stop.signal:
      summary["stopped"] = stop.signal
    log.info("RL timeline (trace.json): %s; bubble %.2f",
             ", ".join(f"{k} busy {v:.0%}" for k, v in timeline_summary["busy"].items()),
             timeline_summary["bubble"])
    summary["heldout_acc_rl"] = row.get("heldout_acc", acc)
  except _Stopped:
    summary["stopped"] = stop.signal
  finally:
    sft_ckpt.close()
    ckpt.close()
    writer.close()
    timeline.write_chrome_trace(os.path.join(run_dir, "trace.json"))
  plot_metrics(writer.path, os.path.join(run_dir, "metrics.png"))
  summary["sft_checkpoint_step"] = sft_ckpt.latest_step()
  summary["rl_checkpoint_step"] = ckpt.latest_step()
  with open(os.path.join(run_dir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  return summary
