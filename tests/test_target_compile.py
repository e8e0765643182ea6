"""`--dry_run --target`: TPU slices by name, and the RL step's programs compiled by the TPU
compiler (libtpu, from the test extras) on this CPU for a slice that is not here."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from train.cli import train
from train.cli.flags import load_config_file
from jaxrl.config import ConfigError
from jaxrl.config_files import resolve
from planner.targets import TargetError, parse_target

ROOT = __file__.rsplit("/tests/", 1)[0]


@pytest.mark.parametrize("name,generation,topology,chips", [
    ("v5p-64", "v5p", "2x4x4", 32), ("tpu:v5e-16", "v5e", "4x4", 16),
    ("v5litepod-4", "v5e", "2x2", 4), ("v6e:16x16", "v6e", "16x16", 256),
    ("v4-8", "v4", "2x2x1", 4), ("v5p:4x4x4", "v5p", "4x4x4", 64)])
def test_targets_by_accelerator_type_or_topology(name, generation, topology, chips):
  target = parse_target(name)
  assert (target.generation, target.topology, target.chips) == (generation, topology, chips)


@pytest.mark.parametrize("name,expected", [
    ("v9-8", "unknown TPU target 'v9-8'; known targets: v4-{8,16,"),
    ("v5p-12", "no v5p slice of 12; known targets"),
    ("v5e:2x2x2", "v5e slices have 2-D topologies")])
def test_unknown_targets_list_the_known_ones(name, expected):
  with pytest.raises(TargetError, match=expected.replace("{", r"\{").replace("(", r"\(")):
    parse_target(name)
  assert issubclass(TargetError, ConfigError)  # exit 2 through the CLI


def test_tiny_ppo_lora_config_compiles_for_a_v5e_slice(tmp_path):
  """configs/tiny.py as PPO with a critic, LoRA (merged into the sampler's copy), remat and
  micro-batches, colocated on a v5e-4: every program of its step, by the TPU compiler. (The
  plain tiny config's command runs in docs/models.md, through tests/test_docs.py.)"""
  from train.preflight.target_report import report
  raw = load_config_file("configs/tiny.py")
  raw.placement.update(strategy="colocate")
  raw.lora.update(rank=4, sampler="merged")
  raw.rl.advantage.update(name="gae")
  raw.rl.kl.update(mode="reward")
  raw.rl.batching.update(micro_batch_size=4)
  raw.model.layers.update(remat="dots")
  lines, fits = report(resolve(raw, hf=False), parse_target("v5e-4"), str(tmp_path / "t.json"))
  assert fits and lines[-1].startswith("verdict: fits:")
  summary = json.loads((tmp_path / "t.json").read_text())
  assert summary["fits"] and summary["hbm_bytes"] == 16e9  # a v5e chip
  counted = {p["name"]: p for p in summary["programs"] if p["jaxrl_flops"]}
  assert set(counted) == {"reference log-probs", "old log-probs", "actor update"}
  for p in counted.values():  # jaxrl's FLOPs of one call against the compiled program's,
    # whose loop over 4 pieces XLA's own count takes once; the update's backward skips the
    # first layer's input gradient (nothing below it trains): 7% of this 1-layer model
    assert p["flops"] == pytest.approx(p["jaxrl_flops"], rel=0.08 if "update" in p["name"] else
                                       0.01), p
    assert p["flops"] > 3 * p["xla_flops"], p
  _table_from(summary)
  assert lines[0].startswith("target: TPU v5e v5e-4 (topology 2x2: 4 chips")
  rows = {line.split("  ")[1].strip(): line for line in lines if line.startswith("  ")}
  for program in ("generate (prefill + decode loop)", "reference log-probs", "old log-probs",
                  "values", "experience", "actor update", "critic update",
                  "LoRA merge (weight push)"):
    cells = rows[program][36:].split()
    assert float(cells[0]) > 0 and float(cells[3]) > 0, rows[program]  # arguments, code
  update = rows["actor update"][36:].split()
  assert float(update[2]) > float(rows["reference log-probs"][36:].split()[2])  # temporaries
  for phase in ("generation", "scoring", "actor update", "critic update"):
    assert any(line.startswith(f"  {phase} (device ") for line in lines), phase


def _table_from(summary: dict) -> None:
  """benchmarks/target_table.py's row of a compiled run, and its compile seconds beside those of
  the same row compiled unrolled."""
  from benchmarks import target_table
  row = target_table.Row("tiny", "configs/tiny.py", "v5e-4")
  entry = {"summary": summary, "wall_seconds": 30.0, "machine": "Intel(R) Xeon(R) Processor, 2"}
  cells = [c.strip() for c in target_table.table_row(row, entry).strip("|").split("|")]
  assert cells[:3] == ["tiny", "v5e-4",
                       "colocate: trainer fsdp 4, sampler data 2 x tensor 2"], cells
  assert cells[3].endswith("(actor update) of 14.9: fits") and len(cells) == 11, cells
  slower = json.loads(json.dumps(entry))
  for p in slower["summary"]["programs"]:
    p["compile_seconds"] += 100
  target_table.ROWS["tiny"] = row
  try:
    lines = target_table.compile_rows({"tiny": entry, "tiny/unrolled": slower})
  finally:
    del target_table.ROWS["tiny"]
  cells = [c.strip() for c in lines[-1].strip("|").split("|")]
  update = next(p["compile_seconds"] for p in summary["programs"] if p["name"] == "actor update")
  assert cells[0] == "tiny (v5e-4)" and cells[4] == f"{update + 100:.0f} / {update:.0f}", cells
  assert cells[-1] == "Intel Xeon Processor; Intel Xeon Processor", cells


@pytest.mark.parametrize("settings, programs", [
    (dict(inflight_slots=8), ["slots: cast weights", "slots: start", "slots: refill (every slot)",
                              "slots: decode segment", "slots: finish"]),
    (dict(inflight_slots=8, partial_rollouts=True),
     ["stream: cast weights", "stream: start", "stream: admit (every slot)", "stream: harvest",
      "stream: decode segment", "stream: take a batch"]),
], ids=["inflight", "partial"])
def test_in_flight_programs_compile_for_a_slice(settings, programs):
  """In-flight batching and partial rollouts' stream: the programs of their host loops, each at
  its largest (every slot prefilled at once), compiled for a v5e-4; the slot state's layout
  comes from the program that makes it."""
  from train.preflight.target_compile import compile_program, rl_programs, topology_devices
  from jaxrl import platform
  from train.roles.cluster import RoleCluster
  raw = load_config_file("configs/tiny.py")
  raw.placement.update(train_devices=2)
  raw.rl.rollout.update(inflight_slots=settings["inflight_slots"])
  if settings.get("partial_rollouts"):
    raw.rl.schedule.update(mode="async", partial_rollouts=True)
  cfg = resolve(raw, hf=False)
  with platform.building_for("tpu"):
    cluster = RoleCluster(cfg, topology_devices(parse_target("v5e-4")), initialize=False)
    found = [p for p in rl_programs(cfg, cluster) if p.phase == "generation"]
    assert [p.name for p in found] == programs and [p.step for p in found] == list(range(
        len(programs)))
    for p in found:
      assert compile_program(p).bytes > 0, p.name


def test_a_topology_the_placement_cannot_use_names_the_field(capsys):
  """configs/tiny.py gives the trainer 4 devices: a 4-chip slice leaves the sampler none."""
  rc = train.main(["train", "--config=configs/tiny.py", "--dry_run", "--target=v5e-4"])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and len(err) == 1, err
  assert err[0].startswith("jaxrl: error: config.placement.train_devices: 4 does not split the "
                           "4 devices"), err
  assert err[0].endswith("expected 1 to 3; or --config.placement.strategy=colocate, every role "
                         "on all 4"), err


def test_an_unknown_target_is_one_line_exit_2(capsys):
  rc = train.main(["train", "--config=configs/tiny.py", "--dry_run", "--target=v7x-8"])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and len(err) == 1 and "known targets: v4-{8," in err[0], err


def test_a_program_the_compiler_refuses_is_named_in_one_line():
  """A real refusal of this libtpu: a collective over part of each of two hosts' chips."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from train.preflight.target_compile import Program, compile_program, topology_devices
  devices = topology_devices(parse_target("v5e-8"))  # 2 hosts of 4 chips
  mesh = Mesh(np.array([devices[i] for i in (0, 1, 4, 5)]).reshape(2, 2), ("data", "fsdp"))
  x = jax.ShapeDtypeStruct((64, 128), jnp.float32,
                           sharding=NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
  program = Program("mean over two half hosts", "scoring", mesh,
                    lambda: jax.jit(lambda a: a.mean()).lower(x))
  with pytest.raises(ConfigError, match=r"^--target: the compiler refused mean over two half "
                                        r"hosts: INTERNAL: RET_CHECK failure") as e:
    compile_program(program)
  assert "\n" not in str(e.value)


def test_tpu_programs_attend_with_the_splash_kernel():
  """Built for a TPU, the scoring pass and the update call the Mosaic splash kernel, whose
  attention FLOPs (which XLA's count leaves out) the report adds: the update's thrice a scoring
  pass's (four times under remat=full); the decode loop (attention over its cache) does not."""
  from train.preflight.target_compile import rl_programs, topology_devices
  from jaxrl import platform
  from train.roles.cluster import RoleCluster
  raw = load_config_file("configs/tiny.py")
  raw.placement.update(train_devices=2)
  cfg = resolve(raw, hf=False)
  with platform.building_for("tpu"):
    cluster = RoleCluster(cfg, topology_devices(parse_target("v5e-4")), initialize=False)
    programs = {p.name: p for p in rl_programs(cfg, cluster)}
    assert "tpu_custom_call" in programs["reference log-probs"].lower().as_text()
    assert "tpu_custom_call" not in programs["generate (prefill + decode loop)"].lower().as_text()
  scoring = programs["reference log-probs"].kernel_flops
  passes = 4 if cfg.model.layers.remat == "full" else 3
  assert scoring > 0 and programs["actor update"].kernel_flops == pytest.approx(passes * scoring)
  assert programs["generate (prefill + decode loop)"].kernel_flops == 0


def test_a_shared_prefix_attends_with_the_splash_kernel_over_its_cache():
  """With `share_prefix` on, a TPU's scoring pass calls the kernel for the prompt's pass and
  again for its rows' completions over the cache (twice the unshared pass's calls), and the
  report adds the shared route's attention FLOPs, fewer than the unshared pass's."""
  from train.preflight.target_compile import rl_programs, topology_devices
  from jaxrl import platform
  from train.roles.cluster import RoleCluster
  found = {}
  for share in ("off", "on"):
    raw = load_config_file("configs/tiny.py")
    raw.placement.update(train_devices=2)
    raw.rl.batching.update(share_prefix=share, num_minibatches=1)  # (a prompt's 2 rows a piece)
    cfg = resolve(raw, hf=False)
    with platform.building_for("tpu"):
      cluster = RoleCluster(cfg, topology_devices(parse_target("v5e-4")), initialize=False)
      program = {p.name: p for p in rl_programs(cfg, cluster)}["reference log-probs"]
      found[share] = (program.lower().as_text().count("tpu_custom_call"), program.kernel_flops,
                      cfg.rl.share_group)
  assert found["on"][2] > 1 and found["off"][0] > 0
  assert found["on"][0] == 2 * found["off"][0]
  assert 0 < found["on"][1] < found["off"][1]


def _children(pid: int) -> list[int]:
  out = []
  for entry in os.listdir("/proc"):
    try:
      with open(f"/proc/{entry}/stat") as f:
        if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
          out.append(int(entry))
    except OSError:
      continue
  return out


def test_a_compiler_that_dies_is_named_in_one_line():
  """libtpu ends its process on a failed internal check (an abort: seen for Qwen2.5-7B on a
  v5p-16), so the target compile runs in a child; the child killed by SIGABRT while it compiles
  the update gives one line naming the program, and exit 2."""
  proc = subprocess.Popen(
      [sys.executable, "-m", "train.cli.train", "--config=configs/tiny.py", "--dry_run",
       "--target=v5e-4", "--config.placement.train_devices=2"],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  lines = []
  for line in proc.stderr:
    lines.append(line)
    if line.startswith("jaxrl: dry run: compiling old log-probs"):
      (child,) = _children(proc.pid)
      os.kill(child, signal.SIGABRT)
  proc.wait(timeout=120)
  assert proc.returncode == 2
  assert all(line.startswith("jaxrl:") for line in lines)  # libtpu's own lines go to the log
  assert lines[-1].startswith("jaxrl: error: --target: the TPU compiler's process died "
                              "(SIGABRT) compiling old log-probs (a compiler failure")


def test_a_sliding_window_compiles_into_the_splash_kernel():
  """Gemma 3's local layers built for a TPU: the scoring pass's splash kernel with its local
  mask (keys fewer than 4 positions back) compiles for a v5e-4, and the attention counted for
  the kernel is the window's, less than causal attention's."""
  from train.preflight.target_compile import compile_program, rl_programs, topology_devices
  from jaxrl import platform
  from train.roles.cluster import RoleCluster
  kernel = {}
  for window in (0, 4):
    raw = load_config_file("configs/tiny.py")
    raw.placement.update(train_devices=2)
    raw.model.update(family="gemma3", n_layers=2)
    raw.model.attention.update(sliding_window=window, global_every=0)
    cfg = resolve(raw, hf=False)
    with platform.building_for("tpu"):
      cluster = RoleCluster(cfg, topology_devices(parse_target("v5e-4")), initialize=False)
      program = {p.name: p for p in rl_programs(cfg, cluster)}["reference log-probs"]
      kernel[window] = program.kernel_flops
      if window:
        assert "tpu_custom_call" in program.lower().as_text()
        assert compile_program(program).memory.temp_size_in_bytes > 0
  assert 0 < kernel[4] < kernel[0] / 2


def test_the_compile_guard_names_what_its_child_raised():
  """A Python exception in the compiling child (not a config error it reports itself) is named
  from its traceback's last line; a verdict line marks a normal exit 1 (does not fit)."""
  import io

  from train.preflight.compile_guard import _forward
  state = {"program": None, "failed": None, "reported": False, "raised": None}
  child = ("jaxrl: dry run: compiling old log-probs\nTraceback (most recent call last):\n"
           '  File "train/loop/scoring.py", line 69, in __init__\n'
           "AttributeError: 'NoneType' object has no attribute 'tok'\n")
  _forward(io.StringIO(child), io.StringIO(), io.StringIO(), state)
  assert state["program"] == "old log-probs" and not state["reported"]
  assert state["raised"] == "AttributeError: 'NoneType' object has no attribute 'tok'"
  _forward(io.StringIO("jaxrl: dry run: verdict: DOES NOT FIT\n"), io.StringIO(), io.StringIO(),
           state)
  assert state["reported"]


def test_a_target_scope_holds_on_every_thread_and_gives_the_platform_back():
  """jaxrl/platform.py: inside `building_for` programs traced on any thread (an executor's)
  are built for the target; a nested scope sets its own; each restores what it found, after
  an error too."""
  import threading
  import jax
  from jaxrl import platform
  real, seen = jax.default_backend(), []
  assert platform.backend() == real
  with platform.building_for("tpu"):
    reader = threading.Thread(target=lambda: seen.append(platform.backend()))
    reader.start()
    reader.join()
    with platform.building_for("gpu"):
      assert platform.backend() == "gpu"
    assert platform.backend() == "tpu"
  assert seen == ["tpu"] and platform.backend() == real
  with pytest.raises(ZeroDivisionError), platform.building_for("tpu"):
    1 / 0
  assert platform.backend() == real


def test_target_scopes_on_two_threads_take_turns():
  """A scope opened on another thread waits for the one in progress to end: neither builds
  for the other's target, and the platform before both comes back."""
  import threading
  import time
  import jax
  from jaxrl import platform
  inside, release, seen = threading.Event(), threading.Event(), []

  def first():
    with platform.building_for("tpu"):
      inside.set()
      release.wait(10)
      seen.append(("first", platform.backend()))

  def second():
    inside.wait(10)
    with platform.building_for("gpu"):
      seen.append(("second", platform.backend()))

  threads = [threading.Thread(target=first), threading.Thread(target=second)]
  for t in threads:
    t.start()
  inside.wait(10)
  time.sleep(0.2)  # the second scope is waiting
  assert seen == []
  release.set()
  for t in threads:
    t.join(10)
  assert seen == [("first", "tpu"), ("second", "gpu")]
  assert platform.backend() == jax.default_backend()
