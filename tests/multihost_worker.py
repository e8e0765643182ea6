"""One process of the 2-process test (tests/test_multihost.py): joins jax.distributed on
loopback, runs one sharded SFT step on the hybrid-sharded trainer mesh and one reshard to the
sampler mesh, and prints a JSON line with the loss and a checksum of the resharded weights.

  python tests/multihost_worker.py PORT PROCESS_ID [die]
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
from sharding.distributed import DistributedConfig, initialize  # noqa: E402
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


def run(mesh, sampler_mesh=None):
  """One SFT step on `mesh`, then (optionally) a reshard to `sampler_mesh`; returns results."""
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
  params = state.params
  if sampler_mesh is not None:
    params, _ = reshard(params, param_shardings(params, SAMPLER_RULES, sampler_mesh),
                        bucket_bytes=16 << 10)
  checksum = jax.jit(lambda p: sum(jnp.sum(x * (i + 1)) for i, x in enumerate(jax.tree.leaves(p))),
                     out_shardings=jax.sharding.NamedSharding(
                         sampler_mesh or mesh, jax.sharding.PartitionSpec()))(params)
  return float(metrics["loss"]), float(checksum)


def main():
  port, pid = int(sys.argv[1]), int(sys.argv[2])
  initialize(DistributedConfig(coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               heartbeat_timeout_s=10))
  if len(sys.argv) > 3 and sys.argv[3] == "die" and pid == 1:
    os._exit(17)  # a crashed peer: the survivor must stop, not hang
  assert jax.process_count() == 2 and len(jax.devices()) == 8
  placement = make_placement("interleave", 8, train_devices=4, sampler_tensor=2, n_hosts=2)
  devices = host_major_devices()
  loss, checksum = run(placement.mesh("actor", devices), placement.mesh("sampler", devices))
  print(json.dumps({"process": pid, "loss": loss, "checksum": checksum}), flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
