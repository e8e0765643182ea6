"""The CLI: `python -m train.main --config=configs/default.py --config.rl.steps=50`.

User errors (unknown or ill-typed config fields, impossible meshes) print one line and exit 2.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sys
import traceback

from absl import flags
from ml_collections import config_flags

from sharding.host import force_cpu_devices, retain_freed_memory

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "configs", "default.py")
EXIT_USER_ERROR = 2


class UsageError(Exception):
  pass


def _config_path(argv: list[str]) -> str:
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return DEFAULT_CONFIG


def _check_override_paths(argv: list[str]) -> None:
  """Names an unknown `--config.a.b` override before absl turns it into a traceback."""
  path = _config_path(argv)
  if not os.path.isfile(path):
    raise UsageError(f"--config: no such config file {path!r}")
  spec = importlib.util.spec_from_file_location("_jaxrl_user_config", path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
    config = module.get_config()
  except Exception as e:  # a broken config file is a user error too
    raise UsageError(f"--config: {path} failed to load: {type(e).__name__}: {e}") from None
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


def parse_config(argv: list[str]):
  """argv -> the locked ConfigDict with overrides applied; UsageError on any user mistake."""
  _check_override_paths(argv)
  flag_values = flags.FlagValues()
  saved, sys.argv = sys.argv, list(argv)  # config_flags reads override names from sys.argv
  try:
    holder = config_flags.DEFINE_config_file(
        "config", DEFAULT_CONFIG, "Experiment config file (a Python file with get_config()).",
        flag_values=flag_values, lock_config=True)
    flag_values(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    raise UsageError(" ".join(str(e).split())) from None
  finally:
    sys.argv = saved
  return holder.value


def _fail(message: str) -> int:
  print(f"jaxrl: error: {message}", file=sys.stderr)
  return EXIT_USER_ERROR


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv if argv is None else argv
  try:
    raw = parse_config(argv)
  except UsageError as e:
    return _fail(str(e))
  cpu_devices = raw.get("placement", {}).get("cpu_devices", 8)
  force_cpu_devices(cpu_devices if isinstance(cpu_devices, int) else 8)
  retain_freed_memory()

  from jaxrl.config import ConfigError, ExperimentConfig, from_mapping, validate
  from jaxrl.data.preferences import PreferenceDataError
  from train.executors import ExecutorError
  from train.loop import make_run_dir, run
  # The jaxrl logger gets its own handler: absl/orbax may have configured the root logger already.
  log = logging.getLogger("jaxrl")
  if not log.handlers:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s jaxrl: %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
  try:
    cfg = validate(from_mapping(ExperimentConfig, raw.to_dict()))
    run_dir = make_run_dir(cfg)
  except (ConfigError, FileExistsError) as e:
    return _fail(str(e))
  print(f"jaxrl: run dir {run_dir}", flush=True)
  try:
    summary = run(cfg, run_dir)
  except (ConfigError, PreferenceDataError) as e:
    return _fail(str(e))
  except KeyboardInterrupt:
    print("jaxrl: interrupted; the last saved checkpoint is intact", file=sys.stderr)
    return 130
  except ExecutorError as e:  # a bug or a crash, not a user error: keep the traceback
    traceback.print_exception(e.__cause__ or e)
    print(f"jaxrl: error: {e}; stopped, saved checkpoints are intact", file=sys.stderr)
    return 1
  if summary.get("stopped"):
    print(f"jaxrl: stopped by {summary['stopped']} after {summary.get('rl_steps_done', 0)} RL "
          f"steps; checkpoint saved in {run_dir}", file=sys.stderr)
    return 128 + signal.Signals[summary["stopped"]].value
  print("jaxrl: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                              for k, v in summary.items()), flush=True)
  return 0


def cli() -> None:
  sys.exit(main())


if __name__ == "__main__":
  cli()
