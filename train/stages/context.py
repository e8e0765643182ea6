"""What every stage shares: config, tokenizer, task data, cluster, generator, timeline, the
record of named host transfers, the processes of user code.

`RunContext` is built once per experiment (train/run/experiment.py) and handed to each stage; a
stage never reaches another stage, only this context.
"""
from __future__ import annotations

import jax

from jaxrl.config import ExperimentConfig
from jaxrl.data.tasks import Example
from train.io.compilation import CompileRecord
from train.io.host_transfers import HostTransfers
from train.io.timeline import Timeline
from train.roles.cluster import RoleCluster
from train.roles.layout import Layout, layout as make_layout
from train.rollout.generator import Generator
from train.rollout.shared_env import shared
from train.task.heldout import evaluate
from train.task.data import load_task, load_tokenizer_for
from train.task.environment import environment_for
from train.task.processes import UserProcesses
from train.task.reward import Judge


class RunContext:
  """The run's shared pieces; stages take what they need from it, the collaborators they build
  get those pieces alone. It owns what the run started beside the models: the processes of
  user code (`processes`), the generator's environment threads, and the record of the named
  host transfers (`transfers`); `close` stops them."""

  def __init__(self, cfg: ExperimentConfig, run_dir: str, *, initialize: bool = True,
               transfers: HostTransfers | None = None, compiles: CompileRecord | None = None,
               layout: Layout | None = None):
    """`initialize=False`: the actor stays abstract (a restore fills it). `transfers`: the
    run's record of named host transfers (default: a new one); `compiles`: its record of
    compile seconds, which the timeline's spans label; `layout`: the run's (default: `cfg`'s,
    train/roles/layout.py)."""
    self.layout = make_layout(cfg) if layout is None else layout
    self.cfg, self.run_dir, self.compiles = self.layout.cfg, run_dir, compiles
    self.transfers = HostTransfers() if transfers is None else transfers
    self.processes = UserProcesses()
    try:
      self._build(self.cfg, initialize)
    except BaseException:
      self.processes.close()
      raise

  def _build(self, cfg: ExperimentConfig, initialize: bool) -> None:
    self.tok = load_tokenizer_for(cfg)
    self.task = load_task(cfg, self.tok, self.processes)
    self.judge = Judge(self.tok, self.task.reward, self.transfers)
    self.cluster = RoleCluster(cfg, layout=self.layout, initialize=initialize,
                               transfers=self.transfers)
    environment = environment_for(cfg, self.tok, self.task, self.processes)
    name, group = self.cluster.process_group()
    if environment is not None and len(group) > 1:  # stepped once, by the group's first
      environment = shared(environment, name, jax.process_index() == min(group))
    self.generator = Generator(self.cluster, max_new_tokens=self.task.max_new_tokens,
                               tok=self.tok, rl=cfg.rl, transfers=self.transfers,
                               environment=environment)
    self.timeline = Timeline(self.compiles)

  def evaluate(self, examples: list[Example] | None = None) -> float:
    """Held-out mean score of the newest policy's greedy completions (for a 0/1 verifier: the
    accuracy); train/task/heldout.py, as `jaxrl-eval` computes it."""
    examples = self.task.heldout if examples is None else examples
    weights = self.cluster.sampler_weights
    result = evaluate(self.generator, self.task, self.judge, weights.fresh(), examples,
                      batch_size=self.cfg.eval.batch_size)
    weights.release()  # (a mirror of a generator apart is made for the evaluation only)
    return float(result.scores_EN.mean())

  def close(self) -> None:
    """Stops the generator's environment threads and the processes of user code (once)."""
    self.generator.close()
    self.processes.close()

  def __enter__(self) -> RunContext:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
