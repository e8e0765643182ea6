"""What every jaxrl command line shares: the config file and its `--config.a.b=v` overrides
(a typo is a one-line error naming the field), gin files, `--help`, one-line user errors
with exit code 2 (`fail`, `ArgParser`), and starting JAX (fake CPU devices, the accelerators'
memory fraction, several hosts, logging) before anything touches a device."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from absl import flags
from ml_collections import config_flags

from jaxrl.config_checks import unknown_field
from jaxrl.config_files import moved
from sharding.host import (cpu_only_here, force_cpu_devices, pin_to_cores,
                           reserve_device_memory, retain_freed_memory, round_as_written)

def default_config() -> str:
  """configs/default.py of jaxrl's checkout (jaxrl/config_files.py `CONFIGS`)."""
  from jaxrl.config_files import CONFIGS
  return os.path.join(CONFIGS, "default.py")


EXIT_USER_ERROR = 2


class UsageError(Exception):
  pass


def flag_value(argv: list[str], name: str) -> str | None:
  """The value of `--name=V` or `--name V` in argv (read before absl parses it), or None; a
  UsageError when the flag is given more than once."""
  found = [arg.split("=", 1)[1] if arg.startswith(f"--{name}=") else argv[i + 1]
           for i, arg in enumerate(argv)
           if arg.startswith(f"--{name}=") or (arg == f"--{name}" and i + 1 < len(argv))]
  if len(found) > 1:
    raise UsageError(f"--{name}: given {len(found)} times ({', '.join(found)}); pass it once")
  return found[0] if found else None


def load_config_file(path: str):
  """The ConfigDict of an experiment file's get_config(); a UsageError naming the file."""
  if not os.path.isfile(path):
    raise UsageError(f"--config: no such config file {path!r}")
  from jaxrl.config_files import config_module
  try:
    return config_module(path).get_config()
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
        now = moved(f"{walked}.{name}")
        if now:
          raise UsageError(f"{walked}.{name}: has moved to {now} (--{now}=...)")
        options = node.keys() if hasattr(node, "keys") else []
        raise UsageError(unknown_field(f"{walked}.{name}", name, options))
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
  check_overrides(load_config_file(flag_value(argv, "config") or default_config()), argv)
  fv = flags.FlagValues()
  with absl_argv(argv):
    holder = config_flags.DEFINE_config_file(
        "config", default_config(), "Experiment config file (a Python file with get_config()).",
        flag_values=fv, lock_config=True)
    flags.DEFINE_multi_string("gin_file", [], "gin files applied on top", flag_values=fv)
    flags.DEFINE_multi_string("gin_param", [], "gin bindings applied on top", flag_values=fv)
    flags.DEFINE_bool("resume", False, "continue the run from its checkpoints", flag_values=fv)
    flags.DEFINE_bool("resume_or_start", False, "continue the run if it has a checkpoint, else "
                      "start it (a job that restarts itself)", flag_values=fv)
    flags.DEFINE_bool("dry_run", False, "check shardings and memory, run nothing",
                      flag_values=fv)
    flags.DEFINE_string("target", "", "with --dry_run: compile the run's programs for this TPU "
                        "slice (v5p-64, v5e:4x4, ...)", flag_values=fv)
    flags.DEFINE_string("target_json", "", "with --target: the report's numbers as JSON to this "
                        "file", flag_values=fv)
    fv(argv)
  if fv.target and not fv.dry_run:
    raise UsageError("--target compiles for a TPU slice without running: add --dry_run")
  if fv.resume and fv.resume_or_start:
    raise UsageError("--resume and --resume_or_start: pass one (--resume requires a checkpoint)")
  if fv.target_json and not fv.target:
    raise UsageError("--target_json writes what --target compiles: add --target=SLICE")
  return holder.value, fv.gin_file, fv.gin_param, {"resume": fv.resume, "dry_run": fv.dry_run,
                                                   "resume_or_start": fv.resume_or_start,
                                                   "target": fv.target,
                                                   "target_json": fv.target_json}


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


def start_jax(raw, resume: str = "") -> None:
  """Before JAX starts its backend: fake CPU devices, the accelerators' memory fraction (read
  from the raw config; it is validated later), XLA's rounding for `rl.rollout.exact="replay"`,
  the job joined on several hosts (`resume`: the command a survivor names when a peer dies,
  sharding/distributed.py), logging."""
  placement = raw.get("placement", {})
  cpu_devices = placement.get("cpu_devices", 8)
  force_cpu_devices(cpu_devices if isinstance(cpu_devices, int) else 8)
  rollout = raw.get("rl", {}).get("rollout", {})
  if rollout.get("exact") == "replay":  # (its bfloat16 programs round where they say)
    round_as_written()
  fraction = placement.get("device_memory_fraction", 0.9)
  reserve_device_memory(fraction if isinstance(fraction, (int, float)) and 0 <= fraction <= 1
                        else 0.9)
  retain_freed_memory()
  from sharding import distributed
  try:
    distributed.initialize(resume=resume)  # before anything touches a device
  except ValueError as e:
    raise UsageError(str(e)) from None
  import jax
  _setup_logging(jax.process_index() == 0)  # (the backend has started)
  try:
    pinned = pin_to_cores()
  except ValueError as e:
    raise UsageError(str(e)) from None
  if (not pinned and jax.process_count() > 1 and jax.default_backend() == "cpu"
      and len(os.sched_getaffinity(0)) == 1):
    logging.getLogger("jaxrl").warning(
        "this process started on one core (taskset?): JAX's CPU backend then runs one thread, "
        "and arrays crossing to the other processes wait for its programs; pin with "
        "JAXRL_CPU_CORES=N instead (docs/hosts.md)")


def start_jax_on_one_device() -> None:
  """For a command that runs on this process's first device (`jaxrl-sample`, `jaxrl-export`):
  with libtpu installed but no TPU here, JAX starts on the CPU without first trying a TPU runtime
  (which prints half a dozen errors), and logging."""
  cpu_only_here()
  import jax
  _setup_logging(jax.process_index() == 0)
