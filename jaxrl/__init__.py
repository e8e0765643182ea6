"""jaxrl: reinforcement learning for language models on JAX device meshes."""
__version__ = "0.1.0"
