"""The cost model: seconds of each call of an RL step under a plan, and the step's critical path.

Every call's time is the sum of a compute term, a memory term where a call is bandwidth-bound,
collectives, and fixed costs:
  compute      FLOPs (jaxrl/models/flops.py) / (devices x matmul peak x efficiency x shape), the
               shape factor d / (d + matmul_half_dim) x m / (m + matmul_half_rows) for the
               per-device model width d and rows of one product m (tokens per device and piece)
  decode step  max(compute, bytes read from HBM / (bandwidth x efficiency)): the weights shard
               and the KV cache of the rows decoding at once, every step. Rows decode at once
               as far as the KV cache fits beside everything else on the device (memory.py):
               a static batch runs in waves of that many rows, each to the budget; in-flight
               batching keeps that many slots busy until the longest row ends
  fsdp         all-gather of the weights (compute dtype) before the forward and again before the
               backward, reduce-scatter of the float32 gradients, per piece; overlapped with the
               compute (the longer of the two counts)
  tensor       two all-reduces of the activations per layer forward (four with the backward),
               exposed, each paying `collective_latency_s` as well
  fixed        `call_overhead_s` per jitted call, `layer_overhead_s` per layer per pass on each
               device partition (op launches; on a CPU, fake devices run their partitions on
               the same cores), `decode_step_overhead_s` per decode step
A collective's bytes cross the node's links while its group fits in a node, else the network.
On a CPU (`DeviceSpec.shared_compute`) the fake devices share one pool of cores: a call's compute
does not speed up with its device count, async generation cannot overlap training, and scoring
passes that run at the same time overlap by the fitted `shared_overlap`.
"""
from __future__ import annotations

import dataclasses
import math

from jaxrl.models.lm_head import chunk_length
from jaxrl.config import ExperimentConfig
from jaxrl.models import flops
from jaxrl.models.attention import flash
from jaxrl.models.config import ModelConfig
from planner.devices import DeviceSpec, Efficiency
from sharding.placement import whole_hosts

STAGES = ("generate", "reward", "reference", "old_logprobs", "values", "update", "critic_update",
          "weight_push", "host")
SCORING = ("reward", "reference", "old_logprobs", "values")  # independent: they run at once


@dataclasses.dataclass(frozen=True)
class Workload:
  """What one RL step computes, read off an ExperimentConfig (or stated for a simulation)."""
  model: ModelConfig
  prompts: int
  group_size: int
  prompt_len: int
  new_tokens: int  # the response budget: the longest row decodes this many steps
  num_minibatches: int = 1
  micro_batch_size: int = 0
  old_pass: bool = False
  reference: bool = True
  critic: bool = False
  reward_model: bool = False
  mean_new_tokens: float = 0.0  # mean response length; 0: every row runs to the budget
  inflight: bool = False  # generation refills finished rows' slots (rl.rollout.inflight_slots)
  packed: bool = False  # passes over prompt + response tokens only (jaxrl pads to the budget)
  paged: bool = False  # KV cache by the token (vLLM's pages): a row holds its mean length, not
  #                      its budget, as jaxrl's slots do
  sampler_bytes: int = 0  # bytes per weight of the sampler's copy (1: fp8); 0: compute dtype
  flash_attention: bool = False  # attention never holds [T, T] scores (a flash kernel)
  lora_params: int = 0  # LoRA: the adapters' parameters, the only ones trained; 0: all train
  share_group: int = 1  # rows of a pass's piece running their prompt once (share_prefix)

  @classmethod
  def from_config(cls, cfg: ExperimentConfig, platform: str) -> Workload:
    """The workload of `cfg`'s RL step on devices of `platform` ("gpu" | "tpu" | "cpu": its
    attention as the model resolves it there, jaxrl/models/attention.attention_impl)."""
    rl = cfg.rl
    return cls(model=cfg.model, prompts=rl.prompts_per_step, group_size=rl.group_size,
               prompt_len=cfg.data.max_prompt_tokens, new_tokens=rl.rollout.max_new_tokens,
               num_minibatches=rl.batching.num_minibatches,
               micro_batch_size=rl.batching.micro_batch_size,
               old_pass=rl.needs_old_logprobs and not rl.sampler_is_trainer,
               reference=rl.kl.coef > 0, critic=rl.trains_critic,
               reward_model=rl.reward == "reward_model", inflight=rl.rollout.inflight_slots > 0,
               flash_attention=flash(cfg.model, platform) and not rl.shares_prefix,
               lora_params=lora_params(cfg), share_group=rl.share_group)

  @property
  def rows(self) -> int:
    return self.prompts * self.group_size

  @property
  def mean_response(self) -> float:
    return self.mean_new_tokens or self.new_tokens

  @property
  def seq_len(self) -> float:
    """Tokens per row of a scoring or update pass."""
    return self.prompt_len + (self.mean_response if self.packed else self.new_tokens)

  @property
  def decoder_passes(self) -> int:  # per piece: a shared prompt's, then its rows'
    return 2 if self.share_group > 1 else 1

  @property
  def pieces(self) -> int:
    """Passes an update (and a scoring pass) runs one after another: micro-batches."""
    rows = self.micro_batch_size or self.rows // self.num_minibatches
    return self.rows // rows

  def logit_chunk(self, rows: int) -> int:
    """Positions per log-prob chunk of a pass over `rows` rows (jaxrl/models/lm_head.py)."""
    return chunk_length(rows, self.new_tokens, self.model.vocab_size)

  @property
  def compute_bytes(self) -> int:
    return 2 if self.model.dtype == "bfloat16" else 4

  @property
  def params(self) -> int:
    m = self.model
    heads = 1 if m.tie_embeddings else 2
    return flops.stored_matmul_params(m) + heads * m.vocab_size * m.d_model

  @property
  def trained_params(self) -> int:
    """Parameters with gradients and Adam moments: LoRA's adapters, or all."""
    return self.lora_params or self.params

  @property
  def sampler_weight_bytes(self) -> int:
    return self.sampler_bytes or self.compute_bytes

  @property
  def kv_bytes_per_token(self) -> int:
    m = self.model
    return m.n_layers * 2 * m.n_kv_heads * m.head_dim * self.compute_bytes

  @property
  def frozen_bytes(self) -> tuple[int, int]:
    """Bytes per parameter of the frozen models the step runs: the reference (with LoRA the
    actor's own base), the reward model."""
    reference = 4 if self.model.frozen_float32 else self.compute_bytes
    return reference * int(self.reference or bool(self.lora_params)), 4 * int(self.reward_model)

  @property
  def separate_frozen_bytes(self) -> int:
    """Bytes per parameter of the frozen models held apart from the actor (a LoRA reference is
    the actor's base: not counted again)."""
    return sum(self.frozen_bytes[1:] if self.lora_params else self.frozen_bytes)


def lora_params(cfg: ExperimentConfig) -> int:
  """The adapters' parameters of `cfg.lora` (0 without LoRA): r x (in + out) per target."""
  if not cfg.lora.enabled:
    return 0
  m = cfg.model
  q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
  sizes = {"wq": m.d_model + q, "wk": m.d_model + kv, "wv": m.d_model + kv, "wo": q + m.d_model,
           "w_gate": m.d_model + m.d_ff, "w_up": m.d_model + m.d_ff, "w_down": m.d_ff + m.d_model}
  return m.n_layers * cfg.lora.rank * sum(sizes[t] for t in cfg.lora.target_names)


@dataclasses.dataclass(frozen=True)
class Mesh:
  """A role's mesh: (data, fsdp, tensor) degrees, tensor innermost (neighbouring devices)."""
  data: int = 1
  fsdp: int = 1
  tensor: int = 1

  @property
  def size(self) -> int:
    return self.data * self.fsdp * self.tensor


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where each role runs and how. `strategy` as in sharding/placement.py; `mode` sync | async."""
  strategy: str
  trainer: Mesh
  sampler: Mesh
  scorer: Mesh  # reference and reward model (interleave: each on a group of this shape)
  mode: str = "sync"
  micro_batch_size: int = 0
  remat: str = "none"  # none | dots | full: what the update recomputes (model.layers.remat)
  # async: versions a batch may lag (rl.schedule.max_staleness); 0 overlaps nothing
  staleness: int = 1
  offload: bool = False  # placement.offload="all": idle state in pinned host memory (sync)

  def describe(self) -> str:
    t, s = self.trainer, self.sampler
    mb = f", micro-batch {self.micro_batch_size}" if self.micro_batch_size else ""
    mb += f", remat {self.remat}" if self.remat != "none" else ""
    mb += ", offload" if self.offload else ""
    return (f"{self.strategy} {self.mode}: trainer {t.size} (data {t.data} x fsdp {t.fsdp} x "
            f"tensor {t.tensor}), sampler {s.size} (data {s.data} x tensor {s.tensor}){mb}")


def _bandwidth(dev: DeviceSpec, eff: Efficiency, span: int) -> float:
  """Per-device bandwidth of a collective over `span` neighbouring devices: a node's links, the
  network between nodes (a TPU slice's ICI), or across TPU slices the data-center network."""
  if span <= dev.devices_per_node:
    link = dev.link_bytes_per_s
  elif not dev.slice_devices or span <= dev.slice_devices:
    link = dev.network_bytes_per_s
  else:
    link = dev.dcn_bytes_per_s
  return link * eff.link


def crossing_bytes_per_s(dev: DeviceSpec) -> float:
  """Per device, one way, a crossing between processes gets (sharding/crossing.py): the node's
  network (a TPU's data-center network: JAX's cross-host transfers are no ICI collective); 0
  where the table has no figure."""
  return dev.dcn_bytes_per_s if dev.platform == "tpu" else dev.network_bytes_per_s


def hosts(devices: int, dev: DeviceSpec) -> int:
  """The hosts (nodes) `devices` devices of kind `dev` fill."""
  return max(1, -(-devices // dev.devices_per_node))


def apart(plan: Plan, dev: DeviceSpec) -> bool:
  """Whether `plan` puts the sampler on hosts of its own (sharding/placement.whole_hosts)."""
  n = plan.trainer.size + plan.sampler.size
  return plan.strategy == "separate" and not dev.shared_compute and whole_hosts(
      "separate", n, train_devices=plan.trainer.size, n_hosts=hosts(n, dev))


def _compute_s(dev: DeviceSpec, eff: Efficiency, flop: float, mesh: Mesh, mfu: float,
               d_model: int, rows: float) -> float:
  """Matmul time: narrower and shorter products run further from the peak (module docstring);
  `rows` is the rows of one product on one device."""
  pool = dev.matmul_flops * (1 if dev.shared_compute else mesh.size)
  d = d_model / mesh.tensor
  shape = d / (d + eff.matmul_half_dim) * rows / (rows + eff.matmul_half_rows)
  return flop / (pool * mfu * shape)


def _fixed_s(dev: DeviceSpec, eff: Efficiency, mesh: Mesh, layers: int, passes: float,
             calls: int) -> float:
  partitions = mesh.size if dev.shared_compute else 1
  return calls * eff.call_overhead_s + passes * layers * partitions * eff.layer_overhead_s


def _fsdp_s(w: Workload, dev, eff, mesh: Mesh, gathers: int, scatter: bool) -> float:
  """All-gathers of the compute-dtype weights and a float32 gradient reduce-scatter, per piece."""
  if mesh.fsdp == 1:
    return 0.0
  share = (mesh.fsdp - 1) / mesh.fsdp / mesh.tensor
  nbytes = w.params * share * (gathers * w.compute_bytes + (4 if scatter else 0))
  return w.pieces * nbytes / _bandwidth(dev, eff, mesh.fsdp * mesh.tensor)


def _tensor_s(w: Workload, dev, eff, mesh: Mesh, tokens: float, all_reduces: int) -> float:
  """Ring all-reduces of [tokens, d_model] activations, `all_reduces` per layer."""
  if mesh.tensor == 1:
    return 0.0
  per_replica = tokens / (mesh.data * mesh.fsdp)
  nbytes = 2 * (mesh.tensor - 1) / mesh.tensor * per_replica * w.model.d_model * w.compute_bytes
  count = all_reduces * w.model.n_layers
  return count * (nbytes / _bandwidth(dev, eff, mesh.tensor) + eff.collective_latency_s)


def _piece_rows(w: Workload, mesh: Mesh) -> float:
  """Rows of one product on one device in a scoring or update pass: tokens per piece."""
  return w.rows / w.pieces * w.seq_len / (mesh.data * mesh.fsdp)


def forward_s(w: Workload, dev: DeviceSpec, eff: Efficiency, mesh: Mesh) -> float:
  """A scoring pass (reference, old log-probs, values) over the step's rows."""
  flop = flops.pass_flops(w.model, w.rows, w.seq_len, w.prompt_len, w.share_group)
  compute = _compute_s(dev, eff, flop, mesh, eff.forward_mfu, w.model.d_model,
                       _piece_rows(w, mesh))
  comm = _fsdp_s(w, dev, eff, mesh, 1, scatter=False)
  return (max(compute, comm) + _tensor_s(w, dev, eff, mesh, w.rows * w.seq_len, 2)
          + _fixed_s(dev, eff, mesh, w.model.n_layers, w.pieces * w.decoder_passes, 1))


def update_s(w: Workload, dev: DeviceSpec, eff: Efficiency, mesh: Mesh,
             remat: str = "none") -> float:
  """Forward + backward of every piece with what `remat` recomputes (flops.executed_train_flops),
  then the optimizer reading and writing float32 weights, gradients and two Adam moments (from
  HBM)."""
  flop = flops.executed_train_flops(w.model, w.rows, w.seq_len, w.seq_len - w.prompt_len,
                                    remat=remat, lora_params=w.lora_params,
                                    pass_rows=w.rows // w.num_minibatches)
  flop *= (flops.pass_flops(w.model, w.rows, w.seq_len, w.prompt_len, w.share_group)
           / flops.pass_flops(w.model, w.rows, w.seq_len, w.prompt_len))  # (a shared prompt)
  compute = _compute_s(dev, eff, flop, mesh, eff.train_mfu, w.model.d_model,
                       _piece_rows(w, mesh))
  comm = _fsdp_s(w, dev, eff, mesh, 2, scatter=True)
  optimizer = (w.num_minibatches * 2 * 16 * w.trained_params / mesh.size
               / (dev.hbm_bytes_per_s * eff.decode_hbm))
  if dev.shared_compute:
    optimizer *= mesh.size
  return (max(compute, comm) + _tensor_s(w, dev, eff, mesh, w.rows * w.seq_len, 4) + optimizer
          + _fixed_s(dev, eff, mesh, w.model.n_layers, 3 * w.pieces * w.decoder_passes,
                     w.num_minibatches))


def decode_steps(w: Workload, rows: float, concurrent: float) -> float:
  """Decode steps of one replica holding `rows` rows, `concurrent` of them at a time."""
  if w.inflight:
    return max(rows * w.mean_response / concurrent, w.new_tokens)
  return math.ceil(rows / concurrent - 1e-9) * w.new_tokens


def generate_s(w: Workload, dev: DeviceSpec, eff: Efficiency, mesh: Mesh,
               kv_rows: float = math.inf) -> float:
  """Prefill of each prompt once, then the decode steps of every replica (its rows in waves or
  in-flight slots of at most `kv_rows`): per step the longer of its FLOPs and its HBM reads."""
  m, p = w.model, w.prompt_len
  prefill_flop = flops.generate_flops(m, w.prompts, p, w.group_size, 1)
  prefill = _compute_s(dev, eff, prefill_flop, mesh, eff.prefill_mfu, m.d_model,
                       w.prompts * p / mesh.data)
  rows = w.rows / mesh.data
  concurrent = max(1.0, min(rows, kv_rows))
  steps = decode_steps(w, rows, concurrent)
  # FLOPs of one step of `concurrent` rows, attending to the prompt and half the response.
  token_flop = (flops.generate_flops(m, 1, p, 1, w.mean_response + 1)
                - flops.generate_flops(m, 1, p, 1, 1)) / max(w.mean_response, 1)
  step_compute = _compute_s(dev, eff, token_flop * concurrent * mesh.data, mesh, eff.decode_mfu,
                            m.d_model, concurrent)
  kv_bytes = concurrent * (p + w.mean_response / 2) * w.kv_bytes_per_token
  step_bytes = (w.params * w.sampler_weight_bytes + kv_bytes) / mesh.tensor
  if dev.shared_compute:
    step_bytes *= mesh.data  # every replica reads through the same memory
  step_memory = step_bytes / (dev.hbm_bytes_per_s * eff.decode_hbm)
  step = (max(step_compute, step_memory) + eff.decode_step_overhead_s
          + _tensor_s(w, dev, eff, mesh, concurrent * mesh.data, 2)
          + _fixed_s(dev, eff, mesh, m.n_layers, 1, 0))
  return prefill + steps * step + _fixed_s(dev, eff, mesh, m.n_layers, 1, 1)


def push_s(w: Workload, dev: DeviceSpec, eff: Efficiency, plan: Plan) -> float:
  """The trainer -> sampler weight copy (fake CPU devices: memory copies in one process). In
  place (colocate) at memory speed. Beside the trainer (on each host, where the trainer has part
  of each) each trainer device sends its shard over the links one copy of the weights spans
  (fsdp x tensor: a GPU node's, a TPU slice's). To hosts of the sampler's own (separate on
  whole hosts) a reshard into the sampler's layout on the trainer's devices (the mirror), then
  each of those sends the sampler's shard across (sharding/crossing.py)."""
  nbytes = w.params * w.sampler_weight_bytes
  if dev.shared_compute:  # fake devices: one process's copies, at the measured transfer rate
    return nbytes / (dev.link_bytes_per_s * eff.link) + eff.call_overhead_s
  t = plan.trainer.size
  if plan.strategy == "colocate":
    return 2 * nbytes / t / (dev.hbm_bytes_per_s * eff.decode_hbm) + eff.call_overhead_s
  span = plan.trainer.fsdp * plan.trainer.tensor  # the devices one copy of the weights is over
  if apart(plan, dev):
    shard = nbytes / plan.sampler.tensor
    return (shard / _bandwidth(dev, eff, span) + shard / (crossing_bytes_per_s(dev) * eff.link)
            + 2 * eff.call_overhead_s)
  return nbytes / t / _bandwidth(dev, eff, span) + eff.call_overhead_s


def offload_s(w: Workload, dev: DeviceSpec, plan: Plan) -> float:
  """`plan.offload`: each step the Adam moments (8 bytes per trained parameter) and the frozen
  models go to pinned host memory and back (train/roles/offload.py), over each device's host
  link."""
  if not plan.offload:
    return 0.0
  nbytes = 8 * (w.trained_params + w.params * int(w.critic)) + w.separate_frozen_bytes * w.params
  return 2 * nbytes / plan.trainer.size / dev.host_bytes_per_s


def stage_times(w: Workload, dev: DeviceSpec, eff: Efficiency, plan: Plan,
                kv_rows: float = math.inf) -> dict[str, float]:
  """Seconds of each stage of one step (0 for a stage the workload does not run); `kv_rows`:
  rows a sampler replica's KV cache holds at once (memory.kv_rows)."""
  w = dataclasses.replace(w, micro_batch_size=plan.micro_batch_size)
  t, s, r = plan.trainer, plan.sampler, plan.scorer
  return {"generate": generate_s(w, dev, eff, s, kv_rows),
          "reward": forward_s(w, dev, eff, r) if w.reward_model else eff.call_overhead_s,
          "reference": forward_s(w, dev, eff, r) if w.reference else 0.0,
          "old_logprobs": forward_s(w, dev, eff, t) if w.old_pass else 0.0,
          "values": forward_s(w, dev, eff, t) if w.critic else 0.0,
          "update": update_s(w, dev, eff, t, plan.remat),
          "critic_update": update_s(w, dev, eff, t, plan.remat) if w.critic else 0.0,
          "weight_push": push_s(w, dev, eff, plan) + offload_s(w, dev, plan),
          "host": eff.step_overhead_s}


def scoring_s(times: dict[str, float], plan: Plan, dev: DeviceSpec, eff: Efficiency) -> float:
  """The scoring passes, started together. On their own devices (interleave on accelerators)
  the longest one counts; on shared devices they run one after another, except on a CPU, where
  a fitted fraction `shared_overlap` of the shorter ones hides behind the longest."""
  passes = [times[s] for s in SCORING]
  longest, total = max(passes), sum(passes)
  if plan.strategy == "interleave" and not dev.shared_compute:
    own = times["old_logprobs"] + times["values"]
    return max(times["reference"], times["reward"], own)
  overlap = eff.shared_overlap if dev.shared_compute else 0.0
  return longest + (1 - overlap) * (total - longest)


def step_time(times: dict[str, float], plan: Plan, dev: DeviceSpec, eff: Efficiency) -> float:
  """The critical path: generate, score, update, push, in turn; async overlaps generating the
  next batch with the rest (LlamaRL: one version of staleness is enough for that), except on a
  CPU, where every fake device shares the cores."""
  train = (scoring_s(times, plan, dev, eff) + times["update"] + times["critic_update"]
           + times["weight_push"])
  if plan.mode == "async" and plan.staleness > 0 and not dev.shared_compute:
    return max(times["generate"], train) + times["host"]
  return times["generate"] + train + times["host"]
