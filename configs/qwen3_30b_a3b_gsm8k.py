"""GRPO on GSM8K from Qwen3-30B-A3B (a mixture of experts: 48 layers of 128 experts, 8 per
token; 30.5B parameters, 3.3B active) on two nodes of 8 x H200 (141 GB): the trainer
fsdp-shards the actor, its Adam state and the reference over one node's 8, the sampler decodes
on the other 8 (tensor parallel over 4: the model's 4 KV heads; every expert's width split over
those 4, 2 groups of rows). The update recomputes all but the matrix products (`remat=dots`):
without it the blocked expert products' gathered weights, kept for the backward, need 145 GiB.
On 80 GB devices one node's trainer does not fit: what stays is 49.8 GiB of the 72 usable, and
the update's gradients 28.4 more. The sampler records each token's experts and the trainer replays
them (`model.moe.routing_replay="rollout"`: docs/models.md).

Check on a CPU first (a fake 16-device mesh, no weights; exit 1 if it would not fit):
  python -m train.cli.train --config=configs/qwen3_30b_a3b_gsm8k.py --dry_run
Run:
  python -m train.cli.train --config=configs/qwen3_30b_a3b_gsm8k.py \
      --config.model.hf_path=/models/Qwen3-30B-A3B \
      --config.data.train_path=/data/gsm8k/train.jsonl --config.data.heldout_path=/data/gsm8k/test.jsonl
"""
from jaxrl.config_files import sibling

hf_gsm8k = sibling(__file__, "hf_gsm8k")

QWEN3_30B_A3B = dict(family="qwen3_moe", vocab_size=151936, d_model=2048, n_layers=48,
                     n_heads=32, n_kv_heads=4, head_dim=128, d_ff=6144, norm_eps=1e-6,
                     tie_embeddings=False, scale_tied_head=False, dtype="bfloat16",
                     rope=dict(theta=1_000_000.0), layers=dict(remat="dots"),
                     moe=dict(experts=128, per_token=8, d_ff=768, norm_topk=True,
                              routing_replay="rollout", aux_loss=0.001))


def get_config():
  return hf_gsm8k.config(
      model=QWEN3_30B_A3B,
      placement=dict(strategy="separate", cpu_devices=16, train_devices=8, sampler_tensor=4,
                     device_memory_gb=141.0))
