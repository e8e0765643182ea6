"""GRPO on GSM8K from Qwen2.5-0.5B-Instruct, on one 80 GB accelerator (everything colocated).

Check on a CPU first (no weights needed; exit 1 if it would not fit):
  python -m train.cli.train --config=configs/qwen2_5_0_5b_gsm8k.py --dry_run
Run:
  python -m train.cli.train --config=configs/qwen2_5_0_5b_gsm8k.py \
      --config.model.hf_path=/models/Qwen2.5-0.5B-Instruct \
      --config.data.train_path=/data/gsm8k/train.jsonl --config.data.heldout_path=/data/gsm8k/test.jsonl
"""
from jaxrl.config_files import sibling

hf_gsm8k = sibling(__file__, "hf_gsm8k")

QWEN2_5_0_5B = dict(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2,
                    head_dim=64, d_ff=4864, norm_eps=1e-6, tie_embeddings=True,
                    scale_tied_head=False, family="qwen2", dtype="bfloat16",
                    rope=dict(theta=1_000_000.0))


def get_config():
  return hf_gsm8k.config(
      model=QWEN2_5_0_5B,
      placement=dict(strategy="colocate", cpu_devices=1, train_devices=1, sampler_tensor=1,
                     device_memory_gb=80.0))
