"""The memory and FLOP models against the TPU compiler: a sweep point compiled here, the matrix
products counted as often as their loops run, and the dry run's scoring and update estimates
against the stored real-size compiles (benchmarks/target_table.json)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from planner.targets import parse_target

ROOT = __file__.rsplit("/tests/", 1)[0]


@pytest.mark.parametrize("scan_layers", ["auto", "false"])
def test_memory_and_flop_models_against_the_tpu_compiler(scan_layers):
  """benchmarks/target_sweep.py's first point (the RL update of a d256 x 2 model, fsdp over a
  v5e-4; its own process: libtpu keeps every buffer in HBM only if told before it loads), the
  decoder scanned (a TPU's default) and unrolled: the TPU memory model of the update and of the
  scoring passes within 15% of the compiler's temporary bytes; jaxrl's count of the FLOPs XLA
  sees (the update's, less the splash kernel's attention) within 5% of the compiler's; the live
  peak read from XLA's dump within the buffer it packs it into, within what memory_analysis
  reports."""
  out = subprocess.run([sys.executable, "-m", "benchmarks.target_sweep", "--json", "--points",
                        "0", "--scan-layers", scan_layers], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  (point,) = json.loads(out.stdout.strip().splitlines()[-1])["points"]
  assert point["estimate_over_compiler"] == pytest.approx(1.0, abs=0.15)
  if scan_layers == "auto":  # (the unrolled scoring model has a fixed 12 MiB: 0.85 to 0.95 here)
    for scoring in point["scoring"].values():
      assert scoring["estimate_over_compiler"] == pytest.approx(1.0, abs=0.15), scoring
  assert point["jaxrl_over_compiler"] == pytest.approx(1.0, abs=0.05)
  assert 0 < point["live_bytes"] <= point["allocated_bytes"] <= point["temp_bytes"]


def test_matrix_products_are_counted_as_often_as_their_loops_run():
  """A product inside a 3-step scan, its weight fsdp-sharded over a v5p-64's 32 chips: the TPU
  compiler makes a loop of the all-gather and the product (a windowed einsum) inside the scan's
  loop, and XLA's cost analysis counts each loop's body once. train/preflight/hlo_flops.py counts it all."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from train.preflight.hlo_flops import _convolution_flops, executed_flops
  from train.preflight.target_compile import no_persistent_cache, topology_devices
  mesh = Mesh(np.array(topology_devices(parse_target("v5p-64"))), ("fsdp",))
  rows, d, f = 256, 2048, 8192
  x = jax.ShapeDtypeStruct((3, 32 * rows, d), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P(None, "fsdp", None)))
  w = jax.ShapeDtypeStruct((f, d), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "fsdp")))
  scan = lambda x, w: jax.lax.scan(lambda c, x: (c + jnp.tanh(x @ w.T).sum(), None), 0.0, x)[0]
  with no_persistent_cache():
    compiled = jax.jit(scan).lower(x, w).compile()
  per_chip = 3 * 2 * rows * d * f
  assert executed_flops(compiled.as_text()) == (per_chip, 0)
  xla = compiled.cost_analysis()
  assert (xla[0] if isinstance(xla, (list, tuple)) else xla)["flops"] < per_chip / 10
  # The TPU compiler's form of a batched matmul (a mixture of experts' blocked products): a
  # window walking a dilated batch reads one real input per output, not the whole window.
  conv = "window={size=1662 stride=1661 lhs_dilate=1662}, dim_labels=0bf_0oi->0bf"
  assert _convolution_flops([1662, 64, 256], [1662, 64, 768], [1662, 256, 768], conv) == \
      2 * 1662 * 64 * 256 * 768


SCORING_CHECKED = ("qwen2.5-0.5b", "llama3.1-8b", "qwen2.5-7b-lora", "llama3.1-70b",
                   "qwen2.5-0.5b/unrolled", "llama3.1-8b/unrolled", "qwen2.5-7b-lora/unrolled",
                   "llama3.1-70b-8/unrolled")


def test_the_tpu_scoring_model_against_the_stored_real_size_compiles():
  """planner/footprint_tpu.scoring_peak (the dry run's scoring passes for a TPU target) against
  the temporary bytes the TPU compiler gave each real-size config's old and reference log-probs
  passes (benchmarks/target_table.json: 0.5B to the 70B, fsdp 4 and 32, float32 and bfloat16
  weights, LoRA; the decoder scanned, and unrolled before it could be): within 16% of every
  pass (the float32 actor's old log-probs pass holds its weights' bfloat16 copy, made ahead of
  the loop over pieces or the scan: 3.6 GiB at the 8B)."""
  from benchmarks.target_table import STORE, row_config
  from train.preflight import dry_run
  from train.preflight.target_compile import topology_devices
  from jaxrl import platform
  stored = json.load(open(STORE))
  for name in SCORING_CHECKED:
    cfg, target = row_config(name, stored[name])
    temps = {p["name"]: p["temp_bytes"] for p in stored[name]["summary"]["programs"]}
    with platform.building_for("tpu"):
      cluster, _, _ = dry_run.tables(cfg, topology_devices(target))
      for program, role in (("reference log-probs", "reference"), ("old log-probs", "actor")):
        estimate = sum(dry_run.scoring_footprint(cfg, cluster.get(role)).values())
        assert estimate == pytest.approx(temps[program], rel=0.16), (name, program)


@pytest.mark.parametrize("name", ["qwen2.5-3b", "qwen2.5-3b-768", "llama3.1-70b"])
def test_the_dry_runs_update_estimate_gives_the_compilers_verdict(name):
  """Today's dry run against the TPU compiler's stored compiles of real sizes
  (benchmarks/target_table.json): the update phase's estimate within 15% of the compiler's
  bytes and on the same side of the chip's HBM. Qwen2.5-3B on a v5e-16 (its head windowed over
  16 chips, remat dots with the splash kernel, one micro-batch per minibatch) fits at 13.84 GiB
  of 14.90, where the dry run said 17.18 and DOES NOT FIT before issue 64, and does not fit
  with 768 new tokens."""
  from benchmarks.target_table import STORE, refreshed
  entry = refreshed(name, json.load(open(STORE))[name])
  update = entry["summary"]["phases"]["actor update"]
  hbm = entry["summary"]["hbm_bytes"]
  assert update["estimate_bytes"] == pytest.approx(update["compiler_bytes"], rel=0.15), update
  assert (update["estimate_bytes"] <= hbm) == (update["compiler_bytes"] <= hbm), (update, hbm)
