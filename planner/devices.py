"""Device tables and efficiency factors of the cost model (planner/cost.py).

`DeviceSpec` holds one accelerator's datasheet numbers: dense bf16 matmul peak, HBM bandwidth and
size, and per-device one-way bandwidth inside a node (`link`) and across nodes (`network`).
`Efficiency` holds the fractions of them an RL step's calls achieve, and their fixed costs. The
defaults come from public sources (cited per entry and field), never from the results they are
compared with in docs/scaling.md; `jaxrl-plan --calibrate` replaces them with factors fitted on
the machine at hand (planner/calibrate.py).

TPU links: `link` is what a ring over one torus axis gets inside a host (two ICI links, one way
each, the scaling book's "bidi per link"); `network` is every ICI port of the chip one way (half
of Google's bidirectional per-chip ICI figure), what a collective spanning a multi-host slice
can use; `dcn` is the chip's share of its host's data-center network, what a collective across
slices (Multislice) gets, and what a crossing between processes (sharding/crossing.py: JAX's
cross-host transfers, not ICI collectives) gets on a TPU. `slice_devices` says where a slice
ends (0: every device in one).
"""
from __future__ import annotations

import dataclasses

GB = 1e9
GIB = 2**30
_TPU = "https://cloud.google.com/tpu/docs/"
_BOOK = "ICI per link one way: https://jax-ml.github.io/scaling-book/tpus/"


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  name: str
  matmul_flops: float  # dense bf16 matmul peak per device, FLOP/s (no sparsity)
  hbm_bytes_per_s: float  # memory bandwidth per device
  memory_bytes: float  # device memory (HBM) capacity
  link_bytes_per_s: float  # per device, one direction, inside a node (NVLink) or over ICI
  network_bytes_per_s: float  # per device, one direction, across nodes (NIC per GPU; TPU: ICI)
  devices_per_node: int  # GPUs per node, chips per TPU host
  shared_compute: bool = False  # fake CPU devices: one pool of cores for all of them
  # gpu | tpu | cpu. A TPU slice's chips share one ICI network across hosts, so the trainer's
  # fsdp spans the slice (as sharding/placement.py builds it), and its compiler's memory habits
  # are planner/footprint_tpu.py's.
  platform: str = "gpu"
  source: str = ""  # where each number comes from
  # TPU: per chip, one direction, across slices over the data-center network (0: no figure)
  dcn_bytes_per_s: float = 0.0
  slice_devices: int = 0  # devices per TPU slice in a Multislice job; 0: one slice (or a GPU)
  # Device <-> pinned host memory, one direction (placement.offload): PCIe 5.0 x16 is 64 GB/s
  # in theory, ~50 GB/s measured by NVIDIA's bandwidthTest on H100 hosts; a round 25 GB/s
  # leaves room for a shared PCIe switch.
  host_bytes_per_s: float = 25 * GB

  def __post_init__(self):
    if self.slice_devices and not self.dcn_bytes_per_s:
      raise ValueError(f"{self.name}: no figure for the data-center network between slices "
                       f"(dcn_bytes_per_s), which a job of several slices needs")


DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("H100 SXM5 80GB", 989e12, 3.35e12, 80 * GB, 450 * GB, 50 * GB, 8,
                       source="https://www.nvidia.com/en-us/data-center/h100/ (bf16 989 TFLOP/s "
                              "dense, 3.35 TB/s, NVLink 900 GB/s both ways); NDR IB 400 Gb/s/GPU"),
    "h200": DeviceSpec("H200 SXM 141GB", 989e12, 4.8e12, 141 * GB, 450 * GB, 50 * GB, 8,
                       source="https://www.nvidia.com/en-us/data-center/h200/ (H100 compute, "
                              "4.8 TB/s, 141 GB, NVLink 900 GB/s); NDR IB 400 Gb/s per GPU"),
    "a100": DeviceSpec("A100 SXM4 80GB", 312e12, 2.039e12, 80 * GB, 300 * GB, 25 * GB, 8,
                       source="NVIDIA A100 datasheet nvidia-a100-datasheet-us-nvidia-1758950-r4 "
                              "(bf16 312 dense, 2,039 GB/s, NVLink 600 GB/s); HDR IB 200 Gb/s/GPU "
                              "(usual DGX A100 NIC, not confirmed here)"),
    "tpu_v4": DeviceSpec("TPU v4", 275e12, 1.2e12, 32 * GIB, 90 * GB, 270 * GB, 4,
                         source=_TPU + "v4 (275 TFLOP/s bf16, 32 GiB, 1200 GBps; 2x2x1 host); "
                                + _BOOK + " 45 GB/s x 2 in host, x 6 ports; no DCN figure found",
                         platform="tpu"),
    "tpu_v5e": DeviceSpec("TPU v5e", 197e12, 0.819e12, 16 * GB, 100 * GB, 200 * GB, 8,
                          source=_TPU + "v5e (197 TFLOP/s, 16 GB, 819 GBps, ICI 400 GBps "
                                 "bidirectional per chip, 8 chips per host; 2 x 100 Gbps NIC per "
                                 "host: 25 Gb/s per chip); " + _BOOK + " 50 GB/s",
                         platform="tpu", dcn_bytes_per_s=3.125 * GB),
    "tpu_v5p": DeviceSpec("TPU v5p", 459e12, 2.765e12, 95 * GB, 200 * GB, 600 * GB, 4,
                          source=_TPU + "v5p (459 TFLOP/s, 95 GB, 2765 GBps, ICI 1200 GBps "
                                 "bidirectional per chip, 4 chips per VM, DCN 50 Gbps per chip); "
                                 + _BOOK + " 100 GB/s",
                         platform="tpu", dcn_bytes_per_s=6.25 * GB),
    "tpu_v6e": DeviceSpec("TPU v6e", 918e12, 1.638e12, 32 * GB, 200 * GB, 400 * GB, 8,
                          source=_TPU + "v6e (918 TFLOP/s, 32 GB, 1638 GBps, ICI 800 GBps "
                                 "bidirectional per chip, 8 chips per host; 4 x 200 Gbps NIC per "
                                 "host: 100 Gb/s per chip); " + _BOOK + " 100 GB/s",
                         platform="tpu", dcn_bytes_per_s=12.5 * GB),
    "cpu": DeviceSpec("CPU (fake devices)", 2.2e11, 1.0e10, 24 * GIB, 1.0e10, 1.0e10, 8,
                      shared_compute=True, platform="cpu",
                      source="measured on the 2-core dev machine; calibration replaces these"),
}


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """Fractions of the datasheet a call achieves, and fixed costs, for large models on GPUs and
  TPUs (the defaults); a calibration fits them to a machine."""
  # Llama 3 405B pre-training: 38-43% BF16 MFU on 8-16K H100s (arXiv 2407.21783, Table 4);
  # MegaScale reaches 55.2% for 175B on 12,288 GPUs (arXiv 2402.15627).
  train_mfu: float = 0.40
  # Estimate: a forward pass is the same GEMMs with no backward to overlap (no direct figure).
  forward_mfu: float = 0.45
  prefill_mfu: float = 0.45  # estimate: prefill is a compute-bound forward over the prompts
  # Estimate: decode steps are bandwidth-bound at RL batch sizes; the compute term rarely binds.
  decode_mfu: float = 0.30
  # Model bandwidth utilization of vLLM / TensorRT-LLM decode: ~60-85% of HBM peak (rule of
  # thumb; databricks.com/blog/llm-inference-performance-engineering-best-practices).
  decode_hbm: float = 0.65
  # NCCL bus bandwidth, large messages: ~360-480 GB/s of NVLink's 450 on 8xH100, 400-450 GB/s
  # with 8x400G NDR across nodes (docs.alayanew.com, saturncloud.io nccl-tests guides).
  link: float = 0.75
  call_overhead_s: float = 2e-3  # estimate: dispatch of one jitted program and its host sync
  layer_overhead_s: float = 2e-5  # kernel launches of one layer in one pass (~10 x 2 us each)
  # Estimate: per-step host work (scheduling, sampling, loop); vLLM's v0.6 perf blog
  # (blog.vllm.ai/2024/09/05/perf-update.html) shows it is a large share of a decode step.
  decode_step_overhead_s: float = 1e-3
  step_overhead_s: float = 0.5  # estimate: host work per RL step: reward, experience, metrics
  # Products of width d run at d / (d + this) of the large-product efficiency; GPUs and TPUs
  # reach it from d of a few thousand, the widths of the models simulated here.
  matmul_half_dim: float = 1.0
  # Products of m rows per device run at m / (m + this): on a CPU short products lose to packing
  # and threading; on accelerators the simulated passes have thousands of rows per device, and
  # decode steps with few rows are bound by HBM, which the decode term models, so 1 (no effect).
  matmul_half_rows: float = 1.0
  # Estimate: the latency of one small all-reduce inside a node (NCCL's ring/tree at a few KB
  # is ~10 us on NVLink); it is what tensor-parallel decode pays twice per layer per step.
  collective_latency_s: float = 1e-5
  # Fraction of the shorter scoring passes hidden behind the longest when they run at the same
  # time on the same devices: 0 on accelerators (one program at a time); fake CPU devices run
  # them on threads that fill each other's idle cores (fitted there).
  shared_overlap: float = 0.0


# The 2-core dev machine (fake CPU devices), fitted by `jaxrl-plan --calibrate` there (rounded;
# docs/planner.md); the prior of a CPU calibration and the factors `strategy=plan` uses on a CPU
# without one.
CPU_EFFICIENCY = Efficiency(train_mfu=0.7, forward_mfu=0.8, prefill_mfu=0.9, decode_mfu=0.9,
                            decode_hbm=0.7, link=0.5, call_overhead_s=2.5e-3,
                            layer_overhead_s=1e-4, decode_step_overhead_s=2e-4,
                            step_overhead_s=7e-3, matmul_half_dim=80.0, matmul_half_rows=13.0,
                            collective_latency_s=1e-5, shared_overlap=0.9)
