"""Full-parameter GRPO on GSM8K from Llama-3.1-70B-Instruct on a TPU v5p-64 (32 chips of 95 GB):
every role colocated over all 32 chips (the trainer fsdp-shards the actor, its Adam state and the
reference 32 ways; the sampler decodes with the weights split 8 ways by tensor parallelism, 4
groups of rows), the update's activations recomputed except the projections (`remat=dots`).

Check the fit here first, estimated on 32 fake CPU devices and compiled by the TPU compiler:
  python -m train.cli.train --config=configs/llama3_1_70b_gsm8k.py --dry_run
  python -m train.cli.train --config=configs/llama3_1_70b_gsm8k.py --dry_run --target=v5p-64
Run (on the pod, every host the same command):
  python -m train.cli.train --config=configs/llama3_1_70b_gsm8k.py \
      --config.model.hf_path=/models/Llama-3.1-70B-Instruct \
      --config.data.train_path=/data/gsm8k/train.jsonl --config.data.heldout_path=/data/gsm8k/test.jsonl
"""
from jaxrl.config_files import sibling

hf_gsm8k = sibling(__file__, "hf_gsm8k")
LLAMA3_1_8B = sibling(__file__, "llama3_1_8b_gsm8k").LLAMA3_1_8B

LLAMA3_1_70B = {**LLAMA3_1_8B, "d_model": 8192, "n_layers": 80, "n_heads": 64, "d_ff": 28672,
                "layers": {"remat": "dots"}}


def get_config():
  return hf_gsm8k.config(
      model=LLAMA3_1_70B,
      placement=dict(strategy="colocate", cpu_devices=32, sampler_tensor=8,
                     device_memory_gb=95.0),
      rl=dict(prompts_per_step=32))  # 256 rollouts: 8 minibatches of one row per chip
