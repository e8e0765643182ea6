"""LoRA GRPO on GSM8K from Qwen2.5-7B-Instruct on ONE 80 GB GPU: rank-16 adapters on every
projection train (alpha 32); the frozen bf16 base (14 GiB) is also the reference; the optimizer
state and the sampler's merged copy leave the device for the phases that do not use them
(placement.offload=all); the update recomputes attention (remat=dots).

Check on a CPU first (no weights; exit 1 if it would not fit):
  python -m train.cli.train --config=configs/qwen2_5_7b_gsm8k_lora.py --dry_run
Run:
  python -m train.cli.train --config=configs/qwen2_5_7b_gsm8k_lora.py \\
      --config.model.hf_path=/models/Qwen2.5-7B-Instruct \\
      --config.data.train_path=/data/gsm8k/train.jsonl --config.data.heldout_path=/data/gsm8k/test.jsonl
"""
from jaxrl.config_files import sibling

hf_gsm8k = sibling(__file__, "hf_gsm8k")
QWEN2_5_7B = sibling(__file__, "qwen2_5_7b_gsm8k").QWEN2_5_7B


def get_config():
  return hf_gsm8k.one_gpu_lora(QWEN2_5_7B)
