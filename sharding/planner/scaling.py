"""The simulator: the cost model on clusters we do not have, written to docs/scaling.md.

  python -m sharding.planner.scaling            # prints the tables
  python -m sharding.planner.scaling --write    # and rewrites docs/scaling.md

Every number that goes in is stated in the document before the comparison: the device tables
and the default efficiency factors of sharding/planner/devices.py (public sources, not fitted
to the published step times), the models' shapes, and each setting's workload.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from jaxrl.models.llama import ModelConfig
from sharding.planner.cost import Mesh, Plan, Workload, memory, stage_times, step_time
from sharding.planner.devices import DEVICES, Efficiency
from sharding.planner.search import search

MODELS = {
    "Llama-3.1-8B": ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                                n_kv_heads=8, head_dim=128, d_ff=14336, tie_embeddings=False,
                                dtype="bfloat16"),
    "Llama-3.1-70B": ModelConfig(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64,
                                 n_kv_heads=8, head_dim=128, d_ff=28672, tie_embeddings=False,
                                 dtype="bfloat16"),
    "Llama-3.1-405B": ModelConfig(vocab_size=128256, d_model=16384, n_layers=126, n_heads=128,
                                  n_kv_heads=8, head_dim=128, d_ff=53248, tie_embeddings=False,
                                  dtype="bfloat16"),
    "Qwen2.5-7B": ModelConfig(vocab_size=152064, d_model=3584, n_layers=28, n_heads=28,
                              n_kv_heads=4, head_dim=128, d_ff=18944, tie_embeddings=False,
                              qkv_bias=True, dtype="bfloat16"),
}


@dataclasses.dataclass(frozen=True)
class Setting:
  name: str
  model: str
  device: str
  devices: int
  workload: dict  # Workload fields besides the model
  published: dict  # mode -> published seconds per step ({} when there is none)
  source: str = ""
