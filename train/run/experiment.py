"""`Experiment`: the one entry point of the CLI, the benchmarks, the tests and notebooks.

    exp = Experiment(config)          # a config file's ConfigDict, an ExperimentConfig, a mapping
    exp.run()                         # every stage the config enables, in order; -> summary
    exp.stage("sft").run(steps=50)    # or pieces: a stage for some steps, or one RL step:
    exp.rl.step()
    exp.sample(["rev abcde="], n=4)   # decoded completions with their log-probs
    exp.evaluate(); exp.metrics       # held-out accuracy; the logged rows (a DataFrame w/ pandas)
    exp.save(); Experiment.restore("runs/NAME")   # the whole run state, and back

It owns the run state: the `RunContext` (models on their meshes, generator, task data), the
stages (train/stages/: each with its progress and its summary entries) with their shared hooks
(train/run/hooks.py), the metrics log, and the run-state checkpoints (train/io/checkpoint.py,
restored by train/run/resume.py into a value it takes). The run summary is put together here, in
`summary`.
"""
from __future__ import annotations

import json
import logging
import os
import weakref

import jax
from flax import nnx

from jaxrl.config import ConfigError, ExperimentConfig, to_dict
from jaxrl.config_files import merge, resolve
from train.io import compilation, rundir
from train.io.checkpoint import CheckpointError, RunCheckpointer, params_fingerprint
from train.io.host_transfers import HostTransfers
from train.io.metrics import MetricsWriter, plain_row, plot_metrics
from train.io.tracking import Trackers, last_steps
from train.roles.layout import Layout, layout as make_layout
from train.roles.link import release_groups
from train.run.hooks import Checkpoint, Evaluate, Log, NonFinite, Progress, StopRequest
from train.run.resume import Resumed, latest_good, snapshot
from train.run.sampling import Completion, sample
from train.stages import STAGES, Stage, Stopped, run_stage
from train.stages.context import RunContext

log = logging.getLogger("jaxrl")


class StageHandle:
  """`exp.stage(name)`: runs that stage for some steps (`run`) or one step (`step`)."""

  def __init__(self, exp: Experiment, name: str):
    self._exp, self.name = exp, name

  def run(self, steps: int | None = None) -> dict:
    """`steps` more steps (default: to the stage's end); returns the last metrics row."""
    return self._exp._run_stage(self.name, steps)

  def step(self) -> dict:
    return self.run(steps=1)


class Experiment:

  def __init__(self, config, *, run_dir: str | None = None, resume_run: bool = False,
               start_if_none: bool = False, layout: Layout | None = None):
    """`resume_run`: continue from the run dir's newest good checkpoint (a ConfigError when it
    has none, unless `start_if_none`); `layout`: `config`'s, already worked out (the CLI's)."""
    self.layout = make_layout(resolve(config)) if layout is None else layout
    self.cfg: ExperimentConfig = self.layout.cfg  # (the planner's choice filled in)
    compilation.enable_cache(self.cfg.compilation_cache_dir)
    self.compiles = compilation.CompileRecord()  # this run's compiles, from now to `close`
    weakref.finalize(self, self.compiles.close)  # (an Experiment never closed stops too)
    try:
      self._build(resume_run, run_dir, start_if_none)
    except BaseException:
      self.compiles.close()
      raise

  def _build(self, resume_run: bool, run_dir: str | None, start_if_none: bool) -> None:
    names = [name for name, cls in STAGES.items() if cls.enabled(self.cfg)]
    for name in names:
      STAGES[name].check(self.cfg)
    self.run_dir = rundir.prepare(self.cfg, resume=resume_run, run_dir=run_dir,
                                  start_if_none=start_if_none)
    transfers = HostTransfers()  # the run's: its context's, its checkpoints'
    split = self.layout.split  # the sampler's own processes save nothing
    self.checkpointer = RunCheckpointer(
        self.run_dir, names, keep=self.cfg.keep_checkpoints, transfers=transfers,
        processes=None if split is None else set(split.trainer_processes))
    saved = self.checkpointer.saved() if resume_run else []
    if resume_run and not saved and not start_if_none:  # (only a save that never completed)
      raise ConfigError(f"config.run_name: --resume found no complete checkpoint in "
                        f"{self.run_dir}; pass --resume_or_start to start the run")
    fresh = not saved and not self.cfg.init_checkpoint
    self.ctx = RunContext(self.cfg, self.run_dir, initialize=fresh, transfers=transfers,
                          compiles=self.compiles, layout=self.layout)
    self.writer = MetricsWriter(self.run_dir, enabled=jax.process_index() == 0)
    kinds = {name: STAGES[name] for name in names}
    resumed = latest_good(self.checkpointer, self.ctx, kinds, saved) if saved else None
    if resumed:
      self._take(resumed)
    else:
      self._start_afresh(kinds)
    if resume_run:  # restored under this config: now it is the run's
      rundir.write_config(self.cfg, self.run_dir)
    self._track()
    self.stop = StopRequest(self._save)
    self.progress = Progress(self.cfg.progress and jax.process_index() == 0)
    self.hooks = [Evaluate(initial=resumed is None),
                  Log(self.writer, lambda: self.summary, self.ctx.transfers),
                  NonFinite(self.cfg.max_skipped_updates),
                  Checkpoint(self._save, self.cfg.checkpoint_every, self.cfg.checkpoint_minutes),
                  self.progress, self.stop]

  @classmethod
  def restore(cls, run_dir: str, **overrides) -> Experiment:
    """The run in `run_dir` (its config.json), continued from its newest good checkpoint."""
    with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
      return cls(merge(json.load(f), overrides), run_dir=run_dir, resume_run=True)

  def _track(self) -> None:
    """TensorBoard / W&B views of the metrics rows (process 0), a resumed run's later events
    purged; the config and its placement logged once."""
    trackers = Trackers(self.cfg, self.run_dir, enabled=jax.process_index() == 0,
                        purge_after=last_steps(self.writer.rows))
    trackers.log_config(self.cfg, self.layout.describe())
    self.writer.trackers = trackers

  def _take(self, resumed: Resumed) -> None:
    """A checkpoint's run state: its stages, the next one, its summary and metrics rows."""
    self.stages, self.position = resumed.stages, resumed.position
    self._summary_base = resumed.summary  # the run's own entries and the earlier stages'
    self.writer.resume(resumed.metrics_rows)

  def _start_afresh(self, kinds: dict[str, type[Stage]]) -> None:
    self.stages, self.position = {name: kind(self.ctx) for name, kind in kinds.items()}, 0
    skipped = self.ctx.task.skipped
    self._summary_base = {"run_dir": self.run_dir,
                          **({"data_skipped_rows": dict(skipped)} if skipped else {})}
    self.writer.resume(0)
    if self.cfg.init_checkpoint:
      self._init_actor(self.cfg.init_checkpoint)
    elif self.ctx.cluster.actor.params is None:  # a fresh start after unreadable checkpoints
      self.ctx.cluster.initialize_actor()

  def _init_actor(self, directory: str) -> None:
    try:
      step = self.ctx.cluster.load_actor(directory)
    except ValueError as e:
      raise ConfigError(str(e)) from None
    log.info("actor initialised from %s (step %d)", directory, step)

  # -- running ------------------------------------------------------------------------------
  @property
  def stage_names(self) -> list[str]:
    return list(self.stages)

  def stage(self, name: str) -> StageHandle:
    if name not in self.stages:
      raise ValueError(f"stage {name!r}: this config runs {self.stage_names}")
    return StageHandle(self, name)

  @property
  def rl(self) -> StageHandle:
    return self.stage("rl")

  def _run_stage(self, name: str, steps: int | None) -> dict:
    at = self.stage_names.index(name)
    self.position = max(self.position, at)  # the stages before it are done or skipped
    stage = self.stages[name]
    with self.stop:
      try:
        row = run_stage(stage, self.hooks, steps)
      finally:
        if stage.progress.finished or self.stop.event.is_set():
          self.progress.close()
      if stage.progress.finished:
        self.position = max(self.position, at + 1)
        self.stop.check()  # a request during the stage's last step ends the run here
    return plain_row(self.ctx.transfers.to_host(row, "metrics"))

  def run(self) -> dict:
    """Every remaining stage to its end; the summary (also written to summary.json)."""
    try:
      with self.stop:  # one signal handler for the whole run: no gap between stages
        for name in self.stage_names[self.position:]:
          self._run_stage(name, None)
    except Stopped as e:
      return self.finish(stopped=str(e))
    return self.finish()

  @property
  def summary(self) -> dict:
    """The run summary so far: the run's own entries (its dir, the data rows it skipped) and
    each stage's (train/stages/base.py: start evaluations, checkpoint step, final results), on
    top of the summary a resumed checkpoint held. What checkpoints save; `finish` adds the
    end-of-run entries."""
    out = dict(self._summary_base)
    for stage in self.stages.values():
      out.update(stage.summary())
    return out

  def finish(self, *, stopped: str | None = None) -> dict:
    """Waits for checkpoints, writes summary.json (the summary, what stopped the run, the
    actor's fingerprint, the compile seconds), metrics.png and trace.json."""
    for stage in self.stages.values():
      stage.close()
    self.checkpointer.wait()
    summary = {**self.summary, **({"stopped": stopped} if stopped else {}),
               "params_fingerprint": params_fingerprint(self.ctx.cluster.actor.params,
                                                        self.ctx.transfers),
               **self.compiles.summary()}
    if jax.process_index() == 0:
      self.writer.close()
      plot_metrics(self.writer.rows, os.path.join(self.run_dir, "metrics.png"),
                   title=self._plot_title(), before=summary.get("heldout_acc_init"))
      self.ctx.timeline.write_chrome_trace(os.path.join(self.run_dir, "trace.json"))
      with open(os.path.join(self.run_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    return summary

  def _plot_title(self) -> str:
    """The run's name and what it trains, above metrics.png's panels."""
    cfg = self.cfg
    short = lambda path: os.path.join(*os.path.normpath(path).split(os.sep)[-2:])
    data = short(cfg.data.train_path) if cfg.data.train_path else f"task {cfg.task.name}"
    model = (short(cfg.model.hf_path) if cfg.model.hf_path
             else f"a {cfg.model.n_layers}-layer model of width {cfg.model.d_model}")
    steps = ", ".join(f"{name} {self.stages[name].total} steps" for name in self.stage_names)
    return f"{os.path.basename(self.run_dir)}: {model}, {data}; {steps}"

  def close(self) -> None:
    for stage in self.stages.values():
      stage.close()
    self.progress.close()
    try:
      self.checkpointer.close()
    except CheckpointError as e:  # raised to the run already, when it saved or finished
      log.warning("%s", e)
    self.writer.close()
    if self.ctx.cluster.split is not None:
      release_groups()
    self.ctx.close()
    self.compiles.close()

  def __enter__(self) -> Experiment:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- run state ----------------------------------------------------------------------------
  def _current(self):
    started = [s for s in self.stages.values() if s.progress.started]
    if not started:
      raise ValueError("nothing to save yet: no stage has run")
    return started[-1]

  def save(self) -> None:
    """A run-state checkpoint now (at the current stage's step)."""
    self._save(self._current())

  def _save(self, stage) -> None:
    if stage.progress.saved == stage.progress.done:  # already saved (or restored) at this step
      return
    stage.mark_saved()
    with stage.paused():  # returns once the arrays are copied off the devices
      items, meta, metrics = snapshot(self.ctx, stage, self.summary,
                                             len(self.writer.rows))
      self.checkpointer.save(stage.name, stage.progress.done, items, meta, metrics)

  # -- looking at the model -----------------------------------------------------------------
  def evaluate(self) -> dict:
    """Held-out greedy accuracy of the current policy."""
    return {"heldout_acc": self.ctx.evaluate()}

  def sample(self, prompts: list[str], *, n: int = 1, greedy: bool = False,
             max_new_tokens: int | None = None, seed: int = 0) -> list[list[Completion]]:
    """`n` completions per prompt (text, token ids, per-token log-probs) from the policy."""
    return sample(self.ctx, prompts, n=n, greedy=greedy, max_new_tokens=max_new_tokens,
                  seed=seed)

  @property
  def metrics(self):
    """The logged rows: a pandas DataFrame when pandas is installed, else a list of dicts."""
    rows = list(self.writer.rows)
    try:
      import pandas
    except ImportError:
      return rows
    return pandas.DataFrame(rows)

  @property
  def config(self) -> dict:
    return to_dict(self.cfg)

  @property
  def params(self) -> nnx.State:
    """The actor's parameters (sharded over its mesh)."""
    return self.ctx.cluster.actor.params
