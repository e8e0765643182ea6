"""GRPO on GSM8K from Qwen2.5-3B-Instruct on a TPU v5e-16 (16 chips of 16 GB): every role on all
16 chips (colocated, the trainer fsdp 16), the decoder scanned with `dots` remat, two minibatches
of 64 rows, each one micro-batch. The TPU compiler puts its update's peak at 13.84 GiB of a chip's
14.90 (docs/benchmarks.md's target table); 768 new tokens do not fit without smaller micro-batches.

Check on a CPU first (no weights needed; compiles the step's programs with the TPU compiler):
  python -m train.cli.train --config=configs/qwen2_5_3b_gsm8k.py --dry_run --target=v5e-16
Run (on the slice, the same command on every host):
  python -m train.cli.train --config=configs/qwen2_5_3b_gsm8k.py \
      --config.model.hf_path=/models/Qwen2.5-3B-Instruct \
      --config.data.train_path=/data/gsm8k/train.jsonl --config.data.heldout_path=/data/gsm8k/test.jsonl
"""
from jaxrl.config_files import sibling

hf_gsm8k = sibling(__file__, "hf_gsm8k")

QWEN2_5_3B = dict(vocab_size=151936, d_model=2048, n_layers=36, n_heads=16, n_kv_heads=2,
                  head_dim=128, d_ff=11008, norm_eps=1e-6, tie_embeddings=True,
                  scale_tied_head=False, family="qwen2", dtype="bfloat16",
                  rope=dict(theta=1_000_000.0), layers=dict(remat="dots"))


def get_config():
  c = hf_gsm8k.config(
      model=QWEN2_5_3B,
      placement=dict(strategy="colocate", cpu_devices=16, device_memory_gb=16.0))
  c.rl.batching.update(num_minibatches=2, micro_batch_size=64)
  return c
