"""One GRPO step of jaxrl vs TRL's GRPOTrainer on the CPU, on a SmolLM2-135M-shaped model.

What a new user would run: the same Hugging Face directory on disk (LlamaForCausalLM with
SmolLM2-135M-Instruct's config, random seeded float32 weights, since no weights are reachable
offline), the same ChatML tokenizer and GSM8K-style prompts, 4 prompts x 4 samples, 64 new
tokens at temperature 1, one optimizer step per batch, a KL term of 0.001 (so both score the
frozen reference), no old-log-prob pass (one minibatch / one iteration), float32 compute in both,
token-mean loss (TRL's "dapo"), no activation checkpointing (TRL's default is on:
`--gradient_checkpointing` restores it).
Random weights almost never sample EOS, so every completion runs the 64-token budget in both.

    # 1. assets (jaxrl's venv has transformers and tokenizers): DIR/model, DIR/train.jsonl, ...
    .venv/bin/python benchmarks/trl_compare.py make-assets /tmp/trl_cmp
    # 2. TRL, from its own venv (never install into jaxrl's):
    python3 -m venv /tmp/trlvenv
    /tmp/trlvenv/bin/pip install torch==2.13.0 trl transformers datasets accelerate
    /tmp/trlvenv/bin/python benchmarks/trl_compare.py trl /tmp/trl_cmp --steps 4
    # 3. jaxrl (runs `python -m train.cli.train --config=configs/smollm2_135m_gsm8k_cpu.py ...`):
    .venv/bin/python benchmarks/trl_compare.py jaxrl /tmp/trl_cmp --steps 4

The last stdout line of `trl` / `jaxrl` is one JSON object: {"framework", "step_s": [seconds of
each step], "peak_rss_gb", ...}. Step 1 includes one-off costs (jaxrl compiles its programs
there), so compare the later steps.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CONFIG = "configs/smollm2_135m_gsm8k_cpu.py"
SEED = 0
# jaxrl's configs/hf_gsm8k.py PROMPT: the user message of each prompt.
PROMPT = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2-Instruct's chat template: a default system message, then ChatML turns.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + SYSTEM + "<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, intermediate_size=1536, rope_theta=100000.0,
    rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
    hidden_act="silu", initializer_range=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_assets(out: str) -> None:
  """DIR/train.jsonl, DIR/test.jsonl and DIR/model (config, safetensors, tokenizer)."""
  import tokenizers
  import torch
  import transformers
  from jaxrl.data import gsm8k_synth
  from jaxrl.data.tokenizer import load_tokenizer

  model_dir = os.path.join(out, "model")
  os.makedirs(model_dir, exist_ok=True)
  rows = gsm8k_synth.generate(4500, SEED, "medium")
  train, test = gsm8k_synth.split(rows, 500, SEED)
  gsm8k_synth.write_jsonl(train, os.path.join(out, "train.jsonl"))
  gsm8k_synth.write_jsonl(test, os.path.join(out, "test.jsonl"))

  # Byte-level BPE trained on the problems (and the prompt's instruction and system message).
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=8192, special_tokens=SPECIALS, show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  texts = [t for r in rows for t in (PROMPT.format(prompt=r["question"]), r["answer"])]
  tok.train_from_iterator(texts + [SYSTEM] * 100, trainer)
  tok.save(os.path.join(model_dir, "tokenizer.json"))
  tok_config = dict(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE,
                    bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
                    unk_token="<|endoftext|>", model_max_length=8192, padding_side="left",
                    add_bos_token=False, clean_up_tokenization_spaces=False)
  with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
    json.dump(tok_config, f, indent=2)

  # The model: SmolLM2-135M-Instruct's shape, HF's own init (std 0.02), seeded, float32.
  torch.manual_seed(SEED)
  config = transformers.LlamaConfig(**SMOLLM2_135M, torch_dtype="float32")
  model = transformers.LlamaForCausalLM(config).to(torch.float32)
  model.save_pretrained(model_dir, safe_serialization=True)
  transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                do_sample=True).save_pretrained(model_dir)

  # Both loaders must agree on the prompt's tokens.
  hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
  jx_tok = load_tokenizer(model_dir)
  lengths = []
  for r in test[:64]:
    messages = [{"role": "user", "content": PROMPT.format(prompt=r["question"])}]
    hf_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    hf_ids = list(hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys")
                  else hf_ids)
    jx_ids = jx_tok.encode(jx_tok.chat(messages), bos=False)
    assert hf_ids == jx_ids, (hf_ids, jx_ids)
    lengths.append(len(jx_ids))
  n_params = sum(p.numel() for p in model.parameters())
  print(f"wrote {len(train)} train / {len(test)} test rows and {model_dir}: {n_params / 1e6:.1f}M "
        f"params, tokenizer vocab {jx_tok.vocab_size}, chat prompts {min(lengths)}-{max(lengths)} "
        f"tokens (mean {sum(lengths) / len(lengths):.1f}); jaxrl and AutoTokenizer agree")


def _peak_rss_gb(who) -> float:
  return resource.getrusage(who).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


_ANSWER = re.compile(r"\\boxed\{([^{}]*)\}|####\s*([-\d,.]+)")


def _reward(completions, answer, **_):
  """1 when the last \\boxed{} or '#### N' of the completion equals the reference's '#### N'."""
  out = []
  for completion, ref in zip(completions, answer):
    text = completion[-1]["content"] if isinstance(completion, list) else completion
    found = _ANSWER.findall(text)
    got = (found[-1][0] or found[-1][1]).replace(",", "").strip() if found else None
    out.append(float(got == ref.rsplit("####", 1)[1].replace(",", "").strip()))
  return out


def run_trl(out: str, steps: int, gradient_checkpointing: bool) -> None:
  import datasets
  import torch
  import transformers
  import trl

  rows = [json.loads(l) for l in open(os.path.join(out, "train.jsonl"))]
  data = datasets.Dataset.from_list([
      {"prompt": [{"role": "user", "content": PROMPT.format(prompt=r["question"])}],
       "answer": r["answer"]} for r in rows[:4 * steps]])
  model_dir = os.path.join(out, "model")
  args = trl.GRPOConfig(
      output_dir=os.path.join(out, "trl_run"), use_cpu=True, bf16=False, fp16=False,
      per_device_train_batch_size=16, gradient_accumulation_steps=1, num_generations=4,
      max_completion_length=64, temperature=1.0, beta=0.001, num_iterations=1,
      learning_rate=1e-6, warmup_steps=10, max_grad_norm=1.0, max_steps=steps, loss_type="dapo",
      # TRL defaults to True; jaxrl's config keeps every activation (model.layers.remat="none").
      gradient_checkpointing=gradient_checkpointing,
      logging_steps=1, save_strategy="no", report_to="none", seed=SEED, use_vllm=False,
      dataloader_num_workers=0)
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  tok = transformers.AutoTokenizer.from_pretrained(model_dir, padding_side="left")
  times, begin = [], []

  class Timer(transformers.TrainerCallback):
    def on_step_begin(self, *a, **k):
      begin.append(time.perf_counter())

    def on_step_end(self, *a, **k):
      times.append(time.perf_counter() - begin[-1])
      print(f"step {len(times)}: {times[-1]:.2f} s", flush=True)

  trainer = trl.GRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=data,
                            processing_class=tok, callbacks=[Timer()])
  trainer.train()
  print(json.dumps({"framework": "trl", "step_s": [round(t, 3) for t in times],
                    "peak_rss_gb": round(_peak_rss_gb(resource.RUSAGE_SELF), 3),
                    "torch_threads": torch.get_num_threads(),
                    "gradient_checkpointing": gradient_checkpointing,
                    "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                                 "torch": torch.__version__}}))


def run_jaxrl(out: str, steps: int) -> None:
  run_dir = os.path.join(out, "jaxrl_runs")
  cmd = [sys.executable, "-m", "train.cli.train", f"--config={CONFIG}",
         f"--config.model.hf_path={os.path.join(out, 'model')}",
         f"--config.data.train_path={os.path.join(out, 'train.jsonl')}",
         f"--config.data.heldout_path={os.path.join(out, 'test.jsonl')}",
         f"--config.rl.steps={steps}", f"--config.run_dir={run_dir}",
         f"--config.run_name=smollm2_{time.strftime('%Y%m%d_%H%M%S')}", "--config.progress=False"]
  print(" ".join(cmd), flush=True)
  subprocess.run(cmd, cwd=REPO, check=True)
  path = max(glob.glob(os.path.join(run_dir, "*", "metrics.jsonl")), key=os.path.getmtime)
  rows = [r for r in map(json.loads, open(path)) if r.get("phase", "rl") == "rl"
          and "step_time" in r]
  split = {k: [round(r[k], 3) for r in rows] for k in
           ("time_generate", "time_score", "time_update")}
  import jax
  print(json.dumps({"framework": "jaxrl", "step_s": [round(r["step_time"], 3) for r in rows],
                    "peak_rss_gb": round(_peak_rss_gb(resource.RUSAGE_CHILDREN), 3), **split,
                    "metrics": path, "versions": {"jax": jax.__version__}}))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("mode", choices=["make-assets", "trl", "jaxrl"])
  parser.add_argument("dir", help="assets directory (model/, train.jsonl, test.jsonl)")
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--gradient_checkpointing", action="store_true",
                      help="trl: TRL's default activation checkpointing (off to match jaxrl)")
  a = parser.parse_args()
  if a.mode == "make-assets":
    make_assets(a.dir)
  elif a.mode == "trl":
    run_trl(a.dir, a.steps, a.gradient_checkpointing)
  else:
    run_jaxrl(a.dir, a.steps)


if __name__ == "__main__":
  main()
