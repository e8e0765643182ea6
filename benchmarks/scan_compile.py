"""Compile seconds against depth, scanned decoder (`model.layers.scan`) and unrolled.

  cpu  on this machine's XLA: a training pass (the loss's value and gradient over the model's
       parameters) and a scoring pass (the forward alone) of a 256-wide model over an [8, 128]
       batch, lowered and compiled at each depth, then run (the median of 3 calls after the
       first)
  tpu  the TPU compiler (libtpu, here: train/preflight/target_compile.py) on `--target`: the RL update and
       the reference's log-prob pass of configs/tiny.py widened to the same model (trainer
       on 2 chips), at each depth; the busiest device's bytes beside the seconds

  python -m benchmarks.scan_compile --json
  python -m benchmarks.scan_compile --json --depths 2,8,32 --remat dots --target v5e-4

The model and batch are small so that compiling, not running, dominates; the compiler's work
per layer is what grows with the unrolled depth (the scanned body is compiled once).
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import emit

MODEL = dict(vocab_size=512, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=1024)


def _timed(fn, *args) -> float:
  start = time.perf_counter()
  fn(*args)
  return time.perf_counter() - start


def measure(depth: int, scan: bool, remat: str) -> dict:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jaxrl.models.config import LayersConfig, ModelConfig
  from jaxrl.models.transformer import LanguageModel
  from jaxrl.models.rope import positions_from_valid
  cfg = ModelConfig(**MODEL, n_layers=depth, layers=LayersConfig(scan=scan, remat=remat))
  graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(1), (8, 128), 0, cfg.vocab_size)
  valid = jnp.ones(tokens.shape, bool)
  positions = positions_from_valid(valid)

  def loss(p):
    model = nnx.merge(graphdef, p)
    logits = model.logits(model.decoder(tokens, positions, valid)[0])
    return -jax.nn.log_softmax(logits).mean()
  out = {}
  for name, fn in (("train", jax.value_and_grad(loss)), ("score", loss)):
    jitted = jax.jit(fn)
    start = time.perf_counter()
    lowered = jitted.lower(params)
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    run = lambda: jax.block_until_ready(compiled(params))
    run()
    out[name] = {"lower_s": lower_s, "compile_s": compile_s,
                 "run_s": statistics.median(_timed(run) for _ in range(3))}
  return out


def tpu_compiles(depth: int, scan: bool, target: str) -> dict:
  """The TPU compiler's seconds and bytes for the update and a scoring pass."""
  from train.cli.flags import load_config_file
  from train.preflight.target_compile import compile_program, rl_programs, topology_devices
  from jaxrl import platform
  from jaxrl.config_files import resolve
  from planner.targets import parse_target
  from train.roles.cluster import RoleCluster
  raw = load_config_file("configs/tiny.py")
  raw.placement.update(train_devices=2)
  raw.model.update(**{k: v for k, v in MODEL.items() if k != "vocab_size"}, n_layers=depth,
                   layers={"scan": scan})
  cfg = resolve(raw, hf=False)
  with platform.building_for("tpu"):
    cluster = RoleCluster(cfg, topology_devices(parse_target(target)), initialize=False)
    programs = {p.name: p for p in rl_programs(cfg, cluster)}
    out = {}
    for name in ("actor update", "reference log-probs"):
      c = compile_program(programs[name])
      out[name] = {"compile_s": c.seconds, "bytes": c.bytes}
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--depths", default="2,8,32")
  parser.add_argument("--remat", default="none", choices=("none", "dots", "full"))
  parser.add_argument("--target", default="", help="also the TPU compiler's, for this slice")
  args = parser.parse_args()
  import jax
  jax.config.update("jax_enable_compilation_cache", False)  # every compile is a real one
  rows = []
  for depth in map(int, args.depths.split(",")):
    unrolled, scanned = measure(depth, False, args.remat), measure(depth, True, args.remat)
    rows.append({"depth": depth, "unrolled": unrolled, "scanned": scanned,
                 **{f"{p}_compile_ratio": scanned[p]["compile_s"] / unrolled[p]["compile_s"]
                    for p in ("train", "score")},
                 **{f"{p}_run_ratio": scanned[p]["run_s"] / unrolled[p]["run_s"]
                    for p in ("train", "score")}})
  tpu = []
  for depth in map(int, args.depths.split(",")) if args.target else ():
    unrolled, scanned = tpu_compiles(depth, False, args.target), tpu_compiles(depth, True,
                                                                             args.target)
    tpu.append({"depth": depth, "unrolled": unrolled, "scanned": scanned,
                **{f"{p}_compile_ratio": scanned[p]["compile_s"] / unrolled[p]["compile_s"]
                   for p in unrolled}})
  emit({"model": MODEL, "batch": [8, 128], "remat": args.remat, "rows": rows,
        "target": args.target, "tpu": tpu, "device": jax.devices()[0].device_kind}, args.json)


if __name__ == "__main__":
  main()
