"""What the real-size GSM8K configs share: GRPO from an instruct checkpoint, math-verify reward.

Not a config itself: `qwen2_5_0_5b_gsm8k.py`, `qwen2_5_7b_gsm8k.py` and `llama3_1_8b_gsm8k.py`
call `config(...)` with their model's dimensions (those of its config.json, so `--dry_run` can
check shardings and memory without the weights; `--config.model.hf_path` supplies the weights and
must agree) and their hardware.
"""
from jaxrl.config import ExperimentConfig, config_dict

PROMPT = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
# One node of 8 x 80 GB accelerators: the trainer fsdp-shards the actor and the reference over 4,
# the sampler decodes on the other 4 (tensor parallel).
EIGHT_80GB = dict(strategy="separate", cpu_devices=8, train_devices=4, sampler_tensor=4,
                  device_memory_gb=80.0)


def config(*, model: dict, placement: dict, rl: dict | None = None):
  c = config_dict(ExperimentConfig())
  c.model.update(model)
  c.placement.update(placement)
  c.sft.steps = 0  # an instruct model: straight to RL
  c.data.update(train_path="data/gsm8k/train.jsonl", heldout_path="data/gsm8k/test.jsonl",
                prompt_field="question", answer_field="answer", answer_format="gsm8k",
                prompt_template=PROMPT, chat=True, max_prompt_tokens=256)
  c.rl.update(steps=200, prompts_per_step=16, group_size=8, learning_rate=1e-6, warmup_steps=10,
              verifier="math")
  c.rl.batching.update(num_minibatches=8)
  c.rl.kl.update(coef=0.001)
  c.rl.rollout.update(max_new_tokens=512, temperature=1.0)
  c.rl.update(rl or {})
  c.eval.update(every=20, batch_size=64)
  c.update(checkpoint_every=50, checkpoint_minutes=30.0, run_name="")
  return c


def one_gpu_lora(model: dict, rank: int = 16):
  """`config` for one 80 GB accelerator with LoRA (configs/*_lora.py): actor, reference and
  sampler colocated on it, rank-`rank` adapters (alpha 2 x rank) at 10x the full-parameter
  learning rate, idle state offloaded, attention recomputed in the update."""
  c = config(model={**model, "layers": {**model.get("layers", {}), "remat": "dots"}},
             placement=dict(strategy="colocate", cpu_devices=1, sampler_tensor=1,
                            device_memory_gb=80.0, offload="all"),
             rl=dict(learning_rate=1e-5))
  c.lora.update(rank=rank, alpha=2.0 * rank)
  return c
