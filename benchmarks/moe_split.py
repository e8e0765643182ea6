"""A mixture-of-experts layer with its experts split over a tensor group of devices: the bytes
each compiled program moves between devices and its time, for the three ways of placing the
products (jaxrl/models/moe.py), measured alternately in one process.

  python -m benchmarks.moe_split --json

  compiler   the experts split by expert and the products left to XLA's partitioner (jaxrl
             before `split_experts`)
  by_expert  `split_experts` with the rules mapping `expert` to the tensor axis: each device
             runs its own experts, every assignment's worth of blocks (the static worst case)
  by_width   `split_experts` with the experts' width split (jaxrl's rules tables): each device
             runs every assignment on its slice of every expert

One layer shaped as Qwen3-30B-A3B's at a quarter of its width (benchmarks/moe.py) over
`--tokens` tokens, forward and forward + backward, on `--devices` devices (fake CPU devices
share the machine's cores: their time is the group's total work). `*_collective_bytes` sums
the operands of the compiled program's collectives (per device, counted once per op).
"""
from __future__ import annotations

import argparse
import os
import re

from benchmarks.common import best_seconds, emit

_COLLECTIVE = re.compile(r"= (.+?) (all-gather|all-reduce|all-to-all|reduce-scatter|"
                         r"collective-permute)(?:-start)?\(")
_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "f16": 2, "s8": 1, "u32": 4, "pred": 1}


def collective_bytes(hlo: str) -> int:
  """Bytes of the results of every collective op in compiled HLO text."""
  total = 0
  for types, _ in _COLLECTIVE.findall(hlo):
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", types):
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      total += n * _BYTES.get(dtype, 4)
  return total


def _programs(placement: str, impl: str, mesh):
  """(forward, forward + backward) of one placement, jitted under its rules."""
  import jax
  from jaxrl.models.moe import EXPERTS, split_experts
  from jaxrl.partitioning import activation_rules
  table = {"by_width": (("mlp", "tensor"),)}.get(placement, (("expert", "tensor"),))
  run = (lambda *a: EXPERTS[impl](*a, jax.nn.silu)) if placement == "compiler" else (
      lambda *a: split_experts(impl, *a, jax.nn.silu))

  def under_rules(fn):
    def traced(*args):
      with activation_rules(mesh, table):
        return fn(*args)
    return traced
  fn = lambda x, ids, wk, g, u, dn: run(x, ids, wk, g, u, dn)
  grad = jax.grad(lambda x, wk, g, u, dn, ids: (fn(x, ids, wk, g, u, dn) ** 2).sum(),
                  argnums=(0, 1, 2, 3, 4))
  return (jax.jit(under_rules(fn)),
          jax.jit(under_rules(lambda x, ids, wk, g, u, dn: grad(x, wk, g, u, dn, ids))))


def _placed(inputs, mesh, placement: str):
  """The weights sharded as the placement's rules put them (tokens replicated)."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  by_width = placement == "by_width"
  gate_up = P(None, "tensor") if by_width else P("tensor")
  down = P(None, None, "tensor") if by_width else P("tensor")
  specs = (P(), P(), P(), gate_up, gate_up, down)
  return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(inputs, specs)]


def measure(args) -> dict:
  import jax
  import numpy as np
  from benchmarks.moe import _inputs
  from sharding.mesh import make_mesh
  mesh = make_mesh({"tensor": args.devices}, jax.devices()[:args.devices])
  inputs = _inputs(args.tokens, args.d_model, args.experts, args.width, args.k, "float32")
  runs = {p: (_programs(p, args.impl, mesh), _placed(inputs, mesh, p))
          for p in ("compiler", "by_expert", "by_width")}
  out, result = {}, {}
  for p, ((fwd, train), placed) in runs.items():
    out[p] = np.asarray(fwd(*placed))
    for name, fn in (("forward", fwd), ("train", train)):
      result[f"{p}_{name}_collective_bytes"] = collective_bytes(
          fn.lower(*placed).compile().as_text())
      result[f"{p}_{name}_s"] = float("inf")
  for _ in range(args.rounds):  # alternate, so that drift on a shared machine hits all three
    for p, ((fwd, train), placed) in runs.items():
      for name, fn in (("forward", fwd), ("train", train)):
        s = best_seconds(lambda: jax.block_until_ready(fn(*placed)), repeats=args.repeats)
        result[f"{p}_{name}_s"] = round(min(result[f"{p}_{name}_s"], s), 6)
  result["max_abs_difference"] = max(float(np.abs(out[p] - out["compiler"]).max()) for p in out)
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--impl", default="blocked", choices=("ragged", "blocked", "dense"))
  parser.add_argument("--tokens", type=int, default=1024)
  parser.add_argument("--d_model", type=int, default=512)
  parser.add_argument("--experts", type=int, default=32)
  parser.add_argument("--width", type=int, default=192)
  parser.add_argument("--k", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--rounds", type=int, default=2)
  args = parser.parse_args()
  flag = f"--xla_force_host_platform_device_count={args.devices}"
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}"
  import jax
  emit({**measure(args), "devices": args.devices, "impl": args.impl, "tokens": args.tokens,
        "d_model": args.d_model, "experts": args.experts, "width": args.width, "k": args.k,
        "device": jax.devices()[0].device_kind}, args.json)


if __name__ == "__main__":
  main()
