"""An RL step keeps rollouts on devices: with every host transfer but the named ones disallowed
(JAX's transfer guard, implicit and explicit), a step runs, and the host sees only the prompts,
the completions' token ids (for the verifier), the rewards and the metrics; plus the weight
push, whose layout change jax.device_put routes through the host (train/io/host_transfers.py)."""
import jax
import numpy as np

from jaxrl.config_files import shipped
from train.run import Experiment

tiny = shipped("tiny")


def test_rl_step_has_no_hidden_host_round_trip(tmp_path):
  raw = tiny.get_config().to_dict()
  raw.update(run_dir=str(tmp_path), run_name="guard", checkpoint_every=1000)
  raw["eval"]["every"] = 1000
  raw["rl"]["steps"] = 3
  with Experiment(raw) as exp:
    assert exp.checkpointer.transfers is exp.ctx.transfers  # one record, the run's
    exp.rl.step()  # compiles, evaluates the starting policy
    exp.ctx.transfers.clear()
    guards = ("jax_transfer_guard_host_to_device", "jax_transfer_guard_device_to_host")
    before = {name: getattr(jax.config, name) for name in guards}
    try:
      for name in guards:  # global, so the executors' threads are guarded too
        jax.config.update(name, "disallow_explicit")
      row = exp.rl.step()
    finally:
      for name, value in before.items():
        jax.config.update(name, value)
    rollouts, new_tokens = 8 * 2, exp.ctx.task.max_new_tokens
    record = exp.ctx.transfers.record()
  assert row["step"] == 2 and np.isfinite(row["loss"])
  assert set(record) == {"prompts", "lengths", "completions", "rewards", "metrics", "weights"}
  assert record["completions"] == rollouts * new_tokens * 4  # int32 token ids, nothing else
  assert record["lengths"] == record["rewards"] == rollouts * 4  # one int32 / float32 per row


def test_the_record_counts_every_transfer_from_threads_at_once():
  """The executors' threads count into the run's record at once: none is lost, and another
  run's record (another HostTransfers) counts apart."""
  import sys
  import threading
  import jax.numpy as jnp
  from train.io.host_transfers import HostTransfers
  record, other = HostTransfers(), HostTransfers()
  x = jnp.ones(4, jnp.float32)
  start = threading.Barrier(8)

  def work():
    start.wait()
    for _ in range(50000):
      record.count("counted", 1)
    for _ in range(20):
      record.to_host(x, "fetched")
      with record.allowed("allowed", x):
        pass

  switch = sys.getswitchinterval()
  sys.setswitchinterval(1e-6)  # threads interleave at every few bytecodes
  try:
    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  finally:
    sys.setswitchinterval(switch)
  assert record.record() == {"counted": 8 * 50000, "fetched": 8 * 20 * 16, "allowed": 8 * 20 * 16}
  assert other.record() == {}
  record.clear()
  assert record.record() == {}
