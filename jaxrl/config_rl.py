"""The RL stage's settings (`config.rl`), by concern: one small section per registry (its entry's
name and the hyperparameters its entries declare, under the names they declare them: no rename
map between the config and the code) and one per part of the run (rollouts, the async schedule,
multi-turn environments, user code, batching).

  rl.loss        the policy loss (`POLICY_LOSSES`), its aggregation and the terms added to it
  rl.advantage   the advantage estimator (`ADVANTAGES`)
  rl.kl          KL(pi || ref): estimator (`KL_ESTIMATORS`), coefficient, in the loss or rewards
  rl.correction  the rollout correction on any loss (jaxrl/algos/correction.py)
  rl.critic      the critic of an estimator that trains one (gae)
  rl.dapo        DAPO's dynamic sampling and overlong filter / penalty
  rl.rollout     generation: budget, temperature, in-flight slots
  rl.schedule    sync or async, the async schedule (`SCHEDULES`), staleness, partial rollouts
  rl.environment multi-turn rollouts (`ENVIRONMENTS` or "pkg.mod:Class")
  rl.user_code   limits and error policy of a user's verifier or environment
  rl.batching    minibatches, micro-batches, packing, length buckets

Valid names come from the registries themselves: the error for an unknown one lists them.
"""
from __future__ import annotations

import dataclasses

from jaxrl.algos import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from jaxrl.algos.correction import ROLLOUT_MASKS
from jaxrl.config_checks import at_least_zero, check_exact, choice, positive, unit
from jaxrl.envs import ENVIRONMENTS
from jaxrl.envs.base import MAX_OUTPUT_CHARS
from jaxrl.rewards.user import POLICIES as USER_CODE_POLICIES
from jaxrl.rewards.verifier import VERIFIERS
from jaxrl.schedules import SCHEDULES

EXACT_ROUTES = ("", "pass", "replay")

REWARDS = ("verifier", "reward_model")
MODES = ("sync", "async")
KL_MODES = ("loss", "reward")  # KL(pi || ref) as a loss term, or folded into per-token rewards


section = dataclasses.dataclass(frozen=True)


@section
class LossConfig:
  """The policy loss, a `POLICY_LOSSES` name; `eps_low`, `eps_high` and `rho` are the keywords
  its entries declare (jaxrl/algos/losses.py), by those names."""
  name: str = "ppo_clip"
  aggregation: str = "token_mean"  # an `AGGREGATIONS` name: the loss over a minibatch's tokens
  eps_low: float = 0.2  # the ratio's clip [1 - eps_low, 1 + eps_high] (eps_high > eps_low: DAPO)
  eps_high: float = 0.2
  rho: float = 4.0  # AIPO's cap on pi / mu
  entropy_coef: float = 0.0  # minus entropy_coef x the entropy, added to the loss

  def __post_init__(self):
    choice(self, "name", POLICY_LOSSES)
    choice(self, "aggregation", AGGREGATIONS)
    positive(self, "eps_low", "eps_high", "rho")
    at_least_zero(self, "entropy_coef")
    if self.eps_low > 1:  # (1: no lower clip, as CISPO runs)
      raise ValueError(f"eps_low: the ratio's lower bound 1 - eps_low cannot be negative, "
                       f"expected <= 1, got {self.eps_low}")


@section
class AdvantageConfig:
  """The advantage estimator, an `ADVANTAGES` name; `gamma` and `lam` are keywords its entries
  declare (jaxrl/algos/advantages.py)."""
  name: str = "grpo"
  gamma: float = 1.0
  lam: float = 0.95
  whiten: bool = False  # normalise the advantages over the batch's valid tokens

  def __post_init__(self):
    choice(self, "name", ADVANTAGES)
    unit(self, "gamma", "lam")

  @property
  def entry(self):
    return ADVANTAGES[self.name]


@section
class KLConfig:
  """KL(pi || ref), estimated per token by `estimator` (a `KL_ESTIMATORS` name), times `coef`:
  a loss term (`mode="loss"`) or folded into the per-token rewards (`"reward"`)."""
  coef: float = 0.02
  estimator: str = "k3"
  mode: str = "loss"

  def __post_init__(self):
    choice(self, "estimator", KL_ESTIMATORS)
    choice(self, "mode", KL_MODES)
    at_least_zero(self, "coef")


@section
class CorrectionConfig:
  """The rollout correction on any policy loss (jaxrl/algos/correction.py, `rollout_weights`'s
  keywords): a truncated IS weight min(pi_old / mu, tis_cap) when tis_cap > 0, and a
  `ROLLOUT_MASKS` mask dropping ratios outside [mask_low, mask_high]."""
  tis_cap: float = 0.0
  mask: str = "none"
  mask_low: float = 0.5
  mask_high: float = 2.0

  def __post_init__(self):
    choice(self, "mask", ROLLOUT_MASKS)
    at_least_zero(self, "tis_cap", "mask_low")
    positive(self, "mask_high")
    if self.mask_low > self.mask_high:
      raise ValueError(f"mask_low: at most mask_high ({self.mask_high}), got {self.mask_low}")

  @property
  def active(self) -> bool:
    return self.tis_cap > 0 or ROLLOUT_MASKS[self.mask] is not None


@section
class CriticConfig:
  """The critic, trained where the estimator needs one (`ADVANTAGES` entries with `critic`)."""
  learning_rate: float = 1e-4
  clip_eps: float = 0.2  # the value loss's clip around the old values

  def __post_init__(self):
    positive(self, "learning_rate", "clip_eps")


@section
class DAPOConfig:
  """DAPO's batch and reward shaping. Dynamic sampling drops the groups whose rewards are all
  equal and generates more prompt batches until the step's batch is full, at most
  `dynamic_sampling_rounds` extra rounds a step (then dropped groups fill it); it needs
  `rl.reward="verifier"`. `overlong_filter`: responses that use the whole budget get no loss.
  `overlong_buffer` > 0: a soft penalty falling linearly from 0 to -overlong_penalty over the
  budget's last `overlong_buffer` tokens, added to the reward."""
  dynamic_sampling: bool = False
  dynamic_sampling_rounds: int = 3
  overlong_filter: bool = False
  overlong_buffer: int = 0
  overlong_penalty: float = 1.0

  def __post_init__(self):
    at_least_zero(self, "dynamic_sampling_rounds", "overlong_buffer", "overlong_penalty")


@section
class RolloutConfig:
  """Generation."""
  max_new_tokens: int = 8  # generation budget per completion (SFT targets must fit it too)
  temperature: float = 1.0
  top_k: int = 0
  # For benchmarks: every rollout runs to max_new_tokens (EOS and stop tokens do not end it), so
  # a step's work is the same whatever a random policy samples. Evaluation still stops at EOS.
  ignore_eos: bool = False
  # 0: each prompt batch decodes as one static batch; > 0: in-flight batching in this many row
  # slots, refilled as rows finish (a multiple of the sampler's data shards; uneven lengths).
  inflight_slots: int = 0
  # The sampler's log-probs the trainer's bit for bit (mismatch exactly 0; train/loop/exact.py,
  # engine_replay.py): "" off; "pass": each token drawn by the trainer's own pass on its devices
  # (sync, single-turn; that pass once per new token); "replay": the trainer's passes and update
  # replay the sampler's decode loop (sync or async; float32, or bfloat16 without XLA's excess
  # precision; dense or MoE), or the in-flight engine's schedule (in-flight slots or turns; one
  # minibatch, no partial rollouts). Sync: pi_old is the sampler's, checked before evaluations.
  exact: str = ""

  def __post_init__(self):
    positive(self, "max_new_tokens", "temperature")
    at_least_zero(self, "top_k", "inflight_slots")
    choice(self, "exact", EXACT_ROUTES)


@section
class ScheduleConfig:
  """Sync, or async: generation runs ahead (needs placement.strategy="separate") under the
  schedule `name` (a `SCHEDULES` name, jaxrl/schedules.py: "free" takes the newest weights when
  it looks, "fixed" starts batch i with version i - max_staleness exactly, reproducibly)."""
  mode: str = "sync"
  name: str = "free"
  max_staleness: int = 1  # how many policy versions a consumed batch may lag
  # New weights reach the rows in flight between decode segments (needs rollout.inflight_slots)
  partial_rollouts: bool = False

  def __post_init__(self):
    choice(self, "mode", MODES)
    choice(self, "name", SCHEDULES)
    at_least_zero(self, "max_staleness")
    if self.partial_rollouts and self.mode != "async":
      raise ValueError(f"partial_rollouts: needs mode='async', got mode={self.mode!r}")

  @property
  def live_batches(self) -> int:
    """Batches a generator may hold at once: the one the trainer takes and those ahead of it."""
    return self.max_staleness + 1

  @property
  def entry(self):
    return SCHEDULES[self.name]


@section
class EnvironmentConfig:
  """Multi-turn rollouts: `name` an `ENVIRONMENTS` name or "package.module:Class" (empty:
  single-turn)."""
  name: str = ""
  max_turns: int = 4  # model turns of a rollout, all within rollout.max_new_tokens
  max_turn_tokens: int = 0  # one turn's most new tokens (0: what is left of the budget)
  keep_turn_cache: bool = True  # KV cache kept across turns (False: each turn prefills whole)
  # The environments' hyperparameters: each is the keyword-only parameter of that name of the
  # environments that read it (jaxrl/envs/base.py `EnvironmentFactory`), a user's class too.
  max_output_chars: int = MAX_OUTPUT_CHARS  # a tool's reply, cut to this many characters

  def __post_init__(self):
    if self.name and ":" not in self.name:
      choice(self, "name", ENVIRONMENTS)
    positive(self, "max_turns", "max_output_chars")
    at_least_zero(self, "max_turn_tokens")


@section
class UserCodeConfig:
  """A user's verifier or environment ("package.module:..."): each call's time limit, and what a
  raise, hang, wrong type or NaN does: stop | zero (scored 0, counted: `user_code_errors`). A
  user verifier runs in `workers` processes, each limited to `memory_gb` with every process it
  starts (a cgroup; where none can be made, it may start no process: a function that runs a
  subprocess then needs 0, no limit, as does one that imports torch or jax)."""
  timeout_s: float = 60.0
  on_error: str = "stop"
  workers: int = 2
  memory_gb: float = 4.0

  def __post_init__(self):
    choice(self, "on_error", USER_CODE_POLICIES)
    positive(self, "timeout_s", "workers")
    at_least_zero(self, "memory_gb")


@section
class BatchingConfig:
  """How a step's rollouts are cut and shaped for the scoring passes and the update."""
  num_minibatches: int = 2
  # Rows of one gradient micro-batch (whole mesh), accumulated exactly; the scoring passes run
  # in pieces of the same size (less activation memory). 0: the whole minibatch at once.
  # (rollout.exact="replay"'s decode loop, a forward holding a KV cache, runs a minibatch.)
  micro_batch_size: int = 0
  # > 0: the scoring passes and the update run over rows packed to this many tokens (at least
  # the prompt width + max_new_tokens), not the [B, T] batch (train/updates/packing.py).
  pack_length: int = 0
  # "on": the scoring passes and the updates run a piece's rows of one prompt over it once
  # (P + G * N tokens, not G * (P + N): train/updates/prefix.py; packed, as trees); "auto":
  # "on" where the planner prices the step faster (planner/plan.py, as the layout is made).
  share_prefix: str = "off"
  # Prompt batches padded, rollouts trimmed to the bucket of their longest prompt / response: at
  # most this many lengths each (few compiled shapes). 0: pad to max_prompt_/max_new_tokens.
  length_buckets: int = 8

  def __post_init__(self):
    positive(self, "num_minibatches")
    at_least_zero(self, "micro_batch_size", "pack_length", "length_buckets")
    choice(self, "share_prefix", ("off", "on", "auto"))


@section
class RLConfig:
  """GRPO with the verifier's reward by default (docs/algorithms.md for the others): the step's
  shape and its optimisation here, the rest by concern in the sections."""
  steps: int = 150
  prompts_per_step: int = 64
  group_size: int = 8
  learning_rate: float = 3e-4
  warmup_steps: int = 10  # optimizer updates (num_minibatches per RL step) of linear warm-up
  max_grad_norm: float = 1.0
  reward: str = "verifier"  # verifier | reward_model (trained by the reward_model stage)
  # The reward of reward="verifier" and the held-out score: a `VERIFIERS` name, or
  # "package.module:function" (called with prompts, completions, row fields).
  verifier: str = "exact_match"
  loss: LossConfig = dataclasses.field(default_factory=LossConfig)
  advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
  kl: KLConfig = dataclasses.field(default_factory=KLConfig)
  correction: CorrectionConfig = dataclasses.field(default_factory=CorrectionConfig)
  critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
  dapo: DAPOConfig = dataclasses.field(default_factory=DAPOConfig)
  rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
  schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
  environment: EnvironmentConfig = dataclasses.field(default_factory=EnvironmentConfig)
  user_code: UserCodeConfig = dataclasses.field(default_factory=UserCodeConfig)
  batching: BatchingConfig = dataclasses.field(default_factory=BatchingConfig)

  def __post_init__(self):
    choice(self, "reward", REWARDS)
    positive(self, "prompts_per_step", "group_size", "learning_rate", "max_grad_norm")
    at_least_zero(self, "steps", "warmup_steps")
    if ":" not in self.verifier:
      choice(self, "verifier", VERIFIERS)
    if self.dapo.overlong_buffer > self.rollout.max_new_tokens:
      raise ValueError(f"dapo.overlong_buffer: at most rollout.max_new_tokens "
                       f"({self.rollout.max_new_tokens}), got {self.dapo.overlong_buffer}")
    if self.dapo.dynamic_sampling and self.reward != "verifier":
      raise ValueError("dapo.dynamic_sampling: needs reward='verifier' (groups of equal "
                       f"verified rewards are dropped), got reward={self.reward!r}")
    if self.schedule.partial_rollouts and not self.rollout.inflight_slots:
      raise ValueError("schedule.partial_rollouts: rows continue across weight swaps in "
                       "in-flight slots; set rollout.inflight_slots > 0")
    if self.schedule.entry.one_batch_per_step and self.dapo.dynamic_sampling:
      raise ValueError(f"schedule.name: {self.schedule.name!r} ties batch i to version "
                       "i - max_staleness, one batch per step; dapo.dynamic_sampling takes "
                       "several, use 'free'")
    minibatch = self.rollouts // self.batching.num_minibatches
    if self.batching.micro_batch_size and minibatch % self.batching.micro_batch_size:
      raise ValueError(f"batching.micro_batch_size: must divide a minibatch's {minibatch} rows "
                       f"(prompts_per_step*group_size/num_minibatches), got "
                       f"{self.batching.micro_batch_size}")
    check_exact(self)
    if self.advantage.entry.kl_in_reward and self.kl.mode != "reward":
      raise ValueError(f"kl.mode: {self.advantage.name} folds the KL into the rewards; expected "
                       f"'reward', got {self.kl.mode!r}")

  @property
  def rollouts(self) -> int:
    return self.prompts_per_step * self.group_size

  @property
  def pass_rows(self) -> int:
    """Rows an update or scoring pass holds at a time: a micro-batch, or else a minibatch."""
    return self.batching.micro_batch_size or self.rollouts // self.batching.num_minibatches

  @property
  def needs_old_logprobs(self) -> bool:
    """Whether a step needs the trainer's log-probs before its update as a separate pass.
    With one minibatch the update starts from exactly those weights, so they are its own
    log-probs, detached (as TRL and verl do); a KL folded into the rewards needs them first, and
    so do exact async in-flight rows (their replay is a host loop: `replays_engine`). (Exact
    sync rollouts take the sampler's instead, `sampler_is_trainer`: `Scoring.old_pass`.)"""
    return self.batching.num_minibatches > 1 or self.kl.mode == "reward" or (
        self.replays_engine and self.schedule.mode == "async")

  @property
  def replays_engine(self) -> bool:
    """`rollout.exact="replay"` of rows drawn by the in-flight engine (its slots, or the turns
    of conversations), whose schedule the trainer runs again (train/loop/engine_replay.py)."""
    return self.rollout.exact == "replay" and bool(self.rollout.inflight_slots
                                                   or self.environment.name)

  @property
  def shares_prefix(self) -> bool:
    """`batching.share_prefix` is "on" ("auto" shares nothing until train/roles/layout.py)."""
    return self.batching.share_prefix == "on"

  @property
  def share_group(self) -> int:
    """Consecutive rows of a pass's piece that share their prompt where `shares_prefix`
    (`group_size` rows a prompt, group-major, in rollouts / pass_rows strided pieces:
    train/updates/prefix.py); 1: none shared."""
    g, n = self.group_size, self.rollouts // self.pass_rows
    return g // n if self.shares_prefix and g % n == 0 else 1

  @property
  def replay_pieces(self) -> int:
    """The pieces of rows `rollout.exact="replay"`'s decode loop runs in, on both sides: the
    minibatches (a forward alone, whose memory is its KV cache's; the update replays a minibatch
    before its micro-batches)."""
    return self.batching.num_minibatches

  @property
  def replay_group(self) -> int:
    """Consecutive rows of a replay piece that share a prompt (`group_size` a prompt, rows
    group-major, split over `replay_pieces` strided pieces): the decode loop prefills each
    prompt once, as the sampler's engine does."""
    g, n = self.group_size, self.replay_pieces
    return g // n if g % n == 0 else 1

  @property
  def sampler_is_trainer(self) -> bool:
    """Exact rollouts in sync mode: the sampler drew with the trainer's own numbers at the
    weights the trainer holds, so its log-probs are pi_old bit for bit; the old log-prob pass runs
    only to check that, before each evaluation (train/loop/scoring.py)."""
    return bool(self.rollout.exact) and self.schedule.mode == "sync"

  @property
  def carries_old_logprobs(self) -> bool:
    """Whether a step's Experience holds pi_old, so the update reads it: the old pass's
    (`needs_old_logprobs`), or the sampler's under `sampler_is_trainer` (on the steps that run
    no pass: the same numbers)."""
    return self.needs_old_logprobs or self.sampler_is_trainer

  @property
  def trains_critic(self) -> bool:
    """Whether the advantage estimator needs a critic (trained beside the actor)."""
    return self.advantage.entry.critic
