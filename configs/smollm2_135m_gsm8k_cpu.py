"""GRPO on GSM8K-style problems from SmolLM2-135M-Instruct on the CPU: the jaxrl side of
benchmarks/trl_compare.py (one RL step of jaxrl vs TRL's GRPOTrainer).

4 prompts x 4 samples per step, 64 new tokens, one minibatch (one optimizer step per batch,
its gradient accumulated over 4-row micro-batches),
everything colocated on one CPU device, float32 compute (as TRL runs on a CPU). Evaluation runs
at the start and the end only, on 8 held-out prompts, outside the step times.

Assets (a SmolLM2-135M-shaped model with random weights, a ChatML tokenizer, jsonl problems):
  .venv/bin/python benchmarks/trl_compare.py make-assets /tmp/trl_cmp
Run:
  .venv/bin/jaxrl-train --config=configs/smollm2_135m_gsm8k_cpu.py \
      --config.model.hf_path=/tmp/trl_cmp/model --config.data.train_path=/tmp/trl_cmp/train.jsonl \
      --config.data.heldout_path=/tmp/trl_cmp/test.jsonl --config.rl.steps=4
"""
from jaxrl.config_files import sibling

hf_gsm8k = sibling(__file__, "hf_gsm8k")

SMOLLM2_135M = dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                    head_dim=64, d_ff=1536, norm_eps=1e-5, tie_embeddings=True,
                    scale_tied_head=False, dtype="float32", rope=dict(theta=100_000.0))


def get_config():
  c = hf_gsm8k.config(
      model=SMOLLM2_135M,
      placement=dict(strategy="colocate", cpu_devices=1, train_devices=1, sampler_tensor=1),
      # 4-row micro-batches: on this CPU the step took 17.0-17.3 s at a 7.35 GB peak, against
      # 21.0 s and 9.89 GB with the 16 rows at once (docs/benchmarks.md); the same update.
      rl=dict(steps=4, prompts_per_step=4, group_size=4, learning_rate=1e-6, warmup_steps=10,
              batching=dict(num_minibatches=1, micro_batch_size=4), rollout=dict(max_new_tokens=64),
              kl=dict(coef=0.001)))
  c.data.update(max_prompt_tokens=160, heldout_size=8)
  c.eval.update(every=1000, batch_size=8)
  return c
