"""The run's reward: `make_reward` (a verifier of completions against reference answers, or a
user's function of the rows' fields, in worker processes, contained) and `Judge`, which applies
it to rollouts (their completions decoded on the host) or takes their environments' rewards."""
from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from isolation.workers import check_importable
from jaxrl.config import ConfigError
from jaxrl.config_rl import RLConfig
from jaxrl.data.tasks import Example
from jaxrl.data.tokenizer import Tokenizer
from jaxrl.rewards.user import RewardFnError, call_reward_fn
from jaxrl.rewards.verifier import VERIFIERS
from train.io.host_transfers import HostTransfers
from train.io.tally import Tally
from train.task.processes import UserProcesses

# (prompts, completions, examples) -> [B] float32 rewards
Reward = Callable[[list[str], list[str], list[Example]], np.ndarray]


def make_reward(name: str, processes: UserProcesses, rl: RLConfig | None = None,
                report: Callable[[int], None] | None = None
                ) -> tuple[Reward, Callable[[str, str], float]]:
  """(batch reward, per-sample verifier) of `rl.verifier`: a built-in verifier of completions
  against reference answers, or `package.module:function` called with the batch's prompts,
  completions and row fields (the reference answer as `answer`), in worker processes of
  `processes`, contained by `rl.user_code.timeout_s` and `rl.user_code.on_error` (its failures
  told to `report`)."""
  if ":" not in name:
    verifier = VERIFIERS[name]
    return (lambda prompts, completions, examples: np.array(
        [verifier(c, ex.answer) for c, ex in zip(completions, examples)], np.float32)), verifier
  rl = rl or RLConfig()
  try:  # imported in worker processes only: an import that hangs or allocates takes no run
    check_importable(name, "reward function", "package.module:function", RewardFnError,
                     timeout_s=rl.user_code.timeout_s, memory_gb=rl.user_code.memory_gb,
                     log=processes.say)
  except RewardFnError as e:
    raise ConfigError(f"config.rl.verifier: {e}") from None
  pool = processes.pool(rl.user_code, name)

  def reward(prompts, completions, examples):
    return call_reward_fn(None, prompts, completions,
                          [{**ex.fields, "answer": ex.answer} for ex in examples], pool=pool,
                          spec=name, group=rl.group_size, policy=rl.user_code.on_error,
                          report=report)
  return reward, lambda text, answer: float(reward([""], [text], [Example("", answer)])[0])


def counter(errors: Tally, name: str) -> Callable[[int], None]:
  """`report(n)` adding n to `errors[name]`, from any thread (a turn's environments, and the
  verifiers they call, step in threads: multiturn.py)."""
  return lambda n: errors.add({name: n})


@jax.jit
def completion_tokens(rollout) -> jax.Array:
  """The generated part of a rollout's tokens, [B, N], sliced where the rollout lives."""
  return rollout.tokens_BT[:, rollout.tokens_BT.shape[1] - rollout.completion_mask_BN.shape[1]:]


def completion_texts(tok: Tokenizer, completions_BN: np.ndarray) -> list[str]:
  """Decoded completions (host); decoding stops at EOS."""
  return [tok.decode(row) for row in completions_BN]


class Judge:
  """The run's reward of rollouts: their environments' (multi-turn) or the task's reward of
  their completions, decoded on the host (the completions' token ids are all it fetches, as
  the run's named host transfers `transfers`)."""

  def __init__(self, tok: Tokenizer, reward: Reward, transfers: HostTransfers):
    self.tok, self.reward, self.transfers = tok, reward, transfers

  def rewards(self, rollout, examples, texts: list[str] | None = None) -> np.ndarray:
    """[B] rewards of a rollout of `examples` (group-major rows): its environments', or the
    task reward of its decoded `texts` (decoded here when not given)."""
    if rollout.rewards_B is not None:
      return self.transfers.to_host(rollout.rewards_B, "rewards")
    return self.score(self.texts(rollout) if texts is None else texts, examples)

  def texts(self, rollout) -> list[str]:
    """The rollout's completions, decoded on the host."""
    return completion_texts(self.tok, self.transfers.to_host(completion_tokens(rollout),
                                                             "completions"))

  def lengths(self, rollout) -> np.ndarray:
    """[B] the tokens the policy emitted in each row (an environment's replies left out)."""
    mask_BN = rollout.completion_mask_BN if rollout.loss_mask_BN is None else rollout.loss_mask_BN
    return self.transfers.to_host(mask_BN, "lengths").sum(1)

  def score(self, texts: list[str], examples) -> np.ndarray:
    """[B] rewards of completions `texts` of `examples` (rl.verifier)."""
    examples = list(examples)
    try:
      return self.reward([ex.prompt for ex in examples], texts, examples)
    except RewardFnError as e:  # the user's function misbehaved: a user error, named
      raise ConfigError(f"config.rl.verifier: {e}") from None
