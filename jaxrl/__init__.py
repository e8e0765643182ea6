"""jaxrl: reinforcement learning for language models on JAX device meshes.

This package is the RL core, pure and mesh-agnostic: models (models/), the RL math (algos/),
data (data/), rewards (rewards/), environments (envs/), the config schema and its files
(config.py, config_rl.py, config_files.py), how a registry's entries are called (registry.py),
logical sharding names (partitioning.py) and the platform programs are built for (platform.py).
It imports only isolation/ of the project (docs/architecture.md, tests/test_layers.py)."""
__version__ = "0.1.0"
