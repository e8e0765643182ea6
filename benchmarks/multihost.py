"""The async generator on processes of its own: async over sync steps/s, and the cross-process
weight push against memcpy.

  python -m benchmarks.multihost --json

Both parts run 4 CPU processes of one device each on loopback, the trainer on 2 and the sampler
on 2 (`separate` on whole hosts: train/rollout/remote.py).
  steps   the CLI on a workload (`--workload`: longtail, generation-bound: configs/tiny.py,
          multi-turn `synthetic_longtail` conversations, long completions; balanced: a d256
          model whose generation and update take about as long), sync (the remote worker at
          max_staleness 0) and async (fixed, max_staleness 1), alternately `--repeats` times;
          RL steps per second after the first step (which compiles), and the trainer's mean
          seconds per step waiting for its batch, scoring and updating. `--pin` gives the
          trainer's processes core 0 and the sampler's core 1 (JAXRL_CPU_CORES: pinned once
          JAX has started, sharding/host.py `pin_to_cores`).
  push    a float32 model of `--push-mb` MB crossing from the trainer's 2 processes to the
          sampler's 2 (sharding/crossing.py: the same shard shapes on both sides), timed on the
          receivers until the arrays are ready, against memcpy of the bytes each receiver gets,
          in the same process.
On a 2-core machine the 4 processes share the cores, so the ratio there says little about
accelerators, whose generator and trainer do not.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from sharding.distributed import loopback_port
from train.io.timeline import overlap_seconds, read_trace, seconds_within

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACED = ["--config=configs/tiny.py", "--config.sft.steps=0", "--config.eval.every=100",
          "--config.checkpoint_every=100", "--config.placement.strategy=separate",
          "--config.placement.train_devices=2", "--config.placement.train_fsdp=1",
          "--config.placement.cpu_devices=1", "--config.rl.rollout.ignore_eos=True"]
WORKLOADS = {
    # generation-bound: multi-turn conversations, long completions
    "longtail": ["--config.rl.environment.name=synthetic_longtail",
                 "--config.rl.rollout.max_new_tokens=48"],
    # generation and the update about as long (1.3 and 1.4 s a step on a 2-core Xeon, pinned)
    "balanced": ["--config.rl.rollout.max_new_tokens=32", "--config.model.d_model=256",
                 "--config.model.n_heads=4", "--config.model.head_dim=64",
                 "--config.model.d_ff=1024", "--config.model.n_layers=2",
                 "--config.rl.batching.num_minibatches=8"],
}
PINNED = [0, 0, 1, 1]  # --pin: the trainer's processes on core 0, the sampler's on core 1


def _launch(argv: list[str], n: int = 4, cores: list[int | None] | None = None) -> list[str]:
  """`argv` as `n` processes joined on loopback, process i pinned to `cores[i]`; their stdouts
  (each must succeed)."""
  port = loopback_port(n)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  cores = cores or [None] * n
  pins = [{} if core is None else {"JAXRL_CPU_CORES": str(core)} for core in cores]
  procs = [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**env, **pins[i],
                                            "JAXRL_COORDINATOR": f"127.0.0.1:{port}",
                                            "JAXRL_NUM_PROCESSES": str(n),
                                            "JAXRL_PROCESS_ID": str(i)}) for i in range(n)]
  outs = [p.communicate(timeout=1200) for p in procs]
  for p, (_, err) in zip(procs, outs):
    if p.returncode:
      raise SystemExit(f"benchmarks.multihost: a process failed:\n{err[-3000:]}")
  return [out for out, _ in outs]


def steps_per_s(mode: str, steps: int, run_dir: str, workload: str,
                cores: list[int] | None = None) -> tuple[float, dict]:
  """RL steps per second after the first (which compiles), the trainer's mean seconds per step
  waiting for its batch (`time_generate`), scoring and updating, and the generator's per step:
  generating, idle, and generating while the trainer runs (the run's trace.json)."""
  name = f"{mode}-{os.urandom(4).hex()}"
  extra = [f"--config.rl.steps={steps}", f"--config.rl.schedule.mode={mode}",
           "--config.rl.schedule.name=fixed", f"--config.run_dir={run_dir}",
           f"--config.run_name={name}"]
  _launch([sys.executable, "-m", "train.cli.train", *PLACED, *WORKLOADS[workload], *extra],
          cores=cores)
  with open(os.path.join(run_dir, name, "metrics.jsonl")) as f:
    rows = [r for line in f if (r := json.loads(line))["phase"] == "rl" and "loss" in r][1:]
  seconds = {k: sum(r[k] for r in rows) / len(rows)
             for k in ("time_generate", "time_score", "time_update")}
  spans = read_trace(os.path.join(run_dir, name, "trace.json"))
  since = next(e for label, _, e in spans["trainer"] if label == "update")  # (step 1's end)
  until = spans["trainer"][-1][2]
  busy = seconds_within(spans["sampler"], since, until)
  seconds.update(generating=busy / len(rows), generator_idle=(until - since - busy) / len(rows),
                 overlapped=overlap_seconds(spans["sampler"], spans["trainer"], since) / len(rows))
  return len(rows) / sum(r["step_time"] for r in rows), {k: round(v, 3) for k, v in seconds.items()}


def push_worker(mb: int, repeats: int) -> None:
  """One process of the push part (run by `_launch`): prints its JSON timings."""
  from sharding.distributed import initialize, leave
  from sharding.host import force_cpu_devices, pin_to_cores
  force_cpu_devices(1)
  initialize()
  import jax
  jax.devices()  # (the backend started: then the pin, sharding/host.py)
  pin_to_cores()
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from planner.measure import best_seconds
  from sharding import crossing
  devices = sorted(jax.devices(), key=lambda d: d.process_index)
  train, sampler = (Mesh(np.asarray(devices[i:i + 2]), ("fsdp",)) for i in (0, 2))
  rows = (mb << 20) // 4 // 1024
  spec = NamedSharding(train, PartitionSpec("fsdp"))
  sender = jax.process_index() < 2
  arrays = {str(i): jax.jit(lambda: jnp.ones((rows // 8, 1024), jnp.float32),
                            out_shardings=spec)() for i in range(8)} if sender else {}
  described = {str(i): [[rows // 8, 1024], "float32", ["fsdp"]] for i in range(8)}

  def push():
    if sender:
      crossing.send(arrays, sampler)
      return
    jax.block_until_ready(crossing.receive(described, train, sampler))

  seconds = best_seconds(push, repeats=repeats)
  received = (mb << 20) // 2  # each receiver gets half the model
  src = np.ones(received // 4, np.float32)
  dst = np.empty_like(src)
  memcpy_s = best_seconds(lambda: np.copyto(dst, src), repeats=repeats)
  print(json.dumps({"process": jax.process_index(), "seconds": seconds, "memcpy_s": memcpy_s,
                    "bytes": received}), flush=True)
  leave()  # (a normal end: not a death for the others' peer watch)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--push-mb", type=int, default=256)
  parser.add_argument("--workload", choices=sorted(WORKLOADS), default="longtail")
  parser.add_argument("--pin", action="store_true",
                      help="the trainer's processes on core 0, the sampler's on core 1")
  parser.add_argument("--push-worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.push_worker:
    return push_worker(args.push_mb, args.repeats + 2)
  from benchmarks.common import emit
  cores = PINNED if args.pin else None
  runs = {"sync": [], "async": []}
  with tempfile.TemporaryDirectory() as run_dir:
    for _ in range(args.repeats):  # alternately: the machine's drift hits both
      for mode in runs:
        runs[mode].append(steps_per_s(mode, args.steps, run_dir, args.workload, cores))
  (sync, sync_s), (asynchronous, async_s) = (max(runs[m], key=lambda r: r[0]) for m in runs)
  outs = _launch([sys.executable, "-m", "benchmarks.multihost", "--push-worker",
                  f"--push-mb={args.push_mb}", f"--repeats={args.repeats}"], cores=cores)
  receivers = [json.loads(out.strip().splitlines()[-1]) for out in outs[2:]]
  push_s = max(r["seconds"] for r in receivers)
  memcpy_s = max(r["memcpy_s"] for r in receivers)
  nbytes = receivers[0]["bytes"]
  emit({"workload": args.workload, "pinned": args.pin, "sync_steps_per_s": round(sync, 4),
        "async_steps_per_s": round(asynchronous, 4),
        "async_over_sync": round(asynchronous / sync, 3), "sync_seconds": sync_s,
        "async_seconds": async_s,
        "push_bytes": args.push_mb << 20, "push_seconds": round(push_s, 4),
        "push_gbps_per_receiver": round(nbytes / push_s / 1e9, 3),
        "memcpy_gbps": round(nbytes / memcpy_s / 1e9, 3),
        "push_ratio_to_memcpy": round(memcpy_s / push_s, 4), "processes": 4,
        "cores": os.cpu_count()}, args.json)


if __name__ == "__main__":
  main()
