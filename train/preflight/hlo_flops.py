"""The matrix-product FLOPs a compiled program executes, from its HLO text, each loop's body
counted as many times as the loop runs.

XLA's cost analysis counts a loop's body once: a scan over minibatches or micro-batches, the
log-prob chunks' loop, and the loops the TPU compiler makes of an fsdp all-gather with the
matmul that reads it (a "windowed einsum": on a v5p-64, fsdp over 32 chips, one Llama-70B MLP
product counted 45.4 of its 360.8 GFLOP per chip). Here every `dot` and `convolution` (the TPU
compiler's form of a matmul) counts 2 x its output elements x its contraction, times the runs
of the loops around it. A loop runs N times when its condition is `counter < N` with a constant
N (how JAX's scans and XLA's windowed einsums loop); any other loop (a decode loop that stops at
end of sequence) counts once and is reported as of unknown length. Pallas kernels (custom
calls) count nothing: the caller adds its own count for them.
"""
from __future__ import annotations

import collections
import math
import re

import numpy as np

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][\w-]*)\((.*?)\)(.*)$")
_ARRAY = re.compile(r"^[a-z]\w*\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(calls|body|condition|to_apply)=%([^\s,]+)")


def _dims(shape: str) -> list[int] | None:
  m = _ARRAY.match(shape)
  return [int(d) for d in m.group(1).split(",") if d] if m else None


def _window_pairs(out_size: int, in_size: int, size: int, lo: int, stride: int,
                  lhs_dilate: int = 1, rhs_dilate: int = 1) -> int:
  """(output position, window position) pairs of one spatial dimension that read the input,
  not its padding nor the holes of its dilation (`lhs_dilate`: the TPU compiler writes a
  batched matmul as a convolution whose window walks a dilated batch, one real input per
  output)."""
  pos = (np.arange(out_size)[:, None] * stride + np.arange(size)[None, :] * rhs_dilate - lo)
  real = (pos >= 0) & (pos % lhs_dilate == 0) & (pos // lhs_dilate < in_size)
  return int(real.sum())


def _convolution_flops(out: list[int], lhs: list[int], rhs: list[int], attrs: str) -> float:
  """A convolution (the TPU compiler's form of most matmuls: a window over a few shards or
  heads, sometimes padded or dilated) as 2 x the multiply-adds that read real input."""
  lhs_l, rhs_l, out_l = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attrs).groups()
  window = re.search(r"window=\{([^}]*)\}", attrs)
  fields = dict(f.split("=") for f in window.group(1).split()) if window else {}
  per_dim = lambda key, default: ([x.split("_") if "_" in x else x
                                   for x in fields[key].split("x")] if key in fields else default)
  spatial = sorted(c for c in out_l if c.isdigit())
  ones = [1] * len(spatial)
  sizes, strides = ([int(x) for x in per_dim(k, ones)] for k in ("size", "stride"))
  pads = [int(p[0]) for p in per_dim("pad", [["0", "0"]] * len(spatial))]
  lhs_dilate, rhs_dilate = ([int(x) for x in per_dim(k, ones)] for k in ("lhs_dilate",
                                                                          "rhs_dilate"))
  pairs, out_spatial = 1, 1
  for k, c in enumerate(spatial):
    o, i = out[out_l.index(c)], lhs[lhs_l.index(c)]
    pairs *= _window_pairs(o, i, sizes[k], pads[k], strides[k], lhs_dilate[k], rhs_dilate[k])
    out_spatial *= o
  return 2.0 * math.prod(out) / out_spatial * pairs * rhs[rhs_l.index("i")]


def _product_flops(op: str, out: list[int], operands: list, attrs: str) -> float:
  """2 x the multiply-adds of one dot or convolution."""
  if op == "convolution":
    return _convolution_flops(out, operands[0], operands[1], attrs)
  m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
  contraction = math.prod(operands[0][int(i)] for i in m.group(1).split(",") if i) if m else 1
  return 2.0 * math.prod(out) * contraction


def _constant(value_of: dict, name: str) -> int | None:
  m = re.match(r"(-?\d+)\)", value_of.get(name, ""))
  return int(m.group(1)) if m else None


def _trip_count(condition: list[tuple], body: list[tuple]) -> int | None:
  """How often a loop runs whose condition's root is `counter < constant(N)` and whose body adds
  a constant step to the counter (from 0), else None."""
  if not condition or not body:
    return None
  by_name = {i[0]: i for i in condition + body}
  values = {name: rest for name, _, op, _, rest in condition + body if op == "constant"}
  _, _, op, operands, attrs = condition[-1]
  if op != "compare" or "direction=LT" not in attrs or len(operands) != 2:
    return None
  limit, counter = _constant(values, operands[1]), by_name.get(operands[0])
  index = re.search(r"index=(\d+)", counter[4]) if counter and counter[2] == "get-tuple-element" \
      else None
  _, _, root_op, root_operands, _ = body[-1]
  if limit is None or index is None or root_op != "tuple":
    return None
  update = by_name.get(root_operands[int(index.group(1))])
  if update is None or update[2] != "add":
    return None
  step = next((v for v in (_constant(values, o) for o in update[3]) if v), None)
  return -(-limit // step) if step and step > 0 else None


def parse(text: str) -> dict[str, list[tuple]]:
  """{computation: [(name, shape, op, operand names, the rest of the line)]}, in text order."""
  computations, current = {}, None
  for line in text.splitlines():
    if m := _COMPUTATION.match(line):
      current = computations.setdefault(m.group(1), [])
    elif current is not None and (m := _INSTRUCTION.match(line)):
      name, shape, op, operands, rest = m.groups()
      names = re.findall(r"%([^\s,()]+)", operands)
      current.append((name, shape, op, names, rest if op != "constant" else operands + ")"))
  return computations


def executed_flops(text: str) -> tuple[float, int]:
  """(matrix-product FLOPs of one run of the program, loops of unknown length counted once)."""
  computations = parse(text)
  runs = collections.Counter({list(computations)[-1]: 1})  # ENTRY comes last
  flops, unknown = 0.0, 0
  for comp in reversed(list(computations)):  # callers come after their callees
    body = computations[comp]
    shapes = {name: _dims(shape) for name, shape, *_ in body}
    for name, shape, op, operands, attrs in body:
      if op in ("dot", "convolution") and runs[comp]:
        flops += runs[comp] * _product_flops(op, shapes[name], [shapes.get(o) for o in operands],
                                             attrs)
      callees = dict((kind, callee) for kind, callee in _CALLEE.findall(attrs))
      if op == "while":
        trips = _trip_count(computations.get(callees.get("condition"), []),
                            computations.get(callees["body"], []))
        unknown += trips is None
        runs[callees["body"]] += runs[comp] * (trips or 1)
      elif op != "reduce":  # fusions, calls (a reduction's region has no products)
        for kind, callee in callees.items():
          if kind in ("calls", "to_apply"):
            runs[callee] += runs[comp]
      if m := re.search(r"branch_computations=\{([^}]*)\}", attrs):  # each branch: at most
        for callee in re.findall(r"%([^\s,]+)", m.group(1)):
          runs[callee] += runs[comp]
  return flops, unknown
