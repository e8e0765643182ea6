"""GRPO on GSM8K from Qwen2.5-7B-Instruct on 8 x 80 GB accelerators: the trainer fsdp-shards
the actor and the reference over 4 of them, the sampler decodes on the other 4 (tensor parallel).

Check on a CPU first (a fake 8-device mesh, no weights; exit 1 if it would not fit):
  python -m train.cli.train --config=configs/qwen2_5_7b_gsm8k.py --dry_run
Run:
  python -m train.cli.train --config=configs/qwen2_5_7b_gsm8k.py \
      --config.model.hf_path=/models/Qwen2.5-7B-Instruct \
      --config.data.train_path=/data/gsm8k/train.jsonl --config.data.heldout_path=/data/gsm8k/test.jsonl
"""
from jaxrl.config_files import sibling

hf_gsm8k = sibling(__file__, "hf_gsm8k")

QWEN2_5_7B = dict(vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                  head_dim=128, d_ff=18944, norm_eps=1e-6, tie_embeddings=False,
                  scale_tied_head=False, family="qwen2", dtype="bfloat16",
                  rope=dict(theta=1_000_000.0))


def get_config():
  return hf_gsm8k.config(
      model=QWEN2_5_7B,
      placement=hf_gsm8k.EIGHT_80GB)
