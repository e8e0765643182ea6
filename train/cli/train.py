"""`jaxrl-train` (`python -m train.cli.train`): `jaxrl-train --config=configs/default.py
--config.rl.steps=50`.

  --config=FILE          an experiment file with get_config() (default: configs/default.py)
  --config.a.b=VALUE     override any field (the config is locked: a typo is an error)
  --gin_file=FILE        gin bindings on top (repeatable), e.g. configs/async_reverse.gin
  --gin_param=BINDING    one binding, e.g. --gin_param=rl.steps=5 (repeatable)
  --resume               continue the run in run_dir/run_name from its newest good checkpoint
                         (an error, exit 2, when it has none)
  --resume_or_start      the same where there is a checkpoint, else start the run: for a job
                         that restarts itself after a preemption
  --dry_run              check the config for its target hardware without allocating anything:
                         parameter shardings on a fake mesh of placement.cpu_devices devices,
                         batch divisibility, per-device memory against placement.device_memory_gb
                         (exit 0 when it fits, 1 when it does not)
  --target=SLICE         with --dry_run: compile the RL step's programs with the TPU compiler
                         for that slice (v5p-64, v6e-16, v5e:4x4, ...; libtpu, allocating
                         nothing): per program the compiler's bytes, FLOPs and a time estimate,
                         per phase the busiest chip against its HBM (train/preflight/target_compile.py)
  --target_json=PATH     with --target: the report's numbers written to PATH as JSON too

A job that seems hung: `kill -USR1 PID` prints every thread's Python stack to its stderr and
the run goes on.

Several hosts: the same command on every host; it joins `jax.distributed` first (auto-detected
on TPU pods and Slurm, else JAXRL_COORDINATOR / JAXRL_NUM_PROCESSES / JAXRL_PROCESS_ID).
User errors (unknown or ill-typed fields, impossible meshes, bad data files) print one line and
exit 2. Before JAX starts: fake CPU devices only when JAX will run on the CPU, and
placement.device_memory_fraction of each accelerator's memory (sharding/host.py). Compiled
programs are cached in ~/.cache/jaxrl/xla (config.compilation_cache_dir, or
JAXRL_COMPILATION_CACHE=DIR|off; train/io/compilation.py).
"""
from __future__ import annotations

import faulthandler
import signal
import sys
import traceback

from train.cli.flags import UsageError, fail, parse_args, print_help, start_jax


def _start(argv: list[str]):
  """Parses the arguments, joins the job, resolves the config: the Experiment, or an exit code
  for a user error."""
  try:
    raw, gin_files, gin_params, opts = parse_args(argv)
    start_jax(raw, resume=" ".join(["jaxrl-train", *(a for a in argv[1:] if a not in RESUMING),
                                    "--resume"]))
  except UsageError as e:
    return fail(str(e))
  from jaxrl.config import ConfigError
  from jaxrl.config_files import with_gin
  from train.run import Experiment
  try:
    cfg = with_gin(raw, gin_files, gin_params)
    if opts["dry_run"]:
      return _dry_run(cfg, opts["target"], opts["target_json"])
    from jaxrl.config_files import resolve
    from train.roles.layout import layout
    run = layout(resolve(cfg))  # (worked out once, here)
    if run.split is not None:
      _name_groups(run.split)
      if run.split.here != "trainer":  # a group apart: it serves the trainer's processes
        from train.run.apart import serve
        return serve(run)
    return Experiment(cfg, resume_run=opts["resume"] or opts["resume_or_start"],
                      start_if_none=opts["resume_or_start"], layout=run)
  except ConfigError as e:
    return fail(str(e))


RESUMING = ("--resume", "--resume_or_start")


def _release_groups() -> None:
  from sharding.distributed import kv_client
  if kv_client() is not None:  # (a job of several processes was joined)
    from train.roles.link import release_groups
    release_groups()


def _name_groups(split) -> None:
  """Each process's group, for the line a survivor prints should one die (sharding/distributed.py);
  with several generators, which one each serves (one that dies is dropped)."""
  import jax
  from sharding.distributed import job
  several = len(split.replicas) > 1
  for p in range(jax.process_count()):
    group, r = split.group_of(p), split.replica_of(p)
    job().groups[p] = ("the scorers'" if group == "scorers" else
                       "the trainer's" if group == "trainer" else
                       f"generator {r}'s" if several else "the sampler's")
    if several and r is not None:
      job().replicas[p] = r


def _dry_run(cfg, target: str, target_json: str) -> int:
  if target:  # (an unknown target or a refused program: a ConfigError, exit 2)
    from train.preflight.target_report import report
    from planner.targets import parse_target
    lines, fits = report(cfg, parse_target(target), target_json)
  else:
    from train.preflight.dry_run import report
    lines, fits = report(cfg)
  print("\n".join(f"jaxrl: dry run: {line}" for line in lines), flush=True)
  return 0 if fits else 1


def _compiles_for_a_target(argv: list[str]) -> bool:
  """`--dry_run --target=...` outside the child that compiles (train/preflight/compile_guard.py)."""
  import os

  from train.preflight.compile_guard import CHILD
  dry = {"--dry_run", "-dry_run", "--dry_run=true", "--dry_run=True", "--dry_run=1"}
  return (any(a.lstrip("-").startswith("target") for a in argv) and any(a in dry for a in argv)
          and not os.environ.get(CHILD))


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv if argv is None else argv
  if print_help(argv, __doc__):
    return 0
  if _compiles_for_a_target(argv):
    from train.preflight import compile_guard
    return compile_guard.run([sys.executable, "-m", "train.cli.train", *argv[1:]])
  exp = _start(argv)
  if isinstance(exp, int):
    _release_groups()  # (a trainer that stopped early: the groups apart leave too)
    return exp
  import jax

  from jaxrl.config import ConfigError
  from sharding.distributed import explained_by_a_lost_peer
  from train.io.checkpoint import CheckpointError
  from train.loop.executors import ExecutorError
  from train.run.hooks import NumericsError
  primary = jax.process_index() == 0
  if primary:
    print(f"jaxrl: run dir {exp.run_dir}", flush=True)
  try:
    summary = exp.run()
  except ConfigError as e:
    return fail(str(e))
  except KeyboardInterrupt:
    print("jaxrl: interrupted; the last saved checkpoint is intact", file=sys.stderr)
    return 130
  except (NumericsError, CheckpointError) as e:  # the model diverged, a disk failed: one line
    print(f"jaxrl: error: {e}", file=sys.stderr)
    return 1
  except ExecutorError as e:
    explained_by_a_lost_peer()  # (a worker's collective with a dead peer: that line instead)
    if isinstance(e.__cause__, ConfigError):  # e.g. a user reward function that misbehaved
      return fail(f"{e.__cause__}; stopped, saved checkpoints are intact")
    # A bug or a crash, not a user error: keep the traceback.
    traceback.print_exception(e.__cause__ or e)
    print(f"jaxrl: error: {e}; stopped, saved checkpoints are intact", file=sys.stderr)
    return 1
  except Exception:
    # A collective that failed with a dead peer: the peer watch's line and exit, before closing
    # anything (closing would release the generator's processes as from a normal end)
    explained_by_a_lost_peer()
    raise
  finally:
    exp.close()
  if summary.get("stopped"):
    print(f"jaxrl: stopped by {summary['stopped']}; checkpoint saved in {exp.run_dir} "
          f"(continue with --resume)", file=sys.stderr)
    return _stopped_exit(summary["stopped"])
  if primary:
    from train.io.metrics import shown
    print("jaxrl: " + ", ".join(f"{k}={shown(v)}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in summary.items() if not isinstance(v, dict)),
          flush=True)  # nested entries (compile seconds per label) are in summary.json
  return 0


def _stopped_exit(name: str) -> int:
  """A run stopped after saving: SIGTERM (a preemption, a scheduler's stop) is a clean end, 0,
  on every process (srun --kill-on-bad-exit would kill the others' saves on a non-zero code);
  Ctrl-C 130, as shells expect."""
  if name == "SIGTERM":
    return 0
  return 128 + signal.Signals[name].value if name in signal.Signals.__members__ else 1


def cli() -> None:
  from sharding import distributed
  faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung job: kill -USR1 PID
  try:
    code = main()
  except Exception:
    distributed.explained_by_a_lost_peer()  # (a dead peer: its line, and exit, instead)
    raise
  distributed.leave()  # (a normal end, whatever its code: not a death for the other processes)
  sys.exit(code)


if __name__ == "__main__":
  cli()
