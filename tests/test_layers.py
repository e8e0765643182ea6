"""The packages are layers (docs/architecture.md): each imports only the ones below it.

Walks every import statement (module level or inside a function) of every file in the project's
packages, so a new back edge fails here rather than in a reader's head."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# package -> the project packages it may import (besides itself)
MAY_IMPORT = {
    "jaxrl": set(),
    "sharding": {"jaxrl"},
    "sampler": {"jaxrl", "sharding"},
    "planner": {"jaxrl", "sharding"},
    "train": {"jaxrl", "sharding", "sampler", "planner"},
    "cli": {"jaxrl", "sharding", "sampler", "planner", "train"},
    "configs": {"jaxrl", "cli"},
    "benchmarks": {"jaxrl", "sharding", "sampler", "planner", "train", "cli", "configs"},
}


def imported_packages(path: pathlib.Path) -> set[tuple[str, int]]:
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update((a.name.split(".")[0], node.lineno) for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      found.add((node.module.split(".")[0], node.lineno))
  return {(name, line) for name, line in found if name in MAY_IMPORT}


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_package_imports_only_lower_layers(package):
  files = sorted((ROOT / package).rglob("*.py"))
  assert files, f"no files under {package}/"
  bad = [f"{p.relative_to(ROOT)}:{line} imports {name}"
         for p in files for name, line in sorted(imported_packages(p))
         if name != package and name not in MAY_IMPORT[package]]
  assert not bad, "\n".join(bad)


def test_every_package_is_layered():
  """A new top-level package gets a row in MAY_IMPORT (and in docs/architecture.md)."""
  packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
  assert packages - {"tests"} == set(MAY_IMPORT)
