"""What every stage shares: config, tokenizer, task data, cluster, generator, timeline.

`RunContext` is built once per experiment (train/run/experiment.py) and handed to each stage; a
stage never reaches another stage, only this context.
"""
from __future__ import annotations

import logging

import numpy as np

from jaxrl.config import ConfigError, ExperimentConfig, first_line
from jaxrl.envs import ENVIRONMENTS, ContainedEnvironment, EnvError, environment_factory
from jaxrl.data.tasks import Example
from jaxrl.rewards.user import RewardFnError, call_with_timeout
from train.io.host_transfers import to_host
from train.io.timeline import Timeline
from train.rl.experience import completion_texts, completion_tokens
from train.roles.cluster import RoleCluster
from train.rollout.generator import Generator
from train.task.heldout import evaluate
from train.task.task import load_task, load_tokenizer_for

log = logging.getLogger("jaxrl")


class RunContext:

  def __init__(self, cfg: ExperimentConfig, run_dir: str, *, initialize: bool = True):
    """`initialize=False`: the actor stays abstract (a restore fills it)."""
    self.cfg, self.run_dir = cfg, run_dir
    self.tok = load_tokenizer_for(cfg)
    self.task = load_task(cfg, self.tok)
    self.cluster = RoleCluster(cfg, initialize=initialize)
    self.generator = Generator(self.cluster, max_new_tokens=self.task.max_new_tokens,
                               tok=self.tok, rl=cfg.rl, environment=self._environment())
    self.timeline = Timeline()
    rl = cfg.rl  # a user's verifier or environment runs contained (rl.on_user_code_error)
    self.user_code = ":" in rl.verifier or ":" in rl.environment
    self.samplers: dict = {}  # Experiment.sample's compiled samplers, by settings

  def _environment(self):
    """A zero-argument factory of the run's environment (`rl.environment`), or None; a user's
    class is contained (jaxrl/envs/contained.py)."""
    rl = self.cfg.rl
    if not rl.environment:
      return None
    try:
      factory = environment_factory(rl.environment)
    except EnvError as e:
      raise ConfigError(f"config.rl.environment: {e}") from None
    if rl.environment in ENVIRONMENTS:
      return lambda: factory(self.tok, self.task.verifier)
    count = lambda n: self.task.user_code_errors.update({"environment": n})
    return lambda: ContainedEnvironment(
        self._call_user(lambda: factory(self.tok, self.task.verifier)), name=rl.environment,
        timeout_s=rl.user_code_timeout_s, policy=rl.on_user_code_error, report=count)

  def _call_user(self, make):
    """A user environment's constructor: what it raises is a one-line config error."""
    try:
      return call_with_timeout(make, self.cfg.rl.user_code_timeout_s)
    except Exception as e:  # noqa: BLE001 - user code
      raise ConfigError(f"config.rl.environment: {self.cfg.rl.environment}: the constructor "
                        f"raised {type(e).__name__}: {first_line(e)}") from None

  def rewards(self, rollout, examples, texts: list[str] | None = None) -> np.ndarray:
    """[B] rewards of a rollout: its environments' (multi-turn) or the verifier's (of its
    decoded `texts`, decoded here when not given)."""
    if rollout.rewards_B is not None:
      return to_host(rollout.rewards_B, "rewards")
    return self.score(self.texts(rollout) if texts is None else texts, examples)

  def texts(self, rollout) -> list[str]:
    """The rollout's completions, decoded on the host (their token ids are all it fetches)."""
    return completion_texts(self.tok, to_host(completion_tokens(rollout), "completions"))

  def score(self, texts: list[str], examples) -> np.ndarray:
    """[B] rewards of completions `texts` of `examples` (rl.verifier)."""
    examples = list(examples)
    try:
      return self.task.reward([ex.prompt for ex in examples], texts, examples)
    except RewardFnError as e:  # the user's function misbehaved: a user error, named
      raise ConfigError(f"config.rl.verifier: {e}") from None

  def evaluate(self, examples: list[Example] | None = None) -> float:
    """Held-out mean score of the newest policy's greedy completions (for a 0/1 verifier: the
    accuracy); train/evaluation.py, as `jaxrl-eval` computes it."""
    examples = self.task.heldout if examples is None else examples
    result = evaluate(self, self.cluster.sampler.fresh(), examples)
    return float(result.scores_EN.mean())
