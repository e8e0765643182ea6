"""The memory and FLOP models against the TPU compiler: the RL update of small models compiled
for a TPU slice on this CPU (libtpu, allocating nothing), per point the compiler's temporary
bytes per device against the memory model's update peak (planner/footprint.py, through the dry
run's `update_footprint`) and the compiler's FLOPs per device against jaxrl's count
(jaxrl/models/flops.py train_flops over the devices).

  python -m benchmarks.target_sweep --json                 # v5e-4
  python -m benchmarks.target_sweep --json --target v5p-8

XLA's cost analysis counts a loop's body once (one micro-batch of one minibatch), so jaxrl's
count of the update's model FLOPs is divided by the bodies; XLA also counts what remat
recomputes, which jaxrl's model FLOPs do not (`full` recomputes each block's forward). Each
point takes one to two minutes to compile on a 2-core machine.
"""
from __future__ import annotations

import argparse
import functools
import time

from benchmarks.common import emit

# (name, d_model, layers, prompt, new tokens, rollouts, remat, micro-batch, fsdp)
POINTS = (("d512x4 fsdp4", 512, 4, 128, 128, 16, "none", 0, 4),
          ("d512x4 fsdp4 dots", 512, 4, 128, 128, 16, "dots", 0, 4),
          ("d1024x4 fsdp2 micro4", 1024, 4, 128, 384, 16, "none", 4, 2),
          ("d1024x8 fsdp4 full", 1024, 8, 256, 256, 16, "full", 0, 4))


def _config(d, layers, prompt, new, rollouts, remat, micro):
  from jaxrl.config import DataConfig, ExperimentConfig, RLConfig
  from jaxrl.models.config import ModelConfig
  model = ModelConfig(vocab_size=4096, d_model=d, n_layers=layers, n_heads=d // 64,
                      n_kv_heads=max(1, d // 256), head_dim=64, d_ff=4 * d, remat=remat,
                      dtype="bfloat16")
  return ExperimentConfig(model=model, data=DataConfig(max_prompt_tokens=prompt),
                          rl=RLConfig(prompts_per_step=rollouts // 2, group_size=2,
                                      max_new_tokens=new, kl_coef=0.05, micro_batch_size=micro,
                                      num_minibatches=1))


def measure(point, devices) -> dict:
  import jax
  import numpy as np
  from flax import nnx
  from jax.sharding import Mesh

  from cli.dry_run import shard_bytes, update_footprint
  from cli.target_compile import abstract_experience
  from jaxrl.models import flops
  from jaxrl.models.transformer import LanguageModel
  from sharding.rules import MESH_AXES
  from train.roles.learner import Learner
  from train.roles.role import ModelRole
  from train.updates.rl import rl_update
  from train.updates.state import make_optimizer
  name, *shape, fsdp = point
  cfg = _config(*shape)
  mesh = Mesh(np.array(devices[:fsdp]).reshape(1, fsdp, 1), MESH_AXES)
  role = ModelRole("actor", lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(0)), mesh)
  learner = Learner(role, functools.partial(rl_update, cfg=cfg.rl), make_optimizer(1e-5),
                    initialize=False)
  start = time.perf_counter()
  compiled = learner.lower(abstract_experience(cfg, role)).compile()
  seconds = time.perf_counter() - start
  temp = compiled.memory_analysis().temp_size_in_bytes
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(role.abstract()))
  on_device = shard_bytes(role.abstract(), 4)[mesh.devices.flat[0].id]
  estimate = sum(update_footprint(cfg, mesh, role.rules, on_device, params).values())
  rl, n = cfg.rl, cfg.rl.max_new_tokens
  # XLA counts a loop's body once: one micro-batch of one minibatch
  bodies = rl.num_minibatches * (rl.rollouts // rl.num_minibatches // (rl.micro_batch_size or
                                                                        rl.rollouts))
  per_body = flops.train_flops(cfg.model, rl.rollouts, cfg.data.max_prompt_tokens + n,
                               n) / fsdp / bodies
  return {"point": name, "temp_bytes": int(temp), "estimate_bytes": int(estimate),
          "estimate_over_compiler": round(estimate / temp, 3), "flops": cost["flops"],
          "jaxrl_flops": per_body, "jaxrl_over_compiler": round(per_body / cost["flops"], 3),
          "compile_s": round(seconds, 1)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--target", default="v5e-4")
  args = parser.parse_args()
  from sharding.host import cpu_only_here
  cpu_only_here()
  from cli.target_compile import no_persistent_cache, topology_devices
  from jaxrl import platform
  from planner.targets import parse_target
  target = parse_target(args.target)
  devices = topology_devices(target)
  with platform.building_for("tpu"), no_persistent_cache():  # (AOT programs are not cached)
    points = [measure(p, devices) for p in POINTS]
  emit({"target": target.accelerator_type, "points": points}, args.json)


if __name__ == "__main__":
  main()
