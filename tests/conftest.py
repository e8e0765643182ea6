"""Tests run on a fake 8-device CPU mesh; XLA_FLAGS must be set before JAX starts its backend."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "").replace(
    "--xla_force_host_platform_device_count=8", "") + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent compilation cache (train/compilation.py) for the tests or the runs they start:
# nothing written to the user's cache, and every test compiles as it always has. The test of
# the cache (tests/test_startup.py) gives its runs a directory of their own.
os.environ["JAXRL_COMPILATION_CACHE"] = "off"

import jax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl.models.llama import LanguageModel, ModelConfig  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

TINY = ModelConfig(vocab_size=264, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   d_ff=64)


@pytest.fixture
def tiny_cfg() -> ModelConfig:
  return TINY


@pytest.fixture
def tiny_model() -> LanguageModel:
  return LanguageModel(TINY, rngs=nnx.Rngs(0))
