"""The CLI: `python -m cli.train --config=configs/default.py --config.rl.steps=50`.

  --config=FILE          an experiment file with get_config() (default: configs/default.py)
  --config.a.b=VALUE     override any field (the config is locked: a typo is an error)
  --gin_file=FILE        gin bindings on top (repeatable), e.g. configs/async_reverse.gin
  --gin_param=BINDING    one binding, e.g. --gin_param=rl.steps=5 (repeatable)
  --resume               continue the run in run_dir/run_name from its newest good checkpoint
                         (a fresh start when it has none)
  --dry_run              check the config for its target hardware without allocating anything:
                         parameter shardings on a fake mesh of placement.cpu_devices devices,
                         batch divisibility, per-device memory against placement.device_memory_gb
                         (exit 0 when it fits, 1 when it does not)

Several hosts: the same command on every host; it joins `jax.distributed` first (auto-detected
on TPU pods and Slurm, else JAXRL_COORDINATOR / JAXRL_NUM_PROCESSES / JAXRL_PROCESS_ID).
User errors (unknown or ill-typed fields, impossible meshes, bad data files) print one line and
exit 2. Before JAX starts: fake CPU devices only when JAX will run on the CPU, and
placement.device_memory_fraction of each accelerator's memory (sharding/host.py). Compiled
programs are cached in ~/.cache/jaxrl/xla (config.compilation_cache_dir, or
JAXRL_COMPILATION_CACHE=DIR|off; train/compilation.py).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import signal
import sys
import traceback

from absl import flags
from ml_collections import config_flags

from sharding.host import force_cpu_devices, reserve_device_memory, retain_freed_memory

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "configs", "default.py")
EXIT_USER_ERROR = 2


class UsageError(Exception):
  pass


def flag_value(argv: list[str], name: str) -> str | None:
  """The value of `--name=V` or `--name V` in argv (read before absl parses it), or None."""
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      return arg.split("=", 1)[1]
    if arg == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def load_config_file(path: str):
  """The ConfigDict of an experiment file's get_config(); a UsageError naming the file."""
  if not os.path.isfile(path):
    raise UsageError(f"--config: no such config file {path!r}")
  spec = importlib.util.spec_from_file_location("_jaxrl_user_config", path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
    return module.get_config()
  except Exception as e:  # a broken config file is a user error too
    raise UsageError(f"--config: {path} failed to load: {type(e).__name__}: {e}") from None


def check_overrides(config, argv: list[str]) -> None:
  """Names an unknown `--config.a.b` override before absl turns it into a traceback."""
  for arg in argv[1:]:
    if not arg.startswith("--config."):
      continue
    dotted = arg[len("--config."):].split("=", 1)[0]
    node, walked = config, "config"
    for name in dotted.split("."):
      if not hasattr(node, "keys") or name not in node.keys():
        options = sorted(node.keys()) if hasattr(node, "keys") else []
        raise UsageError(f"{walked}.{name}: unknown field; expected one of {options}")
      node, walked = node[name], f"{walked}.{name}"


def print_help(argv: list[str], doc: str) -> bool:
  """`--help` / `-h`: the module's usage text on stdout (True: the caller exits 0)."""
  if any(arg in ("--help", "-h", "--helpfull") for arg in argv[1:]):
    print(doc.strip())
    return True
  return False


@contextlib.contextmanager
def absl_argv(argv: list[str]):
  """Defining and parsing absl flags on `argv`: config_flags reads the override names from
  sys.argv, so argv stands in for it; absl's errors become one-line UsageErrors."""
  saved, sys.argv = sys.argv, list(argv)
  try:
    yield
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    raise UsageError(" ".join(str(e).split())) from None
  finally:
    sys.argv = saved


def parse_args(argv: list[str]):
  """argv -> (locked ConfigDict with overrides, gin files, gin bindings, flags)."""
  check_overrides(load_config_file(flag_value(argv, "config") or DEFAULT_CONFIG), argv)
  fv = flags.FlagValues()
  with absl_argv(argv):
    holder = config_flags.DEFINE_config_file(
        "config", DEFAULT_CONFIG, "Experiment config file (a Python file with get_config()).",
        flag_values=fv, lock_config=True)
    flags.DEFINE_multi_string("gin_file", [], "gin files applied on top", flag_values=fv)
    flags.DEFINE_multi_string("gin_param", [], "gin bindings applied on top", flag_values=fv)
    flags.DEFINE_bool("resume", False, "continue the run from its checkpoints", flag_values=fv)
    flags.DEFINE_bool("dry_run", False, "check shardings and memory, run nothing",
                      flag_values=fv)
    fv(argv)
  return holder.value, fv.gin_file, fv.gin_param, {"resume": fv.resume, "dry_run": fv.dry_run}


class ArgParser(argparse.ArgumentParser):
  """argparse whose bad flags are one line on stderr and exit code 2 (no usage block)."""

  def error(self, message: str):
    sys.exit(fail(f"{self.prog}: {message}"))


def fail(message: str) -> int:
  """A user error: one line on stderr, exit code 2."""
  print(f"jaxrl: error: {message}", file=sys.stderr)
  return EXIT_USER_ERROR


class _StderrHandler(logging.StreamHandler):
  """Writes to the current `sys.stderr`, not the one it was made with (a second `main` in one
  process, as the tests run it, may have another)."""

  @property
  def stream(self):
    return sys.stderr

  @stream.setter
  def stream(self, value) -> None:
    pass


def _setup_logging(primary: bool) -> None:
  # The jaxrl logger gets its own handler: absl/orbax may have configured the root logger.
  log = logging.getLogger("jaxrl")
  if not log.handlers:
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s jaxrl: %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if primary else logging.WARNING)
    log.propagate = False


def start_jax(raw) -> None:
  """Before JAX starts its backend: fake CPU devices, the accelerators' memory fraction (read
  from the raw config; it is validated later), the job joined on several hosts, logging."""
  placement = raw.get("placement", {})
  cpu_devices = placement.get("cpu_devices", 8)
  force_cpu_devices(cpu_devices if isinstance(cpu_devices, int) else 8)
  fraction = placement.get("device_memory_fraction", 0.9)
  reserve_device_memory(fraction if isinstance(fraction, (int, float)) and 0 <= fraction <= 1
                        else 0.9)
  retain_freed_memory()
  from sharding import distributed
  try:
    distributed.initialize()  # before anything touches a device
  except ValueError as e:
    raise UsageError(str(e)) from None
  import jax
  _setup_logging(jax.process_index() == 0)


def _start(argv: list[str]):
  """Parses the arguments, joins the job, resolves the config: the Experiment, or an exit code
  for a user error."""
  try:
    raw, gin_files, gin_params, opts = parse_args(argv)
    start_jax(raw)
  except UsageError as e:
    return fail(str(e))
  from jaxrl.config import ConfigError
  from jaxrl.config_files import with_gin
  from train.run import Experiment
  try:
    cfg = with_gin(raw, gin_files, gin_params)
    if opts["dry_run"]:
      return _dry_run(cfg)
    return Experiment(cfg, resume_run=opts["resume"])
  except ConfigError as e:
    return fail(str(e))


def _dry_run(cfg) -> int:
  from cli.dry_run import report
  lines, fits = report(cfg)
  print("\n".join(f"jaxrl: dry run: {line}" for line in lines), flush=True)
  return 0 if fits else 1


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv if argv is None else argv
  if print_help(argv, __doc__):
    return 0
  exp = _start(argv)
  if isinstance(exp, int):
    return exp
  import jax
  from jaxrl.config import ConfigError
  from train.rl.executors import ExecutorError
  from train.io.checkpoint import CheckpointError
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
    if isinstance(e.__cause__, ConfigError):  # e.g. a user reward function that misbehaved
      return fail(f"{e.__cause__}; stopped, saved checkpoints are intact")
    # A bug or a crash, not a user error: keep the traceback.
    traceback.print_exception(e.__cause__ or e)
    print(f"jaxrl: error: {e}; stopped, saved checkpoints are intact", file=sys.stderr)
    return 1
  finally:
    exp.close()
  if summary.get("stopped"):
    print(f"jaxrl: stopped by {summary['stopped']}; checkpoint saved in {exp.run_dir} "
          f"(continue with --resume)", file=sys.stderr)
    name = summary["stopped"]
    return 128 + signal.Signals[name].value if name in signal.Signals.__members__ else 1
  if primary:
    from train.io.metrics import shown
    print("jaxrl: " + ", ".join(f"{k}={shown(v)}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in summary.items() if not isinstance(v, dict)),
          flush=True)  # nested entries (compile seconds per label) are in summary.json
  return 0


def cli() -> None:
  sys.exit(main())


if __name__ == "__main__":
  cli()
