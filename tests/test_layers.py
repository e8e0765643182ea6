"""The packages are layers (docs/architecture.md): each imports only the ones below it, and so do
the rooms of train/ among themselves.

Walks every import statement (module level, inside a function, or for type checking) of every
file in the project's packages, so a new back edge fails here rather than in a reader's head.
configs/ is a folder of experiment files found by path, not a package (nothing installs a
top-level `configs` or `cli`: the command line is a room of train/)."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BELOW_TRAIN = {"isolation", "jaxrl", "sharding", "sampler", "planner"}
# package -> the project packages it may import (besides itself), bottom up
MAY_IMPORT = {
    "isolation": set(),  # processes the run can kill, limits for their trees: the OS alone
    "jaxrl": {"isolation"},  # the RL core: models, algorithms, data, rewards, environments
    "sharding": {"jaxrl"},
    "sampler": {"jaxrl", "sharding"},
    "planner": {"jaxrl", "sharding"},
    "train": BELOW_TRAIN,
    "configs": {"jaxrl"},
    "benchmarks": BELOW_TRAIN | {"train", "configs"},
}


def files_of(package: str) -> list[pathlib.Path]:
  return sorted((ROOT / package).rglob("*.py"))


# train/'s sub-packages, bottom up -> the sub-packages each may import (besides itself)
TRAIN_MAY_IMPORT = {
    "io": set(),  # run I/O: checkpoints, run dir, metrics, tracking, timeline, compile stats
    "updates": set(),  # the pure update steps
    "roles": {"io", "updates"},  # models on their meshes, their weights, learners, offload
    "rollout": {"io", "updates", "roles"},  # generation, multi-turn, the async worker and its schedule
    "task": {"io", "roles", "rollout"},  # the run's data, reward and held-out evaluation
    "loop": {"io", "updates", "roles", "rollout", "task"},  # the RL loop and its executors
    "stages": {"io", "updates", "roles", "rollout", "task", "loop"},
    "run": {"io", "updates", "roles", "rollout", "task", "loop", "stages"},  # Experiment
    # a run checked and planned before it launches: dry runs, target compiles, calibration
    "preflight": {"io", "updates", "roles", "rollout", "task", "loop", "stages", "run"},
    "cli": {"io", "updates", "roles", "rollout", "task", "loop", "stages", "run", "preflight"},
}


def imported_modules(path: pathlib.Path) -> set[tuple[str, int]]:
  """(dotted module, line) of every import statement in `path`."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update((a.name, node.lineno) for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      found.add((node.module, node.lineno))
      if node.module == "train":  # `from train import loop` imports the room train.loop
        found.update((f"train.{a.name}", node.lineno) for a in node.names)
  return found


def imported_packages(path: pathlib.Path) -> set[tuple[str, int]]:
  return {(name.split(".")[0], line) for name, line in imported_modules(path)
          if name.split(".")[0] in MAY_IMPORT}


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_package_imports_only_lower_layers(package):
  files = files_of(package)
  assert files, f"no files under {package}/"
  bad = [f"{p.relative_to(ROOT)}:{line} imports {name}"
         for p in files for name, line in sorted(imported_packages(p))
         if name != package and name not in MAY_IMPORT[package]]
  assert not bad, "\n".join(bad)


def test_every_package_is_layered():
  """A new top-level package (or folder of Python files) gets a row in MAY_IMPORT (and in
  docs/architecture.md)."""
  folders = {p.parent.name for p in ROOT.glob("*/*.py")}
  assert folders - {"tests"} == set(MAY_IMPORT)


def test_configs_are_files_not_a_package():
  """Nothing installs a top-level `cli` or `configs` (a user's own would collide): configs/ is
  found by path, the command line is train/cli."""
  assert not (ROOT / "configs" / "__init__.py").exists() and not (ROOT / "cli").exists()
  text = (ROOT / "pyproject.toml").read_text()
  assert '"cli*"' not in text and '"configs*"' not in text


@pytest.mark.parametrize("sub", sorted(TRAIN_MAY_IMPORT))
def test_train_subpackages_import_only_lower_ones(sub):
  files = sorted((ROOT / "train" / sub).rglob("*.py"))
  assert files, f"no files under train/{sub}/"
  bad = [f"{p.relative_to(ROOT)}:{line} imports {name}"
         for p in files for name, line in sorted(imported_modules(p))
         if name.startswith("train.") and name.split(".")[1] != sub
         and name.split(".")[1] not in TRAIN_MAY_IMPORT[sub]]
  assert not bad, "\n".join(bad)


def test_train_is_only_subpackages():
  """A new room of train/ gets a row in TRAIN_MAY_IMPORT; no module sits loose in train/."""
  train = ROOT / "train"
  assert {p.parent.name for p in train.glob("*/__init__.py")} == set(TRAIN_MAY_IMPORT)
  assert [p.name for p in train.glob("*.py")] == ["__init__.py"]


def test_files_and_functions_stay_small():
  """No module over 400 lines and no function over 60 in the project's packages (benchmarks and
  configs included): a reader holds a room or a step in their head."""
  big = []
  for package in MAY_IMPORT:
    for path in files_of(package):
      source = path.read_text()
      if source.count("\n") > 400:
        big.append(f"{path.relative_to(ROOT)}: {source.count(chr(10))} lines")
      for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
          length = node.end_lineno - node.lineno + 1
          if length > 60:
            big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
  assert not big, "\n".join(big)


def _module(path: pathlib.Path) -> str:
  return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
  """The project modules `path` imports, at run time or for type checking alike (an import
  under `if TYPE_CHECKING:` is an arrow a reader follows too)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      found.add(node.module)
      found.update(f"{node.module}.{a.name}" for a in node.names)
  return found & modules


def test_no_import_cycles():
  """No module imports itself back through others, for type checking either (a cycle is a layer
  in disguise: the planner's cost model and memory model once imported each other; the sampler
  and its stream and requests did, under TYPE_CHECKING, before they took a `DecodeSpec`)."""
  paths = {_module(p): p for package in MAY_IMPORT for p in files_of(package)}
  graph = {m: _imports(p, set(paths)) - {m} for m, p in paths.items()}
  state: dict[str, int] = {}  # 1: on the current path, 2: done

  def cycle_from(m: str, path: list[str]) -> list[str] | None:
    state[m] = 1
    for n in sorted(graph[m]):
      if state.get(n) == 1:
        return path[path.index(n):] + [n] if n in path else [m, n]
      if n not in state and (found := cycle_from(n, path + [n])):
        return found
    state[m] = 2
    return None

  for m in sorted(graph):
    if m not in state and (found := cycle_from(m, [m])):
      pytest.fail("import cycle: " + " -> ".join(found))
