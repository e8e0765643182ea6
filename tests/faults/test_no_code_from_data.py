"""No code from data: checkpoints (orbax: tensorstore arrays and JSON), model files
(safetensors, JSON) and datasets (JSON, parquet) are read without pickle or eval; the Python a
run executes is its config file and the user modules a config names (a reward function, an
environment); chat templates run in jinja2's sandbox (jaxrl/data/chat.py). (User reward
functions' worker processes get plain data from the run's own process, through
multiprocessing's pipes: isolation/workers.py, isolation/hosts.py; never from a file. The
Python tool runs the model's programs, in a sandbox: isolation/sandbox.py.) A pickled PyTorch
checkpoint in a model directory is never opened: tests/faults/test_bad_models.py."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("isolation", "jaxrl", "sharding", "sampler", "planner", "train", "configs")
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle", "joblib"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
ALLOWED = {("jaxrl/config_files.py", "exec_module"),  # a config file
           ("isolation/workers.py", "import_module"),  # the module a config names
           # a model's program, in the code tool's sandbox (its modules imported there first)
           ("isolation/sandbox.py", "exec()"), ("isolation/sandbox.py", "compile()"),
           ("isolation/sandbox.py", "import_module")}


def _problems(rel: str, tree: ast.AST) -> list[tuple[str, str]]:
  out = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
      out += [(rel, f"import {n}") for n in names if n.split(".")[0] in FORBIDDEN_MODULES]
    if isinstance(node, ast.Call):
      f = node.func
      called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
      forbidden = isinstance(f, ast.Name) and called in FORBIDDEN_CALLS  # not re.compile
      if forbidden and (rel, f"{called}()") not in ALLOWED:
        out.append((rel, f"{called}()"))
      if called in ("exec_module", "import_module") and (rel, called) not in ALLOWED:
        out.append((rel, f"{called}()"))
      if any(k.arg == "allow_pickle" for k in node.keywords):
        out.append((rel, f"{called}(allow_pickle=...)"))
  return out


def test_no_library_file_unpickles_or_evaluates():
  found = []
  for package in PACKAGES:
    for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
      for name in sorted(f for f in files if f.endswith(".py")):
        path = os.path.join(dirpath, name)
        with open(path, encoding="utf-8") as f:
          found += _problems(os.path.relpath(path, ROOT), ast.parse(f.read()))
  assert found == []


def test_the_scan_finds_what_it_forbids():
  code = ("import pickle\nfrom marshal import loads\neval('1')\nre.compile('x')\n"
          "np.load('x', allow_pickle=True)\n")
  assert [p for _, p in _problems("x.py", ast.parse(code))] == [
      "import pickle", "import marshal", "eval()", "load(allow_pickle=...)"]
