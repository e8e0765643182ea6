"""GRPO on GSM8K from Llama-3.1-8B-Instruct on 8 x 80 GB accelerators: the trainer fsdp-shards
the actor and the reference over 4 of them, the sampler decodes on the other 4 (tensor parallel).
RoPE uses Llama 3.1's `llama3` frequency scaling, as its config.json says.

Check on a CPU first (a fake 8-device mesh, no weights; exit 1 if it would not fit):
  python -m train.cli.train --config=configs/llama3_1_8b_gsm8k.py --dry_run
Run:
  python -m train.cli.train --config=configs/llama3_1_8b_gsm8k.py \
      --config.model.hf_path=/models/Llama-3.1-8B-Instruct \
      --config.data.train_path=/data/gsm8k/train.jsonl --config.data.heldout_path=/data/gsm8k/test.jsonl
"""
from jaxrl.config_files import sibling

hf_gsm8k = sibling(__file__, "hf_gsm8k")

LLAMA3_1_8B = dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                   head_dim=128, d_ff=14336, norm_eps=1e-5, tie_embeddings=False,
                   scale_tied_head=False, dtype="bfloat16",
                   rope=dict(theta=500_000.0, scaling="llama3", factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_positions=8192))


def get_config():
  return hf_gsm8k.config(
      model=LLAMA3_1_8B,
      placement=hf_gsm8k.EIGHT_80GB)
