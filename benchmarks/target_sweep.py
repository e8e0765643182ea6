"""The memory and FLOP models against the TPU compiler: the RL update of small models compiled
for a TPU slice on this CPU (libtpu, allocating nothing; its VMEM assignment off, so that every
buffer is counted in HBM as at a real size: `whole_update_in_hbm`). Per point: the compiler's
temporary bytes per device (`memory_analysis`), their live peak (read from its dump:
benchmarks/live_peak.py), the memory model's update peak for a TPU target
(planner/footprint_tpu.py, through the dry run's `update_footprint`), and the compiler's FLOPs
per device against jaxrl's count of what it sees (jaxrl/models/flops.py executed_train_flops,
less the splash kernel's attention, which XLA does not count).

  python -m benchmarks.target_sweep --json --markdown   # the 22 points (v5e-4 unless named), docs
  python -m benchmarks.target_sweep --json --points 0,3    # some of them

The compiler's FLOPs are its matrix products counted from the compiled HLO, each loop (the
micro-batches', the log-prob chunks') as often as it runs (train/preflight/hlo_flops.py; XLA's own cost
analysis counts a loop's body once). Each point takes half a minute to two minutes to compile
on a 2-core machine; tests/test_tpu_memory_model.py runs the first.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import tempfile
import time

from benchmarks.common import emit
from benchmarks.live_peak import live_peak


@dataclasses.dataclass(frozen=True)
class Point:
  name: str
  d_model: int
  layers: int
  prompt: int
  new: int
  remat: str = "none"
  micro: int = 0  # micro-batch rows (0: none)
  mesh: tuple[int, int, int] = (1, 4, 1)  # data, fsdp, tensor
  lora: int = 0  # LoRA rank (0: full fine-tuning)
  rollouts: int = 16
  vocab: int = 4096
  scan_layers: str = "auto"  # (auto: scanned, as for any TPU target)
  target: str = ""  # a slice of its own (several hosts); "": the sweep's --target
  tied: bool = True  # the LM head shares the embedding table


POINTS = (
    Point("d256x2 fsdp4", 256, 2, 128, 128),
    Point("d256x2 fsdp4 dots", 256, 2, 128, 128, remat="dots"),
    Point("d256x2 fsdp4 full", 256, 2, 128, 128, remat="full"),
    Point("d512x4 fsdp4", 512, 4, 128, 128),
    Point("d512x4 fsdp4 dots", 512, 4, 128, 128, remat="dots"),
    Point("d512x4 data4", 512, 4, 128, 128, mesh=(4, 1, 1)),
    Point("d512x4 fsdp2 tensor2", 512, 4, 128, 128, mesh=(1, 2, 2)),
    Point("d512x4 fsdp4 micro4", 512, 4, 128, 128, micro=4),
    Point("d512x4 fsdp4 lora8", 512, 4, 128, 128, lora=8),
    Point("d512x2 fsdp4 dots 1024 tokens", 512, 2, 512, 512, remat="dots"),
    Point("d1024x4 fsdp2 micro4 512 tokens", 1024, 4, 128, 384, micro=4, mesh=(1, 2, 1)),
    Point("d1024x8 fsdp4 full 512 tokens", 1024, 8, 256, 256, remat="full"),
    Point("d512x2 fsdp4 dots vocab32768", 512, 2, 128, 128, remat="dots", vocab=32768),
    Point("d512x2 fsdp4 micro4 vocab32768", 512, 2, 128, 128, micro=4, vocab=32768),
    # where a new user's runs first missed (issue 55): two hosts, remat full at a large
    # vocabulary, a large vocabulary over one layer
    Point("d512x4 fsdp8 two hosts", 512, 4, 128, 128, mesh=(1, 8, 1), target="v5p-16"),
    Point("d512x2 fsdp4 full vocab32768", 512, 2, 128, 128, remat="full", vocab=32768),
    Point("d256x1 fsdp4 vocab65536", 256, 1, 128, 128, vocab=65536),
    # where the dry run's verdict contradicted the compiler's (issue 64): the head's product
    # windowed over 16 chips, tied and not; one micro-batch per minibatch against two; remat
    # dots with the splash kernel over long rows
    Point("d512x2 fsdp16 vocab32768", 512, 2, 128, 128, mesh=(1, 16, 1), vocab=32768,
          rollouts=32, target="v5e-16"),
    Point("d512x2 fsdp16 vocab32768 untied", 512, 2, 128, 128, mesh=(1, 16, 1), vocab=32768,
          rollouts=32, target="v5e-16", tied=False),
    Point("d512x4 fsdp4 one micro-batch", 512, 4, 128, 128, micro=16),
    Point("d512x4 fsdp4 two micro-batches", 512, 4, 128, 128, micro=8),
    Point("d512x4 fsdp4 dots 2048 tokens", 512, 4, 512, 1536, remat="dots"),
)


def config(p: Point):
  from jaxrl.config import DataConfig, ExperimentConfig
  from jaxrl.config_rl import BatchingConfig, KLConfig, RLConfig, RolloutConfig
  from jaxrl.models.config import LayersConfig, ModelConfig
  from jaxrl.models.lora import LoRAConfig
  model = ModelConfig(vocab_size=p.vocab, d_model=p.d_model, n_layers=p.layers,
                      n_heads=p.d_model // 64, n_kv_heads=max(2, p.d_model // 256), head_dim=64,
                      d_ff=4 * p.d_model, dtype="bfloat16", tie_embeddings=p.tied,
                      layers=LayersConfig(scan=p.scan_layers, remat=p.remat))
  return ExperimentConfig(model=model, data=DataConfig(max_prompt_tokens=p.prompt),
                          lora=LoRAConfig(rank=p.lora),
                          rl=RLConfig(prompts_per_step=p.rollouts // 2, group_size=2,
                                      rollout=RolloutConfig(max_new_tokens=p.new),
                                      kl=KLConfig(coef=0.05),
                                      batching=BatchingConfig(micro_batch_size=p.micro,
                                                              num_minibatches=1)))


def _actor(cfg, mesh):
  from flax import nnx

  from jaxrl.models import lora
  from jaxrl.models.dtypes import frozen_base_dtypes
  from jaxrl.models.transformer import LanguageModel
  from train.roles.role import ModelRole
  adapters = cfg.lora if cfg.lora.enabled else None
  make = lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(0), lora=adapters)
  if adapters is None:
    return ModelRole("actor", make, mesh)
  return ModelRole("actor", make, mesh, trainable=lora.TRAINABLE,
                   stored_dtypes=functools.partial(frozen_base_dtypes, cfg.model))


def estimate(p: Point, mesh, role=None) -> tuple[float, float]:
  """(jaxrl's update peak on the mesh's first device, jaxrl's FLOPs per device of one call)."""
  import jax
  import numpy as np

  from train.preflight.dry_run import shard_bytes, update_footprint
  from jaxrl.models import flops
  cfg = config(p)
  role = role or _actor(cfg, mesh)
  count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
  params = count(role.abstract())
  trained = shard_bytes(role.split(role.abstract())[0], 4)[mesh.devices.flat[0].id]
  peak = sum(update_footprint(cfg, mesh, role.rules, trained, params).values())
  rl = cfg.rl
  adapters = count(role.split(role.abstract())[0]) if cfg.lora.enabled else 0
  t = p.prompt + p.new
  per_body = flops.executed_train_flops(cfg.model, rl.rollouts, t, p.new, lora_params=adapters,
                                        pass_rows=rl.pass_rows)
  # XLA counts no FLOPs in the splash kernel (a Pallas call): compare what it does count
  per_body -= (4 if p.remat == "full" else 3) * flops.attention_flops(cfg.model, rl.rollouts * t,
                                                                      (t + 1) / 2)
  return peak, per_body / mesh.devices.size


def _compiled(lowered, dump: str, module: str):
  """(compiled, seconds, live peak, allocated) of `lowered` (the jitted function `module`)
  compiled with XLA's dump in `dump`."""
  start = time.perf_counter()
  compiled = lowered.compile({"xla_dump_to": dump, "xla_dump_hlo_as_text": True,
                              "xla_dump_hlo_module_re": module})
  seconds = time.perf_counter() - start
  return compiled, seconds, *live_peak(dump, module)


def measure_scoring(p: Point, mesh, actor) -> dict:
  """The scoring passes at point `p`: the actor's old log-probs (float32 parameters) and the
  reference's (compute dtype), the compiler's temporary bytes against the memory model's."""
  import jax
  import jax.numpy as jnp

  from train.preflight.dry_run import scoring_footprint
  from train.loop.passes import policy_logprobs, scorer
  from train.roles.role import ModelRole
  cfg = config(p)
  rl = cfg.rl
  t, S = p.prompt + p.new, jax.ShapeDtypeStruct
  out = {}
  reference = ModelRole("reference", actor._make_model, mesh, stored_dtypes=lambda a: jax.tree.map(
      lambda x: jnp.dtype(cfg.model.compute_dtype), a))
  for name, role in (("old log-probs", actor), ("reference", reference)):
    arrays = (S((rl.rollouts, t), jnp.int32), S((rl.rollouts, t), bool),
              S((rl.rollouts, p.new), bool))
    arrays = jax.tree.map(lambda x, s: S(x.shape, x.dtype, sharding=s), arrays,
                          role.batch_shardings(arrays))
    with tempfile.TemporaryDirectory() as dump:
      compiled, seconds, live, allocated = _compiled(
          scorer(rl, role, policy_logprobs(rl)).lower(role.abstract(), *arrays), dump, "jit_score")
    temp = compiled.memory_analysis().temp_size_in_bytes
    peak = sum(scoring_footprint(cfg, role).values())
    out[name] = {"temp_bytes": int(temp), "live_bytes": live, "allocated_bytes": allocated,
                 "estimate_bytes": int(peak), "estimate_over_compiler": round(peak / temp, 3),
                 "compile_s": round(seconds, 1)}
  return out


def measure(p: Point, devices) -> dict:
  import numpy as np
  from jax.sharding import Mesh

  from train.preflight import hlo_flops
  from train.preflight.target_compile import abstract_experience
  from sharding.rules import MESH_AXES
  from train.roles.learner import Learner
  from train.updates.policy import policy_update
  from train.updates.state import make_optimizer
  cfg = config(p)
  mesh = Mesh(np.array(devices[:int(np.prod(p.mesh))]).reshape(p.mesh), MESH_AXES)
  role = _actor(cfg, mesh)
  learner = Learner(role, functools.partial(policy_update, cfg=cfg.rl), make_optimizer(1e-5),
                    initialize=False)
  with tempfile.TemporaryDirectory() as dump:
    compiled, seconds, live, allocated = _compiled(learner.lower(abstract_experience(cfg, role)),
                                                   dump, "jit_step")
  memory = compiled.memory_analysis()
  temp = memory.temp_size_in_bytes
  products, _ = hlo_flops.executed_flops(compiled.as_text())  # (every loop as often as it runs)
  peak, per_call = estimate(p, mesh, role)
  return {
      "point": p.name,
      "temp_bytes": int(temp),
      "live_bytes": live,
      "allocated_bytes": allocated,
      "estimate_bytes": int(peak),
      "estimate_over_compiler": round(peak / temp, 3),
      "flops": products,
      "jaxrl_flops": per_call,
      "jaxrl_over_compiler": round(per_call / products, 3),
      "compile_s": round(seconds, 1),
      "argument_bytes": memory.argument_size_in_bytes,
      "output_bytes": memory.output_size_in_bytes,
      "alias_bytes": memory.alias_size_in_bytes,
      "scoring": measure_scoring(p, mesh, role)
  }


def markdown(points: list[dict]) -> list[str]:
  """docs/benchmarks.md's tables of the points (MiB per device): the updates, the scoring
  passes."""
  mib = lambda b: f"{b / 2**20:.1f}"
  lines = ["| point | compiler temp | its live peak | memory model | model / temp | jaxrl FLOPs "
           "/ compiler | compile |", "|---|---|---|---|---|---|---|"]
  for p in points:
    lines.append(f"| {p['point']} | {mib(p['temp_bytes'])} | {mib(p['live_bytes'])} | "
                 f"{mib(p['estimate_bytes'])} | {p['estimate_over_compiler']:.3f} | "
                 f"{p['jaxrl_over_compiler']:.3f} | {p['compile_s']:.0f} s |")
  lines += ["", "| point | old log-probs: compiler temp / model | ratio | reference: compiler "
            "temp / model | ratio |", "|---|---|---|---|---|"]
  for p in points:
    cells = [f"{mib(s['temp_bytes'])} / {mib(s['estimate_bytes'])} | "
             f"{s['estimate_over_compiler']:.2f}" for s in (p["scoring"]["old log-probs"],
                                                           p["scoring"]["reference"])]
    lines.append(f"| {p['point']} | " + " | ".join(cells) + " |")
  return lines


def whole_update_in_hbm() -> None:
  """libtpu told (before it loads) to keep every buffer in HBM: by default its memory-space
  assignment moves up to ~100 MiB of a program's buffers into the chip's VMEM, which is most of
  a small model's update (8 of 55 MB stay in HBM at the first point) and a rounding error at a
  real size, where the memory model is used."""
  flags = " ".join(f"--xla_{chip}_vmem_memory_space_assignment=false" for chip in ("vf", "gf"))
  os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + " " + flags).strip()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--target", default="v5e-4")
  parser.add_argument("--points", default="", help="comma-separated indices (default: all)")
  parser.add_argument("--scan-layers", default="auto",
                      help="model.layers.scan of every point (auto: scanned, as on a TPU)")
  parser.add_argument("--markdown", action="store_true",
                      help="also print docs/benchmarks.md's table")
  args = parser.parse_args()
  whole_update_in_hbm()
  from sharding.host import cpu_only_here
  cpu_only_here()
  from train.preflight.target_compile import no_persistent_cache, topology_devices
  from jaxrl import platform
  from planner.targets import parse_target
  target = parse_target(args.target)
  devices = topology_devices(target)
  chosen = [POINTS[int(i)] for i in args.points.split(",")] if args.points else POINTS
  chosen = [dataclasses.replace(p, scan_layers=args.scan_layers) for p in chosen]
  with platform.building_for("tpu"), no_persistent_cache():  # (AOT programs are not cached)
    points = []
    for p in chosen:
      points.append(measure(p, topology_devices(parse_target(p.target)) if p.target
                            else devices))
      print(points[-1], file=sys.stderr, flush=True)
  if args.markdown:
    print("\n".join(markdown(points)))
  emit({"target": target.accelerator_type, "points": points}, args.json)


if __name__ == "__main__":
  main()
