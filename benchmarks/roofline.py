"""The device's ceilings a benchmark divides by: the dense matmul peak and the memory bandwidth,
and the decode roofline (bytes a decode step must read / bandwidth).

On an accelerator both ceilings come from the planner's device table
(planner/devices.py: datasheet dense bf16 peak and HBM bandwidth); on a CPU, or a device
the table lacks, they are measured in this process (planner/measure.py), the matmul
peak in the model's compute dtype.
"""
from __future__ import annotations

import dataclasses

from jaxrl.models import flops
from jaxrl.models.config import ModelConfig

ITEMSIZE = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class Ceilings:
  matmul_flops_per_s: float  # per device
  memory_bytes_per_s: float  # per device (on a CPU: the host's, shared by its fake devices)
  shared: bool  # fake CPU devices: one pool of cores and one memory bus for all of them
  source: str  # the device table's entry, or "measured"


def device_ceilings(dtype: str) -> Ceilings:
  import jax

  from planner import measure
  from planner.devices import DEVICES
  from planner.plan import device_key
  device = jax.devices()[0]
  key = device_key(device)
  if key and key != "cpu":
    spec = DEVICES[key]
    return Ceilings(spec.matmul_flops, spec.hbm_bytes_per_s, False, f"device table: {spec.name}")
  return Ceilings(measure.matmul_flops_per_s(dtype=dtype), measure.memory_bytes_per_s(),
                  device.platform == "cpu", "measured")


def weight_bytes(cfg: ModelConfig) -> int:
  """Bytes of the weights one decode step reads, in the compute dtype (the sampler's copy): the
  per-token products and the LM head (the tied embedding is read once, as the head; an untied
  embedding only at the step's tokens; every expert of a mixture, which a batch of rows
  touches). Norms and biases (<0.1%) are left out."""
  return ITEMSIZE[cfg.dtype] * (flops.stored_matmul_params(cfg) + cfg.d_model * cfg.vocab_size)


def kv_bytes_per_position(cfg: ModelConfig) -> int:
  """Keys and values of one cached position of one row, all layers."""
  return ITEMSIZE[cfg.dtype] * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim


def decode_roofline_s(cfg: ModelConfig, rows: int, prompt_len: int, new_tokens: float, *,
                      weight_copies: int, bytes_per_s: float) -> float:
  """Seconds the decode steps of `rows` rows take at `bytes_per_s` if they only read what they
  must: each of the new_tokens - 1 steps (the first token comes from the prefill) reads the
  weights once per copy (`weight_copies`: data-parallel replicas) and each row's cache so far
  (its prompt and the tokens generated before it, as flops.generate_flops counts them)."""
  steps = max(new_tokens - 1, 0)
  positions = rows * steps * (prompt_len + (steps + 1) / 2)
  total = steps * weight_copies * weight_bytes(cfg) + positions * kv_bytes_per_position(cfg)
  return total / bytes_per_s
