"""The run directory: `run_dir/run_name` (a timestamp when unnamed), with the resolved config.

A directory that holds checkpoints is only reopened to resume it; then its config.json is
rewritten with the config the run continues under once a checkpoint has restored under it
(`write_config`: a resume that fails leaves it alone), and the fields that changed are logged.
On several processes they agree on the timestamp, and only process 0 writes.
"""
from __future__ import annotations

import json
import logging
import os
import time

import jax

from jaxrl.config import ConfigError, ExperimentConfig, to_dict
from sharding.distributed import agree

log = logging.getLogger("jaxrl")


def _timestamp() -> str:
  now = agree(int(time.time()), "timestamp")  # process 0's clock names the run
  return time.strftime("%Y%m%d-%H%M%S", time.localtime(now))


def _changes(old: dict, new: dict, path: str = "config") -> list[str]:
  out = []
  for key in sorted(set(old) | set(new)):
    a, b = old.get(key), new.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      out += _changes(a, b, f"{path}.{key}")
    elif a != b:
      out.append(f"{path}.{key}: {a!r} -> {b!r}")
  return out


_WHERE = ("run_dir", "run_name")


def has_checkpoints(run_dir: str) -> bool:
  root = os.path.join(run_dir, "checkpoints")
  return os.path.isdir(root) and any(os.scandir(root))


def prepare(cfg: ExperimentConfig, *, resume: bool, run_dir: str | None = None,
            start_if_none: bool = False) -> str:
  """`run_dir` (default: config.run_dir/run_name), created, with the config written to it
  (a resumed run's: see `write_config`). `resume` with no checkpoint to resume is a
  ConfigError, unless `start_if_none`."""
  if resume and not (run_dir or cfg.run_name):
    raise ConfigError("config.run_name: --resume continues a named run; set the name the run "
                      "was started with")
  run_dir = run_dir or os.path.join(cfg.run_dir, cfg.run_name or _timestamp())
  if has_checkpoints(run_dir) and not resume:
    raise ConfigError(f"config.run_name: {run_dir} already holds checkpoints; pass --resume to "
                      f"continue that run, or pick a new name")
  if resume and not start_if_none and not has_checkpoints(run_dir):
    raise ConfigError(f"config.run_name: --resume found nothing to resume in {run_dir} (no "
                      f"checkpoint under {os.path.join(run_dir, 'checkpoints')}); check the run "
                      f"name, drop --resume to start the run, or pass --resume_or_start")
  path = os.path.join(run_dir, "config.json")
  if resume and os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      old = json.load(f)
    # where the run lives is how it is found, not how it runs: an unnamed run's timestamp
    # directory resumed by that name, or a run dir moved, changes nothing
    changed = _changes({k: v for k, v in old.items() if k not in _WHERE},
                       {k: v for k, v in to_dict(cfg).items() if k not in _WHERE})
    if changed:
      log.warning("resuming with a changed config: %s", "; ".join(changed))
  if not resume or not os.path.exists(path):
    write_config(cfg, run_dir)
  return run_dir


def write_config(cfg: ExperimentConfig, run_dir: str) -> None:
  """config.json, replaced whole (process 0), in a directory made first."""
  path = os.path.join(run_dir, "config.json")
  if jax.process_index() == 0:
    try:
      os.makedirs(run_dir, exist_ok=True)
      with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(to_dict(cfg), f, indent=2)
      os.replace(path + ".tmp", path)
    except OSError as e:  # a file in the way, no permission, a full or read-only disk
      raise ConfigError(f"config.run_dir: cannot write the run directory {run_dir} "
                        f"({e.strerror or type(e).__name__}: {e.filename or run_dir})") from None
  agree(True, "run dir")  # process 0 wrote it: it exists before anyone reads it
