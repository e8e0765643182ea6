"""Tests' shorthand for a randomly initialised model born sharded on a mesh (train/roles/role.py)."""
from train.roles.role import ModelRole


def init_sharded(make_model, rules, mesh):
  """(graphdef, parameters, parameter shardings) of `make_model()` initialised on `mesh`."""
  role = ModelRole("model", make_model, mesh, rules).initialize()
  return role.graphdef, role.params, role.shardings
