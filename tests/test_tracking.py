"""TensorBoard and W&B views of metrics.jsonl: read back with TensorBoard's own event reader and
from W&B's offline run file, the scalars equal the jsonl's rows, also across a resume."""
import glob
import json
import struct
import time

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxrl.config_files import shipped
from train.io.metrics import read_metrics
from train.run import Experiment

tiny = shipped("tiny")


def _scalars(directory: str) -> dict[str, dict[int, float]]:
  acc = EventAccumulator(directory, size_guidance={"scalars": 0})
  acc.Reload()
  return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _wandb_history(run_dir: str) -> list[dict]:
  """The history records of the W&B offline run file (LevelDB log blocks of Record protos)."""
  from wandb.proto import wandb_internal_pb2 as pb
  [path] = glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb")
  data, pos, block, records, buf = open(path, "rb").read(), 7, 32768, [], b""
  assert data.startswith(b":W&B")
  while pos + 7 <= len(data):
    left = block - pos % block
    if left < 7:
      pos += left
      continue
    _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
    buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
    if kind in (1, 4):  # a whole record, or the last piece of one
      records.append(pb.Record.FromString(buf))
      buf = b""
  return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
          for r in records if r.WhichOneof("record_type") == "history"]


@pytest.mark.slow
def test_tensorboard_and_wandb_equal_the_jsonl_across_a_resume(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  c = tiny.get_config()
  c.rl.steps = 4
  c.update(run_dir=str(tmp_path), run_name="t", checkpoint_every=2)
  c.logging.wandb = True
  with Experiment(c) as exp:
    exp.stage("sft").run()
    exp.rl.run(steps=3)  # checkpoint after RL step 2; step 3 is lost with the "crash"
    first = list(exp.writer.rows)
  run_dir = tmp_path / "t"
  deadline = time.time() + 60  # W&B's own process may still be writing its file (a busy machine)
  while True:
    logged = [r for r in _wandb_history(str(run_dir)) if "rl/step" in r]
    if len([r for r in logged if "rl/reward_mean" in r]) >= 3 or time.time() > deadline:
      break
    time.sleep(1)
  rl_first = [r for r in first if r["phase"] == "rl" and "reward_mean" in r]
  assert [r["rl/step"] for r in logged if "rl/reward_mean" in r] == [1, 2, 3]
  for row, wb in zip(rl_first, [r for r in logged if "rl/reward_mean" in r]):
    assert wb["rl/reward_mean"] == pytest.approx(row["reward_mean"], rel=1e-12)
  with Experiment.restore(str(run_dir), logging={"wandb": False}) as exp:
    exp.run()
  rows = read_metrics(str(run_dir / "metrics.jsonl"))
  assert [r["step"] for r in rows if r["phase"] == "rl" and "reward_mean" in r] == [1, 2, 3, 4]
  for phase in ("sft", "rl"):
    got = _scalars(str(run_dir / "tensorboard" / phase))
    mine = [r for r in rows if r["phase"] == phase]
    for key in ("loss", "reward_mean", "heldout_acc", "kl", "step_time"):
      want = {r["step"]: np.float32(r[key]) for r in mine if key in r}
      if want or key in got:  # the resumed step 3 replaced the lost one (purged), not added
        assert got[key] == want, (phase, key)
    assert set(got) >= {k for r in mine for k, v in r.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)
                        and k not in ("phase", "step")}
  acc = EventAccumulator(str(run_dir / "tensorboard" / "run"))
  acc.Reload()  # the config and the placement, as text
  text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
  assert json.loads(text)["rl"]["steps"] == 4
  assert "separate: actor on devices [0, 1, 2, 3]" in \
      acc.Tensors("placement/text_summary")[0].tensor_proto.string_val[0].decode()


def test_the_plot_names_the_run_and_shows_the_held_out_score_from_before_sft(tmp_path):
  """metrics.png: a title, the held-out score before SFT, SFT's and RL's on one step axis over
  [0, 1] (not autoscaled), and legends only where a panel has several lines."""
  from train.io.metrics import plot_metrics
  rows = [*({"phase": "sft", "step": s, "loss": 1 / s} for s in (10, 20)),
          {"phase": "sft", "step": 20, "heldout_acc": 0.70},
          {"phase": "rl", "step": 0, "heldout_acc": 0.70},
          *({"phase": "rl", "step": s, "reward_mean": 0.5, "kl": 0.0, "entropy": 1.0,
             "heldout_acc": 0.80} for s in (1, 2))]
  fig = plot_metrics(rows, str(tmp_path / "m.png"), title="NAME: what it trains", before=0.1)
  assert fig._suptitle.get_text() == "NAME: what it trains"
  held = next(ax for ax in fig.axes if ax.get_title().startswith("held-out"))
  sft, rl = held.lines[:2]
  assert list(zip(sft.get_xdata(), sft.get_ydata())) == [(0, 0.1), (20, 0.70)]
  assert list(rl.get_xdata()) == [20, 21, 22] and held.get_ylim() == (-0.02, 1.02)
  assert held.get_legend() is not None
  assert all(ax.get_legend() is None for ax in fig.axes if ax is not held)
  assert (tmp_path / "m.png").stat().st_size > 10_000
