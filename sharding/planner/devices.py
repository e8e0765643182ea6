"""Device tables and efficiency factors of the cost model (sharding/planner/cost.py).

`DeviceSpec` holds a device's datasheet numbers; `Efficiency` the fractions of them an RL step's
calls achieve, and their fixed costs. The defaults come from public sources (cited per field),
never from the results they are compared with in docs/scaling.md; `jaxrl-plan --calibrate`
replaces them with factors fitted on the machine at hand (sharding/planner/calibrate.py).
"""
from __future__ import annotations

import dataclasses

GB = 1e9
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  name: str
  matmul_flops: float  # dense bf16 matmul peak per device, FLOP/s (no sparsity)
  hbm_bytes_per_s: float  # memory bandwidth per device
  memory_bytes: float  # device memory
  link_bytes_per_s: float  # per device, one direction, inside a node (NVLink) or over ICI
  network_bytes_per_s: float  # per device, one direction, across nodes (NIC per GPU; TPU: ICI)
  devices_per_node: int  # GPUs per node, chips per TPU host
  shared_compute: bool = False  # fake CPU devices: one pool of cores for all of them
  source: str = ""


DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("H100 SXM 80GB", 989e12, 3.35e12, 80 * GB, 450 * GB, 50 * GB, 8,
                       source="NVIDIA H100 datasheet (bf16 dense 989 TFLOP/s, 3.35 TB/s, NVLink "
                              "900 GB/s both ways); 400 Gb/s NDR InfiniBand per GPU"),
    "h200": DeviceSpec("H200 SXM 141GB", 989e12, 4.8e12, 141 * GB, 450 * GB, 50 * GB, 8,
                       source="NVIDIA H200 datasheet (same compute as H100, 4.8 TB/s, 141 GB); "
                              "400 Gb/s NDR InfiniBand per GPU"),
    "a100": DeviceSpec("A100 SXM 80GB", 312e12, 2.04e12, 80 * GB, 300 * GB, 25 * GB, 8,
                       source="NVIDIA A100 datasheet (bf16 312 TFLOP/s, 2.04 TB/s, NVLink 600 "
                              "GB/s both ways); 200 Gb/s HDR InfiniBand per GPU"),
    "tpu_v4": DeviceSpec("TPU v4", 275e12, 1.2e12, 32 * GB, 150 * GB, 150 * GB, 4,
                         source="Google Cloud TPU v4 docs (275 TFLOP/s bf16, 1.2 TB/s, 32 GiB); "
                                "ICI 6 links x 50 GB/s, half counted one way"),
    "tpu_v5e": DeviceSpec("TPU v5e", 197e12, 0.819e12, 16 * GB, 100 * GB, 100 * GB, 8,
                          source="Google Cloud TPU v5e docs (197 TFLOP/s bf16, 819 GB/s, 16 GB, "
                                 "ICI 1600 Gbps)"),
    "tpu_v5p": DeviceSpec("TPU v5p", 459e12, 2.765e12, 95 * GB, 300 * GB, 300 * GB, 4,
                          source="Google Cloud TPU v5p docs (459 TFLOP/s bf16, 2,765 GB/s, 95 GB, "
                                 "ICI 4800 Gbps)"),
    "tpu_v6e": DeviceSpec("TPU v6e", 918e12, 1.64e12, 32 * GB, 200 * GB, 200 * GB, 8,
                          source="Google Cloud TPU v6e (Trillium) docs (918 TFLOP/s bf16, 1,640 "
                                 "GB/s, 32 GB, ICI 3,200 Gbps)"),
    "cpu": DeviceSpec("CPU (fake devices)", 2.2e11, 1.0e10, 24 * GIB, 1.0e10, 1.0e10, 8,
                      shared_compute=True,
                      source="the 2-core dev machine, float32, measured; `profile` re-measures"),
}


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """Fractions of the datasheet a call achieves, and fixed costs, for large models on GPUs and
  TPUs (the defaults); a calibration fits them to a machine."""
  # Llama 3 405B pre-training: 38-43% BF16 MFU on 16k H100s (Llama 3 paper, Table 4).
  train_mfu: float = 0.40
  # Forward-only passes have no backward's weight-gradient products to overlap: same order.
  forward_mfu: float = 0.45
  prefill_mfu: float = 0.45  # prefill is a forward pass over the prompts
  # Decode steps are bandwidth-bound at these batch sizes; the compute term rarely binds.
  decode_mfu: float = 0.30
  # vLLM / TensorRT-LLM decode reaches ~60-70% of HBM bandwidth at batch (public benchmarks).
  decode_hbm: float = 0.65
  # NCCL all-gather / reduce-scatter bus bandwidth: ~70-80% of the link (nccl-tests on HGX H100).
  link: float = 0.75
  call_overhead_s: float = 2e-3  # dispatch of one jitted program and its host sync
  layer_overhead_s: float = 2e-5  # kernel launches of one layer in one pass (~10 x 2 us)
  decode_step_overhead_s: float = 1e-3  # a decode step's sampling and loop control
  step_overhead_s: float = 0.5  # host work per RL step: reward, experience, metrics, logging
  # Products of width d run at d / (d + this) of the large-product efficiency; GPUs and TPUs
  # reach it from d of a few thousand, the widths of the models simulated here.
  matmul_half_dim: float = 1.0


# The 2-core dev machine (fake CPU devices), fitted by `jaxrl-plan --calibrate` there; the prior
# of a CPU calibration and the factors `strategy=plan` uses on a CPU without one.
CPU_EFFICIENCY = Efficiency(train_mfu=0.5, forward_mfu=0.5, prefill_mfu=0.4, decode_mfu=0.3,
                            decode_hbm=0.5, link=0.5, call_overhead_s=2e-3, layer_overhead_s=2e-4,
                            decode_step_overhead_s=1e-3, step_overhead_s=0.01,
                            matmul_half_dim=128.0)
