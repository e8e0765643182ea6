"""The registries are the one place their names mean something: no code outside a registry's
module compares a setting with one of its names (it asks the entry instead: `trains_critic`,
`kl_in_reward`, `one_batch_per_step`, ...), each entry reads its hyperparameters from its config
section under the names it declares, and each policy loss reports its own clip fraction."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algos import advantages, correction, losses
from jaxrl.config_rl import AdvantageConfig, LossConfig
from jaxrl.data import tasks
from jaxrl.envs import ENVIRONMENTS
from jaxrl.models import families
from jaxrl.rewards import verifier
from jaxrl import schedules

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jaxrl", "sharding", "sampler", "planner", "train", "cli", "benchmarks", "configs")
# registry -> (its module, the words naming the setting it is chosen by)
REGISTRIES = {
    "POLICY_LOSSES": (losses.POLICY_LOSSES, "jaxrl/algos/losses.py", ("loss",)),
    "AGGREGATIONS": (losses.AGGREGATIONS, "jaxrl/algos/losses.py", ("aggregation",)),
    "KL_ESTIMATORS": (losses.KL_ESTIMATORS, "jaxrl/algos/losses.py", ("estimator", "kl")),
    "ADVANTAGES": (advantages.ADVANTAGES, "jaxrl/algos/advantages.py", ("advantage",)),
    "ROLLOUT_MASKS": (correction.ROLLOUT_MASKS, "jaxrl/algos/correction.py", ("mask",)),
    "SCHEDULES": (schedules.SCHEDULES, "jaxrl/schedules.py", ("schedule",)),
    "ENVIRONMENTS": (ENVIRONMENTS, "jaxrl/envs/__init__.py", ("environment", "env")),
    "VERIFIERS": (verifier.VERIFIERS, "jaxrl/rewards/verifier.py", ("verifier",)),
    "FAMILIES": (families.FAMILIES, "jaxrl/models/families.py", ("family",)),
    "TASKS": (tasks.TASKS, "jaxrl/data/tasks.py", ("task",)),
}


def _strings(node) -> list[str]:
  """The string constants `node` is, or holds (a tuple, list or set of them)."""
  if isinstance(node, ast.Constant) and isinstance(node.value, str):
    return [node.value]
  if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
    return [s for e in node.elts for s in _strings(e)]
  return []


def name_comparisons(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
  """`path:line registry 'name' compared with <setting>` for each ==, !=, in, not in of a
  setting (an expression naming the registry's setting) with one of a registry's names."""
  found, rel = [], str(path.relative_to(root))
  for node in ast.walk(ast.parse(path.read_text(), rel)):
    if not isinstance(node, ast.Compare) or not all(
        isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
      continue
    sides = [node.left, *node.comparators]
    for registry, (entries, module, words) in REGISTRIES.items():
      if rel == module:
        continue
      for i, side in enumerate(sides):
        others = [ast.unparse(s).lower() for j, s in enumerate(sides) if j != i]
        names = [s for s in _strings(side) if s in entries]
        if names and any(w in o.replace(".", "_").split("_") for o in others for w in words):
          found.append(f"{rel}:{node.lineno} {registry} {names[0]!r} compared with {others[0]}")
  return found


def test_no_registry_name_is_compared_outside_its_registry():
  found = [hit for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
           for hit in name_comparisons(path)]
  assert not found, "\n".join(found)


def test_the_check_finds_a_comparison(tmp_path):
  """(The check above can fail: the comparisons this issue removed are found.)"""
  src = tmp_path / "cli" / "x.py"
  src.parent.mkdir()
  src.write_text('if cfg.rl.advantage.name == "gae":\n  pass\n'
                 'fixed = cfg.rl.schedule.name in ("fixed",)\nok = args.lengths == "fixed"\n')
  found = name_comparisons(src, tmp_path)
  assert [f.split(" ")[1] for f in found] == ["ADVANTAGES", "SCHEDULES"]


def _keyword_only(fn) -> dict[str, bool]:
  """fn's keyword-only parameters -> whether each is required."""
  return {p.name: p.default is p.empty for p in inspect.signature(fn).parameters.values()
          if p.kind is p.KEYWORD_ONLY}


@pytest.mark.parametrize("registry,section,inputs,own", [
    (losses.POLICY_LOSSES, LossConfig, {"old_BN", "mu_BN", "mask_BN"},
     {"name", "aggregation", "entropy_coef"}),  # (read by the update itself)
    (advantages.ADVANTAGES, AdvantageConfig, {"group_size", "kl_BN", "kl_coef", "values_BN"},
     {"name", "whiten"}),
])
def test_entries_read_their_hyperparameters_from_their_section(registry, section, inputs, own):
  """Every parameter an entry requires is an input the caller has or a field of its section,
  by the same name, and every other field of the section is some entry's."""
  fields = {f.name for f in dataclasses.fields(section)}
  declared = set()
  for name, entry in registry.items():
    params = _keyword_only(entry.fn)
    missing = {p for p, required in params.items() if required} - inputs - fields
    assert not missing, f"{name} requires {missing}: neither an input nor a field"
    declared |= set(params) & fields
  assert declared == fields - own


RATIO = np.log([[1.0, 1.1, 1.5, 0.5]])  # log pi - log pi_old per token
MU_RATIO = np.log([[1.0, 3.0, 5.0, 0.5]])  # log pi - log mu


@pytest.mark.parametrize("name,want", [
    ("ppo_clip", [0, 0, 1, 1]),  # outside [0.8, 1.2]
    ("decoupled_ppo", [0, 0, 1, 1]),
    ("cispo", [0, 0, 1, 1]),  # its importance weight clipped (the gradient kept)
    ("gspo", [0, 0, 0, 0]),  # one ratio per sequence, e^mean(log r) = 0.95: inside the band
    ("aipo", [0, 0, 1, 0]),  # pi / mu above rho = 4, whatever the PPO band
])
def test_each_loss_reports_its_own_clip_fraction(name, want):
  logp = jnp.zeros((1, 4))
  available = {"old_BN": logp - RATIO, "mu_BN": logp - MU_RATIO, "mask_BN": jnp.ones((1, 4)),
               "eps_low": 0.2, "eps_high": 0.2, "rho": 4.0}
  _, metrics = losses.POLICY_LOSSES[name](logp, jnp.ones((1, 4)), available)
  np.testing.assert_array_equal(np.broadcast_to(metrics["clip_frac"], (1, 4))[0], want)
