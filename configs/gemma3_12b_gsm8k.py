"""GRPO on GSM8K from Gemma-3-12B-it (its language model) on 8 x 80 GB accelerators: the trainer
fsdp-shards the actor and the reference over 4 of them, the sampler decodes on the other 4
(tensor parallel); the update recomputes the blocks' attention and activations but their
projections' outputs (remat=dots).

Check on a CPU first (a fake 8-device mesh, no weights; exit 1 if it would not fit):
  python -m train.cli.train --config=configs/gemma3_12b_gsm8k.py --dry_run
Run:
  python -m train.cli.train --config=configs/gemma3_12b_gsm8k.py \
      --config.model.hf_path=/models/gemma-3-12b-it \
      --config.data.train_path=/data/gsm8k/train.jsonl --config.data.heldout_path=/data/gsm8k/test.jsonl
"""
from jaxrl.config_files import sibling

hf_gsm8k = sibling(__file__, "hf_gsm8k")
GEMMA3 = sibling(__file__, "gemma3_4b_gsm8k").GEMMA3

GEMMA3_12B = dict(GEMMA3, vocab_size=262208, d_model=3840, n_layers=48, n_heads=16, n_kv_heads=8,
                  d_ff=15360, layers=dict(remat="dots"))


def get_config():
  return hf_gsm8k.config(
      model=GEMMA3_12B,
      placement=hf_gsm8k.EIGHT_80GB)
