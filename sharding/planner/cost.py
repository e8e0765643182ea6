"""The cost model: seconds and bytes of each call of an RL step under a plan, and the step's
critical path.

Every call's time is the sum of a compute term, a memory term where a call is bandwidth-bound,
collectives, and fixed costs:
  compute      FLOPs (jaxrl/models/flops.py) / (devices x matmul peak x efficiency x a shape
               factor d / (d + matmul_half_dim), d the per-device model width)
  decode step  max(compute, bytes read from HBM / (bandwidth x efficiency)): the weights shard
               and the KV cache, every step
  fsdp         all-gather of the weights (compute dtype) before the forward and again before the
               backward, reduce-scatter of the float32 gradients, per micro-batch; overlapped
               with the compute (the longer of the two counts)
  tensor       two all-reduces of the activations per layer forward (four with the backward),
               exposed
  fixed        `call_overhead_s` per jitted call, `layer_overhead_s` per layer per pass on each
               device partition (op launches; on a CPU, fake devices run their partitions on
               the same cores), `decode_step_overhead_s` per decode step
A collective's bytes cross the node's links while its group fits in a node, else the network.
On a CPU (`DeviceSpec.shared_compute`) the fake devices share one pool of cores: a call's compute
does not speed up with its device count, and async generation cannot overlap training.
"""
from __future__ import annotations

import dataclasses

from jaxrl.config import ExperimentConfig
from jaxrl.models import flops
from jaxrl.models.llama import ModelConfig
from sharding.planner.devices import DeviceSpec, Efficiency

STAGES = ("generate", "reward", "reference", "old_logprobs", "values", "update", "critic_update",
          "weight_push", "host")


@dataclasses.dataclass(frozen=True)
class Workload:
  """What one RL step computes, read off an ExperimentConfig."""
  model: ModelConfig
  prompts: int
  group_size: int
  prompt_len: int
  new_tokens: int  # decode steps of the static batch (its longest row)
  num_minibatches: int = 1
  micro_batch_size: int = 0
  old_pass: bool = False
  reference: bool = True
  critic: bool = False
  reward_model: bool = False

  @classmethod
  def from_config(cls, cfg: ExperimentConfig) -> Workload:
    rl = cfg.rl
    return cls(model=cfg.model, prompts=rl.prompts_per_step, group_size=rl.group_size,
               prompt_len=cfg.data.max_prompt_tokens, new_tokens=rl.max_new_tokens,
               num_minibatches=rl.num_minibatches, micro_batch_size=rl.micro_batch_size,
               old_pass=rl.needs_old_logprobs, reference=rl.kl_coef > 0,
               critic=rl.advantage == "gae", reward_model=rl.reward == "reward_model")

  @property
  def rows(self) -> int:
    return self.prompts * self.group_size

  @property
  def seq_len(self) -> int:
    return self.prompt_len + self.new_tokens

  @property
  def pieces(self) -> int:
    """Passes an update (and a scoring pass) runs one after another: micro-batches."""
    rows = self.micro_batch_size or self.rows // self.num_minibatches
    return self.rows // rows

  @property
  def compute_bytes(self) -> int:
    return 2 if self.model.dtype == "bfloat16" else 4

  @property
  def params(self) -> int:
    m = self.model
    heads = 1 if m.tie_embeddings else 2
    return flops.matmul_params(m) + heads * m.vocab_size * m.d_model


@dataclasses.dataclass(frozen=True)
class Mesh:
  """A role's mesh: (data, fsdp, tensor) degrees; `nodes` it spans."""
  data: int = 1
  fsdp: int = 1
  tensor: int = 1
  nodes: int = 1

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

  def describe(self) -> str:
    t, s = self.trainer, self.sampler
    mb = f", micro-batch {self.micro_batch_size}" if self.micro_batch_size else ""
    return (f"{self.strategy} {self.mode}: trainer {t.size} (data {t.data} x fsdp {t.fsdp} x "
            f"tensor {t.tensor}), sampler {s.size} (data {s.data} x tensor {s.tensor}){mb}")


def _bandwidth(dev: DeviceSpec, eff: Efficiency, mesh: Mesh) -> float:
  link = dev.link_bytes_per_s if mesh.nodes <= 1 else dev.network_bytes_per_s
  return link * eff.link


def _compute_s(dev: DeviceSpec, eff: Efficiency, flop: float, mesh: Mesh, mfu: float,
               d_model: int) -> float:
  """Matmul time: smaller products run further from the peak, by d / (d + matmul_half_dim)
  for the per-device model width d."""
  pool = dev.matmul_flops * (1 if dev.shared_compute else mesh.size)
  d = d_model / mesh.tensor
  return flop / (pool * mfu * d / (d + eff.matmul_half_dim))


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
  return w.pieces * nbytes / _bandwidth(dev, eff, mesh)


def _tensor_s(w: Workload, dev, eff, mesh: Mesh, tokens: float, all_reduces: int) -> float:
  """Ring all-reduces of [tokens, d_model] activations, `all_reduces` per layer."""
  if mesh.tensor == 1:
    return 0.0
  per_replica = tokens / (mesh.data * mesh.fsdp)
  nbytes = 2 * (mesh.tensor - 1) / mesh.tensor * per_replica * w.model.d_model * w.compute_bytes
  return all_reduces * w.model.n_layers * nbytes / _bandwidth(dev, eff, mesh)


def forward_s(w: Workload, dev: DeviceSpec, eff: Efficiency, mesh: Mesh) -> float:
  """A scoring pass (reference, old log-probs, values) over the step's rows."""
  flop = flops.forward_flops(w.model, w.rows, w.seq_len, w.new_tokens)
  compute = _compute_s(dev, eff, flop, mesh, eff.forward_mfu, w.model.d_model)
  comm = _fsdp_s(w, dev, eff, mesh, 1, scatter=False)
  return (max(compute, comm) + _tensor_s(w, dev, eff, mesh, w.rows * w.seq_len, 2)
          + _fixed_s(dev, eff, mesh, w.model.n_layers, w.pieces, 1))


def update_s(w: Workload, dev: DeviceSpec, eff: Efficiency, mesh: Mesh) -> float:
  """Forward + backward of every piece, then the optimizer reading and writing float32 weights,
  gradients and two Adam moments (from HBM)."""
  flop = flops.train_flops(w.model, w.rows, w.seq_len, w.new_tokens)
  compute = _compute_s(dev, eff, flop, mesh, eff.train_mfu, w.model.d_model)
  comm = _fsdp_s(w, dev, eff, mesh, 2, scatter=True)
  optimizer = 2 * 16 * w.params / mesh.size / (dev.hbm_bytes_per_s * eff.decode_hbm)
  if dev.shared_compute:
    optimizer *= mesh.size
  return (max(compute, comm) + _tensor_s(w, dev, eff, mesh, w.rows * w.seq_len, 4) + optimizer
          + _fixed_s(dev, eff, mesh, w.model.n_layers, 3 * w.pieces, w.num_minibatches))


def generate_s(w: Workload, dev: DeviceSpec, eff: Efficiency, mesh: Mesh) -> float:
  """Prefill of each prompt once, then `new_tokens` decode steps of every row: per step the
  longer of its FLOPs and its HBM reads (each replica's weight shard and KV cache)."""
  m, p = w.model, w.prompt_len
  prefill_flop = flops.generate_flops(m, w.prompts, p, w.group_size, 1)
  prefill = _compute_s(dev, eff, prefill_flop, mesh, eff.prefill_mfu, m.d_model)
  steps = w.new_tokens
  step_flop = (flops.generate_flops(m, w.prompts, p, w.group_size, steps + 1)
               - prefill_flop) / max(steps, 1)
  step_compute = _compute_s(dev, eff, step_flop, mesh, eff.decode_mfu, m.d_model)
  rows = w.rows / mesh.data
  kv_bytes = rows * (p + steps / 2) * m.n_layers * 2 * m.n_kv_heads * m.head_dim * w.compute_bytes
  step_bytes = (w.params * w.compute_bytes + kv_bytes) / mesh.tensor
  if dev.shared_compute:
    step_bytes *= mesh.data  # every replica reads through the same memory
  step_memory = step_bytes / (dev.hbm_bytes_per_s * eff.decode_hbm)
  step = (max(step_compute, step_memory) + eff.decode_step_overhead_s
          + _tensor_s(w, dev, eff, mesh, w.rows, 2)
          + _fixed_s(dev, eff, mesh, m.n_layers, 1, 0))
  return prefill + steps * step + _fixed_s(dev, eff, mesh, m.n_layers, 1, 1)


def push_s(w: Workload, dev: DeviceSpec, eff: Efficiency, plan: Plan) -> float:
  """The trainer -> sampler weight copy: in place (colocate) at memory speed, else each trainer
  device sends its shard over the links."""
  nbytes = w.params * w.compute_bytes
  senders = 1 if dev.shared_compute else plan.trainer.size
  if plan.strategy == "colocate" or dev.shared_compute:
    return 2 * nbytes / senders / (dev.hbm_bytes_per_s * eff.decode_hbm) + eff.call_overhead_s
  return nbytes / senders / _bandwidth(dev, eff, plan.sampler) + eff.call_overhead_s


def stage_times(w: Workload, dev: DeviceSpec, eff: Efficiency, plan: Plan) -> dict[str, float]:
  """Seconds of each stage of one step (0 for a stage the workload does not run)."""
  w = dataclasses.replace(w, micro_batch_size=plan.micro_batch_size)
  t, s, r = plan.trainer, plan.sampler, plan.scorer
  return {"generate": generate_s(w, dev, eff, s),
          "reward": forward_s(w, dev, eff, r) if w.reward_model else eff.call_overhead_s,
          "reference": forward_s(w, dev, eff, r) if w.reference else 0.0,
          "old_logprobs": forward_s(w, dev, eff, t) if w.old_pass else 0.0,
          "values": forward_s(w, dev, eff, t) if w.critic else 0.0,
          "update": update_s(w, dev, eff, t),
          "critic_update": update_s(w, dev, eff, t) if w.critic else 0.0,
          "weight_push": push_s(w, dev, eff, plan),
          "host": eff.step_overhead_s}


def step_time(times: dict[str, float], plan: Plan, dev: DeviceSpec) -> float:
  """The critical path. Interleave scores on the reference and reward groups while the trainer
  runs its own passes; async overlaps generating the next batch with training on this one
  (LlamaRL), except on a CPU, where every fake device shares the same cores."""
  own = times["old_logprobs"] + times["values"]
  if plan.strategy == "interleave" and not dev.shared_compute:
    scoring = max(times["reference"], times["reward"], own)
  else:
    scoring = times["reference"] + times["reward"] + own
  train = scoring + times["update"] + times["critic_update"] + times["weight_push"]
  if plan.mode == "async" and not dev.shared_compute:
    return max(times["generate"], train) + times["host"]
  return times["generate"] + train + times["host"]


def activation_bytes(w: Workload, mesh: Mesh, micro_batch_size: int = 0) -> float:
  """What the update keeps for its backward on one device (no rematerialisation): per layer and
  token the block's inputs, projections and MLP hidden states, per head the float32 attention
  probabilities."""
  m = w.model
  rows = (micro_batch_size or w.rows // w.num_minibatches) / (mesh.data * mesh.fsdp)
  per_token_layer = (w.compute_bytes * (4 * m.d_model + (m.n_heads + 2 * m.n_kv_heads)
                                        * m.head_dim / mesh.tensor + 3 * m.d_ff / mesh.tensor)
                     + 4 * m.n_heads / mesh.tensor * w.seq_len)
  return rows * w.seq_len * m.n_layers * per_token_layer


def memory(w: Workload, plan: Plan) -> dict[str, float]:
  """Peak bytes per device of each device group: trainer (float32 weights, gradients, Adam
  moments, an accumulator with micro-batches, the frozen models it hosts, activations), sampler
  (compute-dtype weights and the KV cache), scorer groups (interleave)."""
  t, s, r = plan.trainer, plan.sampler, plan.scorer
  shard = lambda mesh: w.params / (mesh.fsdp * mesh.tensor)
  trained = (20 if plan.micro_batch_size else 16) * (2 if w.critic else 1)
  frozen = 4 * (int(w.reference) + int(w.reward_model))
  trainer = trained * shard(t) + activation_bytes(w, t, plan.micro_batch_size)
  kv = (w.rows / s.data * w.seq_len * w.model.n_layers * 2 * w.model.n_kv_heads
        * w.model.head_dim * w.compute_bytes / s.tensor)
  sampler = w.params * w.compute_bytes / s.tensor + kv
  out = {"trainer": trainer, "sampler": sampler}
  if plan.strategy == "interleave":
    out["scorer"] = 4 * shard(r)
    out["trainer"] += sampler
  else:
    out["trainer"] += frozen * shard(t)
  if plan.strategy == "colocate":
    out["trainer"] += sampler
    out["sampler"] = out["trainer"]
  return out


def total_bytes(mem: dict[str, float], plan: Plan) -> float:
  """All devices' bytes together (what fake CPU devices take from one machine's memory)."""
  if plan.strategy == "colocate":
    return mem["trainer"] * plan.trainer.size
  total = mem["trainer"] * plan.trainer.size + mem.get("scorer", 0.0) * 2 * plan.scorer.size
  return total + (mem["sampler"] * plan.sampler.size if plan.strategy == "separate" else 0.0)
