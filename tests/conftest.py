"""Tests run on a fake 8-device CPU mesh; XLA_FLAGS must be set before JAX starts its backend.

`JAXRL_TEST_DEVICE=1 pytest -m accelerator` runs the numerics tests that can use the machine's
real devices (model parity with transformers, log-probs, the sampler) on them instead, their
meshes sized from the devices present (`hf_models.sized_mesh`); without it they run here with the rest."""
import atexit
import os
import shutil
import tempfile

ON_DEVICE = os.environ.get("JAXRL_TEST_DEVICE") == "1"
# The tests' programs are small and mostly compiled once: XLA:CPU's LLVM back end at its lowest
# optimisation level compiles them in about 0.6x the time (a tiny run: 28 s against 44 s), and
# what it computes is still IEEE arithmetic (rounded differently: the tests compare programs
# under the same flags, or within tolerances).
FAST_COMPILE = "--xla_backend_optimization_level=0"
if not ON_DEVICE:
  flags = os.environ.get("XLA_FLAGS", "")
  for flag in ("--xla_force_host_platform_device_count=8", FAST_COMPILE):
    flags = flags.replace(flag, "") + " " + flag
  os.environ["XLA_FLAGS"] = flags
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session, in a fresh temporary directory (never the
# user's), made by the first process (pytest-xdist's controller) and shared by its workers:
# tests that build the same programs (the tiny runs, in these processes and in the CLI runs they
# start) load them instead of compiling them again. JAX reads this variable itself, so every jit
# uses it; the test of the cache (tests/test_startup.py) gives its runs a directory of their own.
_CACHE = os.environ.get("JAXRL_TESTS_XLA_CACHE", "")
if not os.path.isdir(_CACHE):
  _CACHE = os.environ["JAXRL_TESTS_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxrl-tests-xla-")
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ.pop("JAXRL_COMPILATION_CACHE", None)

import jax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl.models.transformer import LanguageModel
from jaxrl.models.config import ModelConfig  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


TINY = ModelConfig(vocab_size=264, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   d_ff=64)


@pytest.fixture
def optimised_xla(monkeypatch):
  """For a test whose processes (CLI runs, a notebook's kernel) train for hundreds of steps:
  they start with XLA's default optimisation level, where run time, not compile time, counts."""
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "").replace(FAST_COMPILE, ""))


@pytest.fixture
def tiny_cfg() -> ModelConfig:
  return TINY


@pytest.fixture
def tiny_model() -> LanguageModel:
  return LanguageModel(TINY, rngs=nnx.Rngs(0))
