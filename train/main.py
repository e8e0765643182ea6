"""The CLI: `python -m train.main --config=configs/default.py --config.rl.steps=50`.

User errors (unknown or ill-typed config fields, impossible meshes) print one line and exit 2.
"""
from __future__ import annotations

import logging
import os
import sys

from absl import flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "configs", "default.py"),
    "Experiment config file (a Python file with get_config()).", lock_config=True)

EXIT_USER_ERROR = 2


def _fail(message: str) -> int:
  print(f"jaxrl: error: {message}", file=sys.stderr)
  return EXIT_USER_ERROR


def _force_cpu_devices(n: int) -> None:
  """Fake host devices for the CPU mesh; must happen before JAX creates its CPU backend."""
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if n > 1 and "xla_force_host_platform_device_count" not in xla_flags:
    os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={n}".strip()


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv if argv is None else argv
  try:
    flags.FLAGS(argv)
  except flags.Error as e:
    return _fail(str(e).splitlines()[0])
  raw = _CONFIG.value
  cpu_devices = raw.get("mesh", {}).get("cpu_devices", 8)
  _force_cpu_devices(cpu_devices if isinstance(cpu_devices, int) else 8)

  from jaxrl.config import ConfigError, ExperimentConfig, from_mapping, validate
  from train.loop import make_run_dir, run
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
  try:
    cfg = validate(from_mapping(ExperimentConfig, raw.to_dict()))
    run_dir = make_run_dir(cfg)
  except (ConfigError, FileExistsError) as e:
    return _fail(str(e))
  print(f"jaxrl: run dir {run_dir}", flush=True)
  try:
    summary = run(cfg, run_dir)
  except ConfigError as e:
    return _fail(str(e))
  except KeyboardInterrupt:
    print("jaxrl: interrupted; the last saved checkpoint is intact", file=sys.stderr)
    return 130
  print("jaxrl: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                              for k, v in summary.items()), flush=True)
  return 0


def cli() -> None:
  sys.exit(main())


if __name__ == "__main__":
  cli()
