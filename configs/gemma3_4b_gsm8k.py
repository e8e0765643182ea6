"""GRPO on GSM8K from Gemma-3-4B-it (its language model: the checkpoint's vision tower is not
read) on 8 x 80 GB accelerators: the trainer fsdp-shards the actor and the reference over 4 of
them, the sampler decodes on the other 4 (tensor parallel). Five of every six layers attend
within a sliding window of 1024 tokens (docs/models.md).

Check on a CPU first (a fake 8-device mesh, no weights; exit 1 if it would not fit):
  python -m train.cli.train --config=configs/gemma3_4b_gsm8k.py --dry_run
Run:
  python -m train.cli.train --config=configs/gemma3_4b_gsm8k.py \
      --config.model.hf_path=/models/gemma-3-4b-it \
      --config.data.train_path=/data/gsm8k/train.jsonl --config.data.heldout_path=/data/gsm8k/test.jsonl
"""
from jaxrl.config_files import sibling

hf_gsm8k = sibling(__file__, "hf_gsm8k")

# Gemma 3's local and global layers: a window of 1024, every 6th layer global (RoPE base 1e6,
# linear scaling 8), the others local (RoPE base 1e4).
GEMMA3 = dict(family="gemma3", head_dim=256, norm_eps=1e-6, tie_embeddings=True,
              scale_tied_head=False, dtype="bfloat16",
              attention=dict(sliding_window=1024, global_every=6, query_scale=256.0),
              rope=dict(theta=1_000_000.0, scaling="linear", factor=8.0, local_theta=10_000.0))
GEMMA3_4B = dict(GEMMA3, vocab_size=262208, d_model=2560, n_layers=34, n_heads=8, n_kv_heads=4,
                 d_ff=10240)


def get_config():
  return hf_gsm8k.config(
      model=GEMMA3_4B,
      placement=hf_gsm8k.EIGHT_80GB)
