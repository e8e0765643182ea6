"""The planner: cost-model pieces against hand-computed cases, the search's limits, calibration."""
import dataclasses
import json
import os

import pytest

from train.cli.plan import main as plan_main
from jaxrl.config_files import shipped
from jaxrl.config import ExperimentConfig
from jaxrl.models.config import ModelConfig
from planner import calibrate as cal
from planner.cost import (Mesh, Plan, Workload, apart, decode_steps, forward_s, generate_s,
                          push_s, step_time, update_s)
from planner.devices import CPU_EFFICIENCY, DEVICES, DeviceSpec, Efficiency
from planner.memory import HEADROOM, kv_row_bytes, kv_rows, memory, total_bytes
from planner.plan import choose
from planner.search import problem, search
from sharding.placement import host_major_devices, make_placement

tiny = shipped("tiny")

MODEL = ModelConfig(vocab_size=256, d_model=64, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=64,
                    d_ff=128)
# A device that is pure arithmetic: 1 GFLOP/s, 1 GB/s memory and links, no fixed costs.
UNIT = DeviceSpec("unit", 1e9, 1e9, 1e9, 1e9, 1e9, 8)
IDEAL = Efficiency(train_mfu=1, forward_mfu=1, prefill_mfu=1, decode_mfu=1, decode_hbm=1, link=1,
                   call_overhead_s=0, layer_overhead_s=0, decode_step_overhead_s=0,
                   step_overhead_s=0, matmul_half_dim=0, matmul_half_rows=0,
                   collective_latency_s=0)


def _workload(**kw) -> Workload:
  return Workload(**{**dict(model=MODEL, prompts=1, group_size=2, prompt_len=2, new_tokens=2),
                     **kw})


def test_forward_and_update_are_flops_over_the_peak():
  # Projections and MLP: 64*64*4 + 3*64*128 = 40,960 parameters; 2 rows x 4 tokens.
  # 2 * 40960 * 8 = 655,360; attention 4 * 64 * 8 tokens * 2.5 keys = 5,120; head at 2 scored
  # positions of 2 rows: 2 * 64 * 256 * 4 = 131,072. Total 791,552 FLOPs.
  w = _workload()
  assert forward_s(w, UNIT, IDEAL, Mesh()) == pytest.approx(791_552e-9)
  # The update: 3x the forward, plus the optimizer's 2 x 16 bytes per parameter (57,344 with
  # the tied 256 x 64 embedding) through memory.
  assert update_s(w, UNIT, IDEAL, Mesh()) == pytest.approx(3 * 791_552e-9 + 32 * 57_344e-9)
  # Four devices (not a shared pool) divide the compute.
  assert forward_s(w, UNIT, IDEAL, Mesh(data=4)) == pytest.approx(791_552e-9 / 4)


def test_fsdp_gathers_and_tensor_all_reduces():
  w = _workload()
  # fsdp 8: one all-gather of 7/8 of the float32 weights (57,344 x 4 x 7/8 = 200,704 bytes)
  # overlapped with an 8-device compute of 791,552 / 8 FLOPs: the gather is the longer.
  assert forward_s(w, UNIT, IDEAL, Mesh(fsdp=8)) == pytest.approx(200_704e-9)
  # tensor 2: + 2 all-reduces per layer of [8 tokens, 64] float32, ring: 2 * 1/2 * 2048 bytes.
  assert forward_s(w, UNIT, IDEAL, Mesh(tensor=2)) == pytest.approx(791_552e-9 / 2 + 2 * 2048e-9)


def test_decode_is_bound_by_reading_the_weights():
  big = dataclasses.replace(DEVICES["h100"], matmul_flops=1e18)
  w = _workload(model=dataclasses.replace(MODEL, d_model=4096, d_ff=16384, n_heads=32,
                                          n_kv_heads=8, head_dim=128, n_layers=4))
  eff = dataclasses.replace(IDEAL, decode_hbm=0.5)
  weights = w.params * 4  # float32 model
  decode = generate_s(w, big, eff, Mesh()) - generate_s(dataclasses.replace(w, new_tokens=0),
                                                        big, eff, Mesh())
  assert decode == pytest.approx(2 * weights / (0.5 * big.hbm_bytes_per_s), rel=0.01)


def test_decode_runs_in_waves_or_slots_as_the_kv_cache_allows():
  w = _workload(prompts=4, group_size=4, new_tokens=10)  # 16 rows
  assert decode_steps(w, rows=16, concurrent=16) == 10
  assert decode_steps(w, rows=16, concurrent=5) == 40  # four static waves, each to the budget
  uneven = dataclasses.replace(w, mean_new_tokens=2.5, inflight=True)
  assert decode_steps(uneven, rows=16, concurrent=4) == 10  # the longest row bounds it
  assert decode_steps(uneven, rows=64, concurrent=4) == 40  # 64 x 2.5 row-steps in 4 slots
  # Bound by HBM (compute is free here), each wave re-reads the weights every step: 10 steps of
  # the 229,376 weight bytes and 16 rows x (2 prompt + 10 / 2) x 512 KV bytes, or 40 of 4 rows.
  memory_bound = dataclasses.replace(UNIT, matmul_flops=1e30)
  assert generate_s(w, memory_bound, IDEAL, Mesh(), kv_rows=16) == pytest.approx(
      10 * (229_376 + 16 * 7 * 512) / 1e9)
  assert generate_s(w, memory_bound, IDEAL, Mesh(), kv_rows=4) == pytest.approx(
      40 * (229_376 + 4 * 7 * 512) / 1e9)


def test_the_kv_cache_gets_what_the_rest_leaves():
  w = _workload(prompts=4, group_size=4)  # 16 rows, 4 slots each: 2048 bytes a row
  row = kv_row_bytes(w, Mesh())
  assert row == 4 * 512
  weights = w.params * 4
  separate = Plan("separate", Mesh(fsdp=4), Mesh(), Mesh(fsdp=4))
  room = (weights + 5.5 * row) / HEADROOM  # the weights and five and a half rows
  assert kv_rows(w, separate, room) == pytest.approx(5.5)
  assert kv_rows(w, separate, 1e12) == 16  # never more than the replica's rows
  # Colocated, the trainer's resident state (12 bytes per parameter, + 4 for the reference,
  # sharded over fsdp 4) comes first.
  colocate = Plan("colocate", Mesh(fsdp=4), Mesh(), Mesh(fsdp=4))
  resident = 16 * w.params / 4
  assert kv_rows(w, colocate, room + resident / HEADROOM) == pytest.approx(5.5)


def test_collectives_cross_the_network_once_their_group_leaves_the_node():
  w = _workload()
  node = dataclasses.replace(UNIT, devices_per_node=2, network_bytes_per_s=1e8)
  # tensor 2 fits a node: the links; tensor 4 spans two: the network, 10x slower here.
  inside = forward_s(w, node, IDEAL, Mesh(tensor=2)) - forward_s(w, UNIT, IDEAL, Mesh(tensor=2))
  assert inside == pytest.approx(0.0, abs=1e-12)
  across = forward_s(w, node, IDEAL, Mesh(tensor=4)) - 791_552e-9 / 4
  assert across == pytest.approx(2 * 2 * 3 / 4 * 8 * 64 * 4 / 1e8)


def test_a_collective_across_slices_takes_the_data_center_network():
  """A TPU job of two slices of 4 chips: tensor 4 stays in a slice (its ICI), tensor 8 spans
  both and runs at the DCN figure; a device with no DCN figure cannot be split into slices."""
  w, ici = _workload(), dataclasses.replace(UNIT, devices_per_node=2, network_bytes_per_s=1e8)
  sliced = dataclasses.replace(ici, slice_devices=4, dcn_bytes_per_s=1e7)
  assert forward_s(w, sliced, IDEAL, Mesh(tensor=4)) == forward_s(w, ici, IDEAL, Mesh(tensor=4))
  ici_part = forward_s(w, ici, IDEAL, Mesh(tensor=8)) - 791_552e-9 / 8
  dcn_part = forward_s(w, sliced, IDEAL, Mesh(tensor=8)) - 791_552e-9 / 8
  assert dcn_part == pytest.approx(10 * ici_part)
  with pytest.raises(ValueError, match="TPU v4: no figure for the data-center network"):
    dataclasses.replace(DEVICES["tpu_v4"], slice_devices=4)


def test_the_push_to_hosts_of_the_samplers_own_is_a_reshard_then_a_crossing():
  """On 4 H100 nodes: the sampler beside the trainer on each node (a per-host split) gets the
  weights over NVLink; on nodes of its own (sharding/crossing.py) first the trainer's reshard
  into the sampler's layout (NVLink), then each device's shard over its NIC; a trainer smaller
  than the sampler it must mirror is no plan, nor is a crossing on a TPU with no DCN figure."""
  h100, eff = DEVICES["h100"], dataclasses.replace(IDEAL, link=1.0)
  w = _workload(model=ModelConfig(vocab_size=256, d_model=1024, n_layers=4, n_heads=8,
                                  n_kv_heads=8, head_dim=128, d_ff=4096, dtype="bfloat16"))
  nbytes = w.params * 2
  beside = Plan("separate", Mesh(data=4, fsdp=3), Mesh(data=20), Mesh(data=4, fsdp=3))
  assert not apart(beside, h100)  # 12 of 32: 3 per node, a per-host split
  assert push_s(w, h100, eff, beside) == pytest.approx(nbytes / 12 / h100.link_bytes_per_s)
  hosts = Plan("separate", Mesh(data=2, fsdp=8), Mesh(data=8, tensor=2), Mesh(data=2, fsdp=8))
  assert apart(hosts, h100)  # nodes 0-1 train, nodes 2-3 sample
  shard = nbytes / 2
  assert push_s(w, h100, eff, hosts) == pytest.approx(
      shard / h100.link_bytes_per_s + shard / h100.network_bytes_per_s)
  small = Plan("separate", Mesh(fsdp=8), Mesh(data=24), Mesh(fsdp=8))
  assert "fewer devices than the sampler" in problem(dataclasses.replace(w, prompts=24), small,
                                                    32, h100, presets_only=False)
  v4 = Plan("separate", Mesh(fsdp=4), Mesh(data=4), Mesh(fsdp=4))
  assert "no figure for the network between TPU v4 hosts" in problem(
      dataclasses.replace(w, prompts=4), v4, 8, DEVICES["tpu_v4"], presets_only=False)


def test_calibration_times_a_stage_only_from_calls_that_ran_alone():
  events = [{"name": "generate", "ts": 0, "dur": 10}, {"name": "ref logprobs", "ts": 10, "dur": 5},
            {"name": "old logprobs", "ts": 12, "dur": 6}, {"name": "score", "ts": 11, "dur": 2},
            {"name": "update", "ts": 20, "dur": 8}]
  assert [e["name"] for e in cal.alone(events)] == ["generate", "score", "update"]


def test_step_critical_path_and_memory():
  times = dict.fromkeys(["generate", "reward", "reference", "old_logprobs", "values", "update",
                         "critic_update", "weight_push", "host"], 0.0)
  times.update(generate=5.0, reference=1.0, old_logprobs=2.0, update=3.0, weight_push=0.5)
  m = Mesh(fsdp=4)
  sync = Plan("separate", m, m, m)
  assert step_time(times, sync, UNIT, IDEAL) == pytest.approx(11.5)
  assert step_time(times, dataclasses.replace(sync, mode="async"), UNIT, IDEAL) == 6.5
  no_lag = dataclasses.replace(sync, mode="async", staleness=0)  # waits for every update
  assert step_time(times, no_lag, UNIT, IDEAL) == pytest.approx(11.5)
  assert step_time(times, dataclasses.replace(sync, strategy="interleave"), UNIT, IDEAL) == 10.5
  cpu = DEVICES["cpu"]  # shared cores: async does not overlap generation with training
  assert step_time(times, dataclasses.replace(sync, mode="async"), cpu, IDEAL) == 11.5
  # ... but concurrent scoring passes hide a fitted fraction of the shorter ones: 2 + 0.25 x 1.
  quarter = dataclasses.replace(IDEAL, shared_overlap=0.25)
  assert step_time(times, sync, cpu, quarter) == pytest.approx(11.25)
  assert step_time(times, sync, UNIT, quarter) == pytest.approx(11.5)  # accelerators: in turn
  w = _workload()
  mem = memory(w, Plan("separate", Mesh(fsdp=4), Mesh(data=2), Mesh(fsdp=4)))
  # Trainer: 16 bytes per parameter (weights, gradient, two Adam moments) + the reference's 4,
  # sharded 4 ways, plus activations; sampler: float32 weights + the KV cache of 1 row x 4 slots.
  assert mem["trainer"] >= 20 * 57_344 / 4
  assert mem["sampler"] == pytest.approx(57_344 * 4 + 1 * 4 * 1 * 2 * 1 * 64 * 4)


def test_search_respects_memory_and_returns_valid_placements():
  cfg = ExperimentConfig()
  w = Workload.from_config(cfg, "cpu")
  everything = search(w, 8, DEVICES["cpu"], CPU_EFFICIENCY, top=None)
  assert everything and all(not problem(w, r.plan, 8, DEVICES["cpu"], True) for r in everything)
  for r in everything:  # each one is a placement the presets build
    make_placement(r.plan.strategy, 8, train_devices=r.plan.trainer.size if r.plan.strategy !=
                   "colocate" else 1, sampler_tensor=r.plan.sampler.tensor)
  steps = [r.step_s for r in everything]
  assert steps == sorted(steps)
  peaks = sorted(total_bytes(r.memory, r.plan) for r in everything)
  limit = (peaks[0] + peaks[-1]) / 2 / HEADROOM
  small = dataclasses.replace(DEVICES["cpu"], memory_bytes=limit)
  kept = search(w, 8, small, CPU_EFFICIENCY, top=None)
  assert 0 < len(kept) < len(everything)
  assert all(total_bytes(r.memory, r.plan) <= HEADROOM * limit for r in kept)
  assert not search(w, 8, dataclasses.replace(small, memory_bytes=1.0), CPU_EFFICIENCY)


def test_plan_strategy_resolves_to_a_runnable_config():
  from train.roles.cluster import RoleCluster
  cfg = ExperimentConfig()
  cfg = dataclasses.replace(cfg, placement=dataclasses.replace(cfg.placement, strategy="plan"))
  resolved, best = choose(cfg, host_major_devices())
  assert resolved.placement.strategy == best.plan.strategy != "plan"
  RoleCluster(resolved, initialize=False)  # the real placement and batch checks pass


def test_remat_is_searched_and_the_plan_sets_it(monkeypatch):
  """Where no plan that keeps every activation fits, remat plans do; `choose` then writes the
  plan's remat into the config it runs."""
  from planner import plan as plan_module
  cfg = ExperimentConfig()
  w = Workload.from_config(cfg, "cpu")
  everything = search(w, 8, DEVICES["cpu"], CPU_EFFICIENCY, top=None)
  assert {r.plan.remat for r in everything} == {"none", "dots", "full"}
  need = min(total_bytes(r.memory, r.plan) for r in everything if r.plan.remat == "none")
  small = dataclasses.replace(DEVICES["cpu"], memory_bytes=0.99 * need / HEADROOM)
  kept = search(w, 8, small, CPU_EFFICIENCY, top=None)
  assert kept and all(r.plan.remat != "none" for r in kept)
  monkeypatch.setattr(plan_module, "search", lambda *a, **k: kept)
  cfg = dataclasses.replace(cfg, placement=dataclasses.replace(cfg.placement, strategy="plan"))
  resolved, best = choose(cfg, host_major_devices())
  assert resolved.model.layers.remat == best.plan.remat != "none"
  assert resolved.rl.batching.micro_batch_size == best.plan.micro_batch_size


def test_a_runs_trace_fed_back_changes_the_factors(tmp_path):
  from train.run import Experiment
  raw = tiny.get_config().to_dict()
  raw.update(run_dir=str(tmp_path), run_name="fit", checkpoint_every=100)
  raw["sft"]["steps"] = 0
  raw["rl"]["steps"] = 6
  raw["placement"]["strategy"] = "plan"
  with Experiment(raw) as exp:
    exp.run()
    n = len(exp.ctx.cluster.devices)
  run_dir = os.path.join(str(tmp_path), "fit")
  with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
    assert json.load(f)["placement"]["strategy"] in ("colocate", "interleave", "separate")
  samples = cal.samples_from_run(run_dir, DEVICES["cpu"], n, skip=2)
  labels = {s.label for s in samples}
  assert {"step", "generate", "update"} <= labels
  fitted = cal.fit(samples, DEVICES["cpu"], CPU_EFFICIENCY)
  assert fitted != CPU_EFFICIENCY
  before = sum(abs(e) for e in cal.errors(samples, DEVICES["cpu"], CPU_EFFICIENCY))
  after = sum(abs(e) for e in cal.errors(samples, DEVICES["cpu"], fitted))
  assert after < before


def test_plan_cli_simulates_and_names_bad_devices(capsys):
  assert plan_main(["jaxrl-plan", "--device", "h100", "--devices", "16", "--top", "3",
                    "--all_meshes"]) == 0
  out = capsys.readouterr().out
  assert "16 x H100" in out and out.count(" s  ") == 3
  assert plan_main(["jaxrl-plan", "--device", "h101"]) == 2
  assert "--device: expected one of" in capsys.readouterr().err
  assert plan_main(["jaxrl-plan", "--device", "tpu_v4", "--devices", "16", "--slices", "2"]) == 2
  assert "--slices: TPU v4: no figure for the data-center network" in capsys.readouterr().err


def test_docs_scaling_tables_are_what_the_simulator_computes():
  from planner import scaling
  with open(scaling.DOC, encoding="utf-8") as f:
    text = f.read()
  assert scaling.render(text) == text, "run `python -m planner.scaling --write`"


def test_lora_and_offload_in_the_memory_model():
  """Hand-computed bytes of one trainer device: full-parameter training holds float32 weights
  and Adam moments (12 bytes per parameter) plus the bf16 reference; LoRA holds the bf16 base
  (which is the reference) and 12 bytes per adapter parameter; offload keeps the moments and a
  separate reference off the device between updates, and the search takes it only colocated."""
  from train.cli.flags import load_config_file
  from jaxrl.config_files import resolve
  from planner.cost import lora_params
  from planner.memory import trainer_bytes
  cfg = resolve(load_config_file("configs/llama3_1_8b_gsm8k_lora.py"), hf=False)
  w = Workload.from_config(cfg, "gpu")
  m = cfg.model
  per_layer = 16 * (2 * (m.d_model + 32 * 128) + 2 * (m.d_model + 8 * 128)
                    + 3 * (m.d_model + m.d_ff))
  assert lora_params(cfg) == w.lora_params == 32 * per_layer
  full = dataclasses.replace(w, lora_params=0)
  plan = Plan("colocate", Mesh(), Mesh(), Mesh())
  p, n = w.params, w.lora_params
  assert trainer_bytes(full, plan)[0] == pytest.approx(12 * p + 2 * p)
  assert trainer_bytes(w, plan)[0] == pytest.approx(2 * p + 12 * n)
  offload = dataclasses.replace(plan, offload=True)
  assert trainer_bytes(full, offload)[0] == pytest.approx(4 * p)
  assert trainer_bytes(w, offload)[0] == pytest.approx(2 * p + 4 * n)
  # One H100: LoRA plans exist (the best colocated), full-parameter ones do not.
  h100 = DEVICES["h100"]
  eff = Efficiency()
  ranked = search(w, 1, h100, eff, modes=("sync",), top=None)
  assert ranked and ranked[0].plan.strategy == "colocate"
  assert any(r.plan.offload for r in ranked)
  assert not search(full, 1, h100, eff, modes=("sync",), top=None)
  assert all(not r.plan.offload for r in search(full, 16, h100, eff, top=None)
             if r.plan.strategy != "colocate")


def test_on_a_tpu_slice_the_trainer_fsdp_spans_the_hosts_as_the_placement_builds_it(monkeypatch):
  """A v5p slice of 8 chips is 2 hosts of 4: GPU nodes get fsdp per host and data across them,
  a TPU slice fsdp over every chip (as sharding/placement.py builds it), and the update's memory
  as the TPU compiler lays it out (planner/footprint_tpu.py)."""
  from planner import footprint
  w = Workload.from_config(ExperimentConfig(), "tpu")
  tpu = DEVICES["tpu_v5p"]
  gpu = dataclasses.replace(tpu, platform="gpu")
  on_tpu, on_gpu = (search(w, 8, d, CPU_EFFICIENCY, top=None, modes=("sync",)) for d in (tpu, gpu))
  whole = lambda ranked: {(r.plan.trainer.data, r.plan.trainer.fsdp) for r in ranked
                          if r.plan.trainer.size == 8}
  assert whole(on_tpu) == {(1, 8)} and whole(on_gpu) == {(2, 4)}
  assert all(r.plan.trainer.data == 1 for r in on_tpu)
  spec = make_placement("colocate", 8, train_devices=8, n_hosts=2, one_network=True)
  assert spec.roles["actor"].shape["fsdp"] == 8
  calls, real = [], footprint.update_peak
  monkeypatch.setattr(footprint, "update_peak",
                      lambda *a, tpu=None, **kw: calls.append(tpu) or real(*a, tpu=tpu, **kw))
  plan = Plan("colocate", Mesh(fsdp=8), Mesh(data=8), Mesh(fsdp=8))
  assert memory(w, plan, tpu=True) != memory(w, plan)
  assert calls[0] == dict(params=w.params, fsdp=8, lora=False) and calls[-1] is None
