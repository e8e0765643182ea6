"""One process of the 2-process test (tests/test_multihost.py): joins jax.distributed on
loopback, runs one sharded SFT step on the trainer's mesh (hybrid-sharded, or with `spread` fsdp
across both processes) and reshards its weights to the sampler's mesh and to half the trainer's
devices, and prints a JSON line with the loss and a checksum of the weights in each layout.

  python tests/multihost_worker.py PORT PROCESS_ID [die|spread]
"""
import json
import os
import sys

if __name__ == "__main__":  # as a worker process; imported by the test, it leaves env alone
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl.models.transformer import LanguageModel
from jaxrl.models.config import ModelConfig  # noqa: E402
from sharding.distributed import DistributedConfig, initialize, leave  # noqa: E402
from sharding.mesh import batch_sharding, param_shardings  # noqa: E402
from sharded_init import init_sharded  # noqa: E402
from sharding.placement import host_major_devices, make_placement  # noqa: E402
from sharding.reshard import reshard  # noqa: E402
from sharding.rules import SAMPLER_RULES, TRAIN_RULES  # noqa: E402
from train.updates.sft import sft_update  # noqa: E402
from train.updates.state import TrainState, make_optimizer  # noqa: E402

CFG = ModelConfig(vocab_size=264, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16,
                  d_ff=64)


def batch_np():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, (8, 10)).astype(np.int32)
  return {"tokens": tokens, "valid": np.ones((8, 10), bool), "loss_mask": np.ones((8, 10), bool)}


def run(mesh, *sampler_meshes):
  """One SFT step on `mesh`, then a reshard to each of `sampler_meshes` (none: the trainer's
  weights); the loss and a checksum of the weights on each."""
  graphdef, params, shardings = init_sharded(lambda: LanguageModel(CFG, rngs=nnx.Rngs(0)),
                                             TRAIN_RULES, mesh)
  opt = make_optimizer(1e-2, warmup_steps=1, total_steps=10)
  opt_state = jax.jit(opt.init)(params)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)
  rows = batch_sharding(mesh, TRAIN_RULES)
  batch = {k: jax.make_array_from_callback(v.shape, rows, lambda idx, v=v: v[idx])
           for k, v in batch_np().items()}
  update = jax.jit(functools.partial(sft_update, graphdef=graphdef, optimizer=opt))
  state, metrics = update(state, batch)
  checksums = []
  for target in sampler_meshes or (mesh,):
    params = state.params
    if target is not mesh:
      with jax.transfer_guard_device_to_host("disallow"):  # (no weight through a host)
        params, _ = reshard(params, param_shardings(params, SAMPLER_RULES, target),
                            bucket_bytes=16 << 10)
    checksums.append(float(jax.jit(
        lambda p: sum(jnp.sum(x * (i + 1)) for i, x in enumerate(jax.tree.leaves(p))),
        out_shardings=jax.sharding.NamedSharding(target, jax.sharding.PartitionSpec()))(params)))
  return float(metrics["loss"]), checksums


def main():
  port, pid = int(sys.argv[1]), int(sys.argv[2])
  initialize(DistributedConfig(coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               heartbeat_timeout_s=10))
  if len(sys.argv) > 3 and sys.argv[3] == "die" and pid == 1:
    os._exit(17)  # a crashed peer: the survivor must stop, not hang
  assert jax.process_count() == 2 and len(jax.devices()) == 8
  # hybrid: fsdp inside each host, a whole copy per host; spread: fsdp over both hosts' chips
  train_fsdp = 4 if len(sys.argv) > 3 and sys.argv[3] == "spread" else 0
  placement = make_placement("interleave", 8, train_devices=4, sampler_tensor=2, n_hosts=2,
                             train_fsdp=train_fsdp)
  devices = host_major_devices()
  actor = placement.mesh("actor", devices)
  # the sampler's devices on the same hosts, and half the trainer's (one chip of each host)
  half = jax.sharding.Mesh(actor.devices.reshape(-1)[::2].reshape(1, 2, 1), actor.axis_names)
  loss, checksums = run(actor, placement.mesh("sampler", devices), half)
  print(json.dumps({"process": pid, "loss": loss, "checksums": checksums}), flush=True)
  leave()  # (a normal end: not a death for the other process's watch)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
