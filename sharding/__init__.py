"""Devices: the rules tables of the layouts and the one way to jit under them (rules.py), meshes
and parameter shardings from the models' logical axes (mesh.py), placement presets of the roles
on device slices (placement.py), moves of weights and batches between meshes and to and from
the host (reshard.py: `reshard`, `move`, `to_host`, `to_device`), multi-host start-up and the
job's sequences (distributed.py), crossings between processes (crossing.py) and what must be set before JAX starts (host.py: CPU devices, host memory).

Imports only `jaxrl` (docs/architecture.md; held by tests/test_layers.py); the models reach a
mesh only through the logical names of jaxrl/partitioning.py.
"""
