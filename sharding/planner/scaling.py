"""The simulator: the cost model on clusters we do not have, written into docs/scaling.md.

  python -m sharding.planner.scaling            # prints the generated blocks
  python -m sharding.planner.scaling --write    # and replaces them in docs/scaling.md

Every input is fixed here, before any prediction is made, and printed in the document ahead of
the comparison: the device tables and the default efficiency factors of devices.py (public
sources, never fitted to the published step times), the models' shapes, and each setting's
workload with its source. The document's prose sits outside the generated blocks
(`<!-- BEGIN name -->` ... `<!-- END name -->`), which `--write` replaces.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re

from jaxrl.models.llama import ModelConfig
from sharding.planner.cost import Workload
from sharding.planner.devices import DEVICES, Efficiency
from sharding.planner.search import Ranked, search

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "scaling.md")
_LLAMA = dict(vocab_size=128256, n_kv_heads=8, head_dim=128, tie_embeddings=False,
              dtype="bfloat16")
MODELS = {  # shapes from each model's config.json
    "Llama-3.1-8B": ModelConfig(d_model=4096, n_layers=32, n_heads=32, d_ff=14336, **_LLAMA),
    "Llama-3.1-70B": ModelConfig(d_model=8192, n_layers=80, n_heads=64, d_ff=28672, **_LLAMA),
    "Llama-3.1-405B": ModelConfig(d_model=16384, n_layers=126, n_heads=128, d_ff=53248,
                                  **_LLAMA),
    "Qwen3-32B": ModelConfig(vocab_size=151936, d_model=5120, n_layers=64, n_heads=64,
                             n_kv_heads=8, head_dim=128, d_ff=25600, tie_embeddings=False,
                             qk_norm=True, dtype="bfloat16"),
    "Qwen2.5-7B": ModelConfig(vocab_size=152064, d_model=3584, n_layers=28, n_heads=28,
                              n_kv_heads=4, head_dim=128, d_ff=18944, tie_embeddings=False,
                              qkv_bias=True, dtype="bfloat16"),
}

NEMO = ("NeMo-RL v0.4 performance summary (github.com/NVIDIA-NeMo/RL, "
        "docs/about/performance-summary.md), GRPO on OpenMathInstruct-2, DGX-H100, bf16")
LLAMARL = "LlamaRL (Meta, arXiv 2505.24034), as quoted in this project's issue 15"
# A math-RL step as NeMo-RL's Llama 3.1 8B recipe runs it: 2,048 samples (64 prompts x 32),
# 512 per optimizer step (4 minibatches, so old log-probs need their own pass), a KL reference,
# sequences of 1,060 tokens on average and at most 4,096. The prompt length is not published:
# 128 tokens is our assumption. A modern engine: in-flight (continuous) batching with a paged
# KV cache, and training on packed sequences (no padding).
ENGINE = dict(inflight=True, paged=True, packed=True)
MATH_8B = dict(prompts=64, group_size=32, prompt_len=128, new_tokens=4096 - 128,
               mean_new_tokens=1060 - 128, num_minibatches=4, old_pass=True, reference=True,
               **ENGINE)
# NeMo-RL's Qwen3-32B row: the same batch, sequences of 3,206 tokens on average.
MATH_32B = dict(MATH_8B, mean_new_tokens=3206 - 128)
# configs/qwen2_5_7b_gsm8k.py as it is: 16 prompts x 8, prompts up to 256 tokens, 512 new
# tokens, 8 minibatches, KL reference; jaxrl's engine (static batches, padded passes), with
# every response running to the budget.
GSM8K_7B = dict(prompts=16, group_size=8, prompt_len=256, new_tokens=512, num_minibatches=8,
                old_pass=True, reference=True)


@dataclasses.dataclass(frozen=True)
class Setting:
  name: str
  model: str
  device: str
  devices: int
  workload: dict  # Workload fields besides the model
  published: dict  # column -> published seconds per step ({} when there is none)
  source: str = ""

  def build(self) -> Workload:
    return Workload(model=MODELS[self.model], **self.workload)


# Columns: "sync" is the best colocated synchronous plan (the design of LlamaRL's baseline and
# of NeMo-RL's on-policy runs), "async" the best separated asynchronous one (LlamaRL's design;
# NeMo-RL's 1-step off-policy runs), "plan" the planner's choice among everything.
SETTINGS = (
    Setting("Llama-3.1-8B, 256 x H100", "Llama-3.1-8B", "h100", 256, MATH_8B,
            {"sync": 22.45, "async": 8.90}, LLAMARL),
    Setting("Llama-3.1-70B, 256 x H100", "Llama-3.1-70B", "h100", 256, MATH_8B,
            {"sync": 82.32, "async": 20.67}, LLAMARL),
    Setting("Llama-3.1-405B, 1024 x H100", "Llama-3.1-405B", "h100", 1024, MATH_8B,
            {"sync": 635.8, "async": 59.5}, LLAMARL),
    Setting("Llama-3.1-8B, 16 x H100", "Llama-3.1-8B", "h100", 16, MATH_8B,
            {"sync": 97.7, "async": 74.6}, NEMO),
    Setting("Qwen3-32B, 32 x H100", "Qwen3-32B", "h100", 32, MATH_32B, {"sync": 393.0}, NEMO),
    Setting("Qwen3-32B, 64 x H100", "Qwen3-32B", "h100", 64, MATH_32B, {"async": 215.0}, NEMO),
    Setting("Qwen2.5-7B, TPU v5p-32 (16 chips)", "Qwen2.5-7B", "tpu_v5p", 16, GSM8K_7B, {},
            "configs/qwen2_5_7b_gsm8k.py"),
)
COLUMNS = {"sync": ("colocate", "sync"), "async": ("separate", "async"), "plan": (None, None)}


def best(setting: Setting, column: str) -> Ranked | None:
  """The fastest plan of a column (None when nothing fits)."""
  strategy, mode = COLUMNS[column]
  w, dev = setting.build(), DEVICES[setting.device]
  modes = (mode,) if mode else ("sync", "async")
  ranked = search(w, setting.devices, dev, Efficiency(), modes=modes, presets_only=False,
                  top=None)
  ranked = [r for r in ranked if strategy is None or r.plan.strategy == strategy]
  return ranked[0] if ranked else None
