"""GSM8K-style math on the CPU: a tiny model from a Hugging Face directory, SFT on worked
solutions, then GRPO with the math-verify reward, all in a few minutes on 2 cores.

Everything comes from code (jaxrl/data/gsm8k_tiny.py, made on first use under data/gsm8k_tiny/):
procedural grade-school word problems in GSM8K's format (`... #### 42`), and a model directory
holding a randomly initialised 4-layer Llama written by the exporter with a BPE tokenizer trained
on the problems and a ChatML chat template. The run takes the path a real one does: weights from
`model.hf_path`, prompts from a jsonl through the chat template, answers by GSM8K's `####`
convention, rewards from math-verify.

SFT learns the `demo` field: an imperfect teacher's worked solutions, which on half of the
two-step problems stop after the first step (a systematic mistake, like the default
experiment's). GRPO's reward checks the true `#### N` of `answer` and trains the slip away.
Measured on 2 CPU cores: held-out accuracy 0.695 after SFT and 0.859 after 40 GRPO steps in
6 min on an Intel Xeon (2026-12-05), 0.680 and 0.836 in 4 min on an AMD EPYC (2026-11-26): XLA:CPU
rounds otherwise on each (docs/benchmarks.md, "The figures the README quotes").

Run:  .venv/bin/jaxrl-train --config=configs/gsm8k_tiny.py
"""
import os

from jaxrl.config import ExperimentConfig, config_dict
from jaxrl.data.gsm8k_tiny import ensure

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                      "gsm8k_tiny")


def get_config():
  assets = ensure(ASSETS)
  c = config_dict(ExperimentConfig())
  c.model.update(hf_path=os.path.join(assets, "model"))
  c.data.update(train_path=os.path.join(assets, "train.jsonl"),
                heldout_path=os.path.join(assets, "test.jsonl"), prompt_field="question",
                answer_field="answer", answer_format="gsm8k", completion_field="demo", chat=True,
                max_prompt_tokens=48)
  c.sft.update(steps=400, batch_size=64, learning_rate=1e-3, warmup_steps=20)
  c.rl.update(steps=40, prompts_per_step=32, group_size=8, learning_rate=1e-4, warmup_steps=5,
              verifier="math")
  c.rl.batching.update(num_minibatches=2)
  c.rl.rollout.update(max_new_tokens=64)
  c.rl.kl.update(coef=0.01)
  c.eval.update(every=10, batch_size=256)
  c.update(checkpoint_every=100)
  return c
