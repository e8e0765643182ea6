"""Process start: the persistent compilation cache, compile seconds per label, fake CPU devices
only on the CPU, and how much accelerator memory JAX takes."""
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from jaxrl.config import ConfigError, ExperimentConfig, PlacementConfig, usable_memory_gb
from jaxrl.config_files import from_mapping
from sharding.host import force_cpu_devices, reserve_device_memory
from train.io import compilation

ROOT = __file__.rsplit("/tests/", 1)[0]
# The smallest run that still compiles every RL program: no SFT, one step of one minibatch.
CHEAP = ["--config=configs/tiny.py", "--config.sft.steps=0", "--config.rl.steps=1",
         "--config.rl.batching.num_minibatches=1", "--config.placement.strategy=colocate"]


@pytest.mark.slow
def test_a_second_start_loads_its_programs_from_the_cache(tmp_path):
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAXRL_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR")}
  env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")  # the default directory, under this test's
  summaries, logs = [], []
  for name in ("cold", "warm"):
    proc = subprocess.run(
        [sys.executable, "-m", "train.cli.train", *CHEAP, f"--config.run_dir={tmp_path}",
         f"--config.run_name={name}"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries.append(json.loads((tmp_path / name / "summary.json").read_text()))
    logs.append(proc.stderr)
  cold, warm = summaries
  assert any((tmp_path / "xdg" / "jaxrl" / "xla").iterdir())
  for label in ("generate", "update"):
    assert cold["compile"][label]["programs"] >= 1 and cold["compile"][label]["cache_hits"] == 0
    assert warm["compile"][label]["cache_hits"] == warm["compile"][label]["programs"] >= 1
  assert warm["compile_cache_hits"] > cold["compile_cache_hits"]
  assert warm["compile_s"] < 0.5 * cold["compile_s"], (cold["compile"], warm["compile"])
  assert "compiled update in" in logs[0] and "from the cache)" in logs[1]
  # Programs loaded from the cache compute what the compiled ones did.
  assert warm["params_fingerprint"] == cold["params_fingerprint"]


class _Lines(logging.Handler):

  def __init__(self):
    super().__init__(logging.INFO)
    self.lines = []

  def emit(self, record):
    self.lines.append(record.getMessage())


def test_compiles_count_for_the_open_label_and_log_one_line():
  record, before = compilation.CompileRecord(), compilation.CompileRecord()
  before.close()  # (closed before the compile: it counts none)
  handler, logger = _Lines(), logging.getLogger("jaxrl")
  logger.addHandler(handler)
  level = logger.level
  logger.setLevel(logging.INFO)
  x = jnp.ones((3, 5))
  try:
    with record.labelled("probe"):  # one new program
      jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.25)(x).block_until_ready()
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
    record.close()
  probe = record.totals()["probe"]
  assert probe.programs == 1 and probe.seconds > 0
  assert [line for line in handler.lines if line.startswith("compiled probe in ")] == [
      f"compiled probe in {probe.seconds:.2f} s (1 program)"]
  summary = record.summary()
  assert summary["compile"]["probe"]["programs"] == 1 and summary["compile_s"] >= probe.seconds
  jax.jit(lambda x: jnp.cos(x) - 2.5)(x).block_until_ready()  # after `close`: not counted
  assert record.summary() == summary and before.summary()["compile_s"] == 0


def test_a_trace_inside_another_counts_once():
  # Older JAX times a jit traced inside another's trace as an event of its own, which ends
  # first; the enclosing event's seconds already include it.
  trace = "/jax/core/compile/jaxpr_trace_duration"
  backend = "/jax/core/compile/backend_compile_duration"
  record = compilation.CompileRecord()
  record.close()  # (the events below are the test's own, not JAX's)
  with record.labelled("nested"):
    record._on_duration(trace, 0.001)  # the inner trace
    record._on_duration(trace, 10.0)  # the outer one, which began 10 s ago
    time.sleep(0.01)
    record._on_duration(backend, 0.005)  # began after the outer trace ended
  nested = record.totals()["nested"]
  assert nested.seconds == pytest.approx(10.005) and nested.programs == 1


def test_cache_directory_settings(monkeypatch, tmp_path):
  monkeypatch.delenv("JAXRL_COMPILATION_CACHE", raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
  assert compilation.cache_dir() == str(tmp_path / "home" / ".cache" / "jaxrl" / "xla")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compilation.cache_dir() == str(tmp_path / "xdg" / "jaxrl" / "xla")
  monkeypatch.setenv("JAXRL_COMPILATION_CACHE", str(tmp_path / "env"))
  assert compilation.cache_dir() == str(tmp_path / "env")
  assert compilation.cache_dir("~/from_config") == str(tmp_path / "home" / "from_config")
  assert compilation.cache_dir("off") is None
  monkeypatch.setenv("JAXRL_COMPILATION_CACHE", "off")
  assert compilation.cache_dir() is None
  assert compilation.cache_dir(str(tmp_path / "cfg")) == str(tmp_path / "cfg")


def test_fake_cpu_devices_only_when_jax_runs_on_the_cpu(monkeypatch):
  """A GPU plugin means a GPU; libtpu (which the test extras install, to compile for TPU
  slices) means a TPU only where this host has TPU chips."""
  import sharding.host
  plugins_here = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                  "jax_rocm7_plugin", "libtpu")
  real_find_spec, installed, chips = importlib.util.find_spec, set(), []
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
      (object() if name in installed else None) if name in plugins_here
      else real_find_spec(name, *a)))
  monkeypatch.setattr(sharding.host, "tpu_chips_here", lambda: bool(chips))
  cases = [("cpu", set(), False, True), ("cuda", set(), False, False),
           ("cpu,tpu", set(), False, False), ("", set(), False, True),
           ("", {"jax_cuda12_plugin"}, False, False), ("", {"libtpu"}, True, False),
           ("", {"libtpu"}, False, True), ("cpu", {"jax_cuda12_plugin"}, False, True)]
  for platforms, plugins, tpu_chips, faked in cases:
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    installed.clear()
    installed.update(plugins)
    chips[:] = [True] * tpu_chips
    force_cpu_devices(4)
    faked_flag = " --xla_force_host_platform_device_count=4" if faked else ""
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x" + faked_flag, (platforms, plugins,
                                                                             tpu_chips)
  # Unset, with libtpu but no chip: JAX is told to stay on the CPU (no TPU runtime tried first).
  monkeypatch.delenv("JAX_PLATFORMS")
  installed.clear()
  installed.add("libtpu")
  chips.clear()
  force_cpu_devices(4)
  assert os.environ["JAX_PLATFORMS"] == "cpu"


def test_device_memory_fraction(monkeypatch):
  names = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
           "XLA_PYTHON_CLIENT_PREALLOCATE")
  for name in names:
    monkeypatch.delenv(name, raising=False)
  reserve_device_memory(0.9)
  assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
  assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
  reserve_device_memory(0.0)  # on demand, up to all of it (JAX would stop at 0.75)
  assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
  assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "1"
  for name in names:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")  # the user's, under the new name
  reserve_device_memory(0.9)
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ  # both at once fail JAX's start

  assert usable_memory_gb(PlacementConfig(device_memory_gb=80.0)) == pytest.approx(72.0)
  on_demand = PlacementConfig(device_memory_gb=80.0, device_memory_fraction=0.0)
  assert usable_memory_gb(on_demand) == 80.0
  with pytest.raises(ConfigError, match=r"config.placement.device_memory_fraction: expected in"):
    from_mapping(ExperimentConfig, {"placement": {"device_memory_fraction": 1.5}})
