"""The generator: the RL's samplers on the sampler mesh, and the prompts' way onto it.

`sample` draws `group_size` completions per prompt at the RL temperature, `greedy` decodes for
evaluation and `draw` samples for pass@k; each is the RL's `Sampler` (sampler/sampler.py) or one of
its variants, compiled once for the sampler layout's shardings, and its rollouts stay on the
sampler's devices. With `rl.rollout.inflight_slots > 0` they decode through in-flight batching (row
slots refilled as rows finish), which returns the same rollouts; with `rl.environment.name` every
rollout is a multi-turn conversation (train/rollout/multiturn.py). Prompt batch i of a run is drawn
with `rollout_key(seed, i)`, in turn or ahead of the trainer (train/rollout/source.py).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config import ConfigError
from jaxrl.config_rl import RLConfig, RolloutConfig
from jaxrl.envs import EnvError, Environment
from sampler import lowering
from sampler.engine import Rollout
from sampler.forced import forced_program
from sampler.methods import SamplingConfig
from sampler.sampler import Sampler
from sampler.stops import StopText
from sampler.stream import BatchStream, StreamGeometry
from sharding.mesh import batch_sharding
from sharding.reshard import move
from sharding.rules import SAMPLER_RULES, batch_ways, jit_on
from train.io.host_transfers import HostTransfers
from train.roles.cluster import RoleCluster
from train.rollout.conversations import ConversationStream
from train.rollout.multiturn import MultiTurn, Turns, as_rollout, turn_lowerings
from train.rollout.scripted import ScriptedEnv, scripts
from train.updates.replay import replay_generate


def rollout_key(seed: int, index: int) -> jax.Array:
  """The random key of prompt batch `index`: the same whether the batch is generated in turn,
  ahead of the trainer, or again after a resume. (Two integers go to the device: allowed even
  where a test guards against host transfers.)"""
  with jax.transfer_guard_host_to_device("allow"):
    return jax.random.fold_in(jax.random.key(seed), index)


def rl_sampling(rollout: RolloutConfig, max_new_tokens: int, eos_id: int, pad_id: int,
                stops: tuple[tuple[int, ...], ...]) -> SamplingConfig:
  """How RL rollouts are sampled (`rl.rollout`): at its temperature and top k, ending at EOS
  or a stop sequence (`stops`), unless `ignore_eos` runs every row to its budget."""
  return SamplingConfig(max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                        stop_sequences=() if rollout.ignore_eos else stops, method="temperature",
                        temperature=rollout.temperature, top_k=rollout.top_k,
                        ignore_eos=rollout.ignore_eos)


def check_slots(rl: RLConfig, sliding_window: int) -> None:
  """In-flight slots are rings of keys, which a sliding window does not fit: a ConfigError."""
  if rl.rollout.inflight_slots and sliding_window:
    raise ConfigError(
        f"config.rl.rollout.inflight_slots: in-flight batching does not apply a sliding "
        f"window (model.attention.sliding_window={sliding_window}); set 0")


def keeps_turn_cache(rl: RLConfig, sliding_window: int) -> bool:
  """Whether turns continue in the slots that kept their conversations' caches (a ring, which a
  sliding window does not fit)."""
  return rl.environment.keep_turn_cache and not sliding_window


def _replay_program(cluster: RoleCluster, sampling: SamplingConfig, rl: RLConfig):
  """`rl.rollout.exact="replay"` on the sampler's own devices (async): `replay_generate` on the
  sampler's mesh, from its copy of the weights, in the trainer's pieces of rows (a minibatch:
  `RLConfig.replay_pieces`), each device holding as many rows as a trainer's device does (so
  every product has the trainer's shapes); None where the engine draws (`replays_engine`: the
  run's sampler then runs the programs that also replay, `Sampler(forced=True)`).
  A ConfigError where the two meshes split the batch apart."""
  train = batch_ways(cluster.meshes["actor"], cluster.actor.rules)
  mesh = cluster.meshes["sampler"]
  if batch_ways(mesh, SAMPLER_RULES) != train or mesh.size != train:
    raise ConfigError(
        f"config.placement.sampler_tensor: rl.rollout.exact='replay' in async mode draws on "
        f"the sampler's devices with the trainer's rows a device; expected a sampler mesh of "
        f"{train} devices, split {train} ways by rows (sampler_tensor=1), got "
        f"{dict(mesh.shape)}")
  if rl.replays_engine:
    return None
  weights = cluster.sampler_weights
  return jit_on(mesh, SAMPLER_RULES, functools.partial(
      replay_generate, weights.graphdef, cfg=sampling, pieces=rl.replay_pieces,
      group=rl.replay_group))


class Generator:

  def __init__(self, cluster: RoleCluster, *, max_new_tokens: int, tok, rl: RLConfig,
               environment: Callable[[], Environment] | None = None,
               transfers: HostTransfers | None = None):
    """`tok`: the run's tokenizer (its EOS, PAD and further stop tokens such as `<|eot_id|>`).
    `environment`: a new environment per row makes every rollout a multi-turn conversation
    (train/rollout/multiturn.py) of up to `rl.environment.max_turns` turns, driven by `multiturn`,
    which `close` stops. `transfers`: the run's named host transfers (prompts up, ...)."""
    self.transfers = HostTransfers() if transfers is None else transfers
    stops = tuple((i,) for i in tok.stop_ids if i != tok.eos_id)
    sampling = rl_sampling(rl.rollout, max_new_tokens, tok.eos_id, tok.pad_id, stops)
    weights, mesh = cluster.sampler_weights, cluster.meshes["sampler"]
    check_slots(rl, cluster.cfg.model.attention.sliding_window)
    try:
      self.sampler = Sampler(weights.graphdef, sampling, n=rl.group_size, mesh=mesh,
                             param_shardings=weights.shardings,
                             inflight_slots=rl.rollout.inflight_slots,
                             forced=rl.replays_engine and rl.schedule.mode == "async")
    except ValueError as e:
      raise ConfigError(f"config.rl.rollout.inflight_slots: {e}") from None
    self.greedy_sampler = self.sampler.variant(n=1, method="greedy", stop_sequences=stops,
                                               ignore_eos=False)
    self._rows = batch_sharding(mesh, SAMPLER_RULES)
    self.environment, self.pad_id = environment, tok.pad_id
    keep = keeps_turn_cache(rl, cluster.cfg.model.attention.sliding_window)
    self.turns = dict(max_turns=rl.environment.max_turns,
                      max_turn_tokens=rl.environment.max_turn_tokens, keep_cache=keep)
    # A turn also ends at the environment's stop strings, matched on its decoded text
    strings = () if environment is None else tuple(environment().stop_strings)
    self._turn_text = StopText(strings, tok.token_bytes()) if strings else None
    self.multiturn = None if environment is None else MultiTurn(self.transfers)
    self._forced = None  # (`forced_logprobs`' program, compiled on first use)
    self._replay = (_replay_program(cluster, sampling, rl) if rl.rollout.exact == "replay"
                    and rl.schedule.mode == "async" else None)

  def close(self) -> None:
    """Stops the threads its conversations' environments step in."""
    if self.multiturn is not None:
      self.multiturn.close()

  def put_prompts(self, prompts: dict):
    """A host prompt batch -> (tokens_BP, valid_BP) split over the sampler's data axes."""
    return self.transfers.to_device((prompts["prompt_tokens"], prompts["prompt_valid"]),
                                    (self._rows, self._rows), "prompts")

  def sample(self, params, prompts: dict, key: jax.Array) -> Rollout:
    """`group_size` samples per prompt (rows group-major), from `params` in the sampler
    layout; prompt batch i of a run uses `rollout_key(seed, i)`. Async under
    `rl.rollout.exact="replay"`: drawn in the decode loop the trainer replays."""
    if self._replay is not None:
      group = lambda x: np.repeat(x, self.sampler.n, axis=0)  # noqa: E731
      return self._replay(params, *self.put_prompts(
          {k: group(prompts[k]) for k in ("prompt_tokens", "prompt_valid")}), key)
    return self._generate(self.sampler, params, prompts, key)

  def greedy(self, params, prompts: dict) -> Rollout:
    return self._generate(self.greedy_sampler, params, prompts, rollout_key(0, 0))

  def draw(self, params, prompts: dict, key: jax.Array, *, n: int,
           temperature: float) -> Rollout:
    """`n` samples per prompt at `temperature` (evaluation's sampled mode, train/task/heldout.py):
    the RL sampler's settings otherwise."""
    return self._generate(self.sampler.variant(n=n, temperature=temperature), params, prompts,
                          key)

  def forced_logprobs(self, params, tokens_BT, valid_BT, steps_BK, *, prompt_len: int):
    """The sampler's full log-probs [B, K, V] along rows it drew (any mesh's arrays: moved to
    the sampler's rows), at completion steps `steps_BK` (sampler/forced.py), at the RL
    temperature."""
    if self._forced is None:
      s = self.sampler
      self._forced = forced_program(s.graphdef, s.cfg, s.mesh, s.param_shardings)
    cut = lambda x, start, stop: jax.lax.slice_in_dim(x, start, stop, axis=1)  # (static)
    t = tokens_BT.shape[1]
    inputs = move((cut(tokens_BT, 0, prompt_len), cut(valid_BT, 0, prompt_len),
                   cut(tokens_BT, prompt_len, t), steps_BK), (self._rows,) * 4)
    return self._forced(params, *inputs)

  def _generate(self, sampler: Sampler, params, prompts: dict, key: jax.Array) -> Rollout:
    if self.environment is not None:
      return self.converse(sampler, params, prompts, key)
    return sampler.generate(params, *self.put_prompts(prompts), key)

  def converse(self, sampler: Sampler, params, prompts: dict, key: jax.Array) -> Rollout:
    """Each row's conversation with its own environment, as a rollout on the sampler's
    devices (the host had every id anyway: it ran the environments). A turn is `sampler` with
    one sample per row, ending also at the environment's stop strings."""
    tokens_BP, valid_BP = prompts["prompt_tokens"], prompts["prompt_valid"]
    rows = np.repeat(np.arange(len(tokens_BP)), sampler.n)
    try:
      talks = self.multiturn.converse(self._turn_sampler(sampler), params,
                                      [tokens_BP[i][valid_BP[i]].tolist() for i in rows],
                                      [prompts["examples"][i] for i in rows],
                                      [self.environment() for _ in rows], key,
                                      max_new_tokens=sampler.cfg.max_new_tokens, **self.turns)
    except EnvError as e:  # a user's environment misbehaved (rl.user_code.on_error="stop")
      raise ConfigError(f"config.rl.environment.name: {e}") from None
    return self._conversations_rollout(talks, prompts)

  def replayed_conversations(self, sampler: Sampler, params, tokens_BT, valid_BT, mask_BN,
                             policy_BN) -> np.ndarray:
    """The model's log-probs [B, N] (0 at the environments' tokens) along conversations drawn
    by `converse` with `sampler` (forced: `Sampler(forced=True)`), each turn emitted again in
    the slots and each reply the recorded one (train/rollout/scripted.py); host arrays in."""
    p, rows = tokens_BT.shape[1] - mask_BN.shape[1], len(tokens_BT)
    recorded = scripts(tokens_BT[:, p:], mask_BN, policy_BN)
    prompts = [ids[ok].tolist() for ids, ok in zip(tokens_BT[:, :p], valid_BT[:, :p])]
    talks = self.multiturn.converse(
        self._turn_sampler(sampler), params, prompts, [None] * rows,
        [ScriptedEnv(r) for r in recorded], jax.random.key(0),
        max_new_tokens=sampler.cfg.max_new_tokens, forced_B=[r.turns for r in recorded],
        **self.turns)
    return as_rollout(talks, tokens_BT[:, :p], valid_BT[:, :p], budget=mask_BN.shape[1],
                      pad_id=self.pad_id).logprobs_BN

  def _turn_sampler(self, sampler: Sampler) -> Sampler:
    return sampler.variant(n=1, stop_text=self._turn_text)

  def _conversations_rollout(self, talks, prompts: dict) -> Rollout:
    """Conversations (rows group-major) after their prompts, on the sampler's devices."""
    tokens_BP, valid_BP = prompts["prompt_tokens"], prompts["prompt_valid"]
    rows = np.arange(len(talks)) // (len(talks) // len(tokens_BP))
    host = as_rollout(talks, tokens_BP[rows], valid_BP[rows],
                      budget=self.sampler.cfg.max_new_tokens, pad_id=self.pad_id)
    mesh = self.sampler.mesh
    return self.transfers.to_device(
        host, jax.tree.map(lambda x: batch_sharding(mesh, SAMPLER_RULES, x.ndim), host),
        "conversations")

  def lowerings(self, params, prompts: int, prompt_width: int,
                geometry: StreamGeometry | None = None) -> lowering.Lowerings:
    """The programs a step's rollouts run, as `sample` (or, with the partial rollouts'
    `geometry`, `stream`) runs them, lowered from abstract arguments without running them:
    `params` the sampler's weights as ShapeDtypeStructs carrying shardings, `prompts` prompt
    rows of `prompt_width` tokens (what a target compile compiles: train/preflight/)."""
    tokens_BP = jax.ShapeDtypeStruct((prompts, prompt_width), jnp.int32, sharding=self._rows)
    if self.environment is not None:
      turn = self._turn_sampler(self.sampler)
      if geometry is not None:  # ConversationStream's engine: its turns in the stream's slots
        return lowering.requests(turn.spec, params, geometry.prompt_width)
      return turn_lowerings(turn, params, rows=prompts * self.sampler.n,
                            prompt_width=prompt_width, keep_cache=self.turns["keep_cache"])
    if geometry is not None:
      return lowering.stream(self.sampler.spec, params, geometry, self._rows)
    if self.sampler.inflight_slots:
      return lowering.rows(self.sampler.spec, params, tokens_BP)
    valid_BP = jax.ShapeDtypeStruct(tokens_BP.shape, bool, sharding=self._rows)
    key = jax.eval_shape(lambda: jax.random.key(0))
    return [("generate (prefill + decode loop)",
             lambda: self.sampler.lower(params, tokens_BP, valid_BP, key))]

  def stream(self, params, geometry: StreamGeometry) -> BatchStream:
    """Partial rollouts: the RL sampler's in-flight slots running a stream of prompt batches
    laid out as `geometry` says (sampler/stream.py), or of batches of conversations with
    `rl.environment.name` (train/rollout/conversations.py)."""
    if self.environment is None:
      return self.sampler.stream(params, geometry)
    turns = dict(self.turns)
    return ConversationStream(
        self._turn_sampler(self.sampler), params, geometry, n=self.sampler.n,
        environment=self.environment, keep_cache=turns.pop("keep_cache"),
        turns=Turns(self.sampler.cfg.max_new_tokens, **turns), finish=self._conversations_rollout,
        multiturn=self.multiturn)
