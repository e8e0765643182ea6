"""The config's checks: `ConfigError` (a user's mistake: one line, exit code 2) and the field
checks every config section's `__post_init__` runs, each a ValueError naming the field."""
from __future__ import annotations

import difflib


class ConfigError(ValueError):
  """A user error in the config: reported in one line, exit code 2."""


def first_line(error: BaseException) -> str:
  """An exception's first line (its type when it has no message): for one-line reports."""
  return (str(error).strip().splitlines() or [type(error).__name__])[0]


def unknown_field(where: str, name: str, fields) -> str:
  """`where: unknown field` with the section's nearest field names (all of them when it has
  at most 8, else how many it has)."""
  fields = sorted(fields)
  near = difflib.get_close_matches(name, fields, n=3, cutoff=0.6)
  if near:
    return f"{where}: unknown field; did you mean {' or '.join(map(repr, near))}?"
  if len(fields) <= 8:
    return f"{where}: unknown field; expected one of {fields}"
  return (f"{where}: unknown field, and none of the section's {len(fields)} fields is near it "
          f"(the schema: jaxrl/config.py, the model's jaxrl/models/config.py)")


def choice(obj, name: str, options) -> None:
  if getattr(obj, name) not in options:
    raise ValueError(f"{name}: expected one of {sorted(options)}, got {getattr(obj, name)!r}")


def check(obj, names, ok, expected: str) -> None:
  for name in names:
    if not ok(getattr(obj, name)):
      raise ValueError(f"{name}: expected {expected}, got {getattr(obj, name)!r}")


positive = lambda obj, *names: check(obj, names, lambda v: v > 0, "> 0")  # noqa: E731
at_least_zero = lambda obj, *names: check(obj, names, lambda v: v >= 0, ">= 0")  # noqa: E731
unit = lambda obj, *names: check(obj, names, lambda v: 0 <= v <= 1, "in [0, 1]")  # noqa: E731


def sections_agree(cfg) -> None:
  """The checks across an ExperimentConfig's sections (placement and RL mode, reward and
  reward model, LoRA and the model's MLP)."""
  if cfg.rl.schedule.mode == "async" and cfg.placement.strategy not in ("separate", "plan"):
    raise ValueError(
        f"rl.schedule.mode: async needs the sampler on devices of its own "
        f"(placement.strategy='separate'); with {cfg.placement.strategy!r} generation and "
        f"training share devices and cannot overlap, use mode='sync'")
  if cfg.placement.offload and cfg.rl.schedule.mode == "async":
    raise ValueError("placement.offload: offloads between the phases of a sync step; with "
                     "rl.schedule.mode='async' generation and training overlap, set offload=''")
  if cfg.rl.reward == "reward_model" and cfg.reward_model.steps <= 0:
    raise ValueError("reward_model.steps: rl.reward='reward_model' needs a trained reward "
                     f"model, expected > 0, got {cfg.reward_model.steps}")
  if mlp := cfg.model.moe.experts and cfg.lora.enabled and sorted(
      {"w_gate", "w_up", "w_down"} & set(cfg.lora.target_names)):
    raise ValueError(f"lora.targets: {','.join(mlp)} adapt a dense MLP; a mixture of experts' "
                     "experts take no adapters (target wq,wk,wv,wo)")
  if cfg.model.moe.routing_replay != "off" and cfg.rl.environment.name:
    raise ValueError(
        "model.moe.routing_replay: multi-turn rollouts (rl.environment.name) do not record "
        "their experts yet, expected 'off' with them")
  if cfg.rl.rollout.exact == "replay" and cfg.rl.schedule.mode == "async" and cfg.lora.enabled:
    raise ValueError("lora.rank: rl.rollout.exact='replay' in async mode draws from the "
                     "sampler's merged copy, which rounds apart from the adapters; expected 0")


def check_exact(rl) -> None:
  """`rl.rollout.exact` (an `RLConfig`) draws rows the trainer scores at the sampling
  temperature ("pass" by its pass, in turn, single-turn; "replay" in in-flight slots or turns:
  whole batches replayed): the settings it cannot honour, named (a ValueError)."""
  if not rl.rollout.exact:
    return
  wanted = [("rollout.top_k", rl.rollout.top_k, 0, "0 (the trainer scores every token)"),
            ("dapo.dynamic_sampling", rl.dapo.dynamic_sampling, False,
             "False (its rounds' rows are padded to the widest prompt: other shapes)")]
  if rl.rollout.exact == "pass":  # (the trainer's pass: on its devices, unpacked)
    wanted += [("schedule.mode", rl.schedule.mode, "sync", "'sync'"),
               ("batching.pack_length", rl.batching.pack_length, 0, "0 (whole rows)"),
               ("batching.share_prefix", rl.batching.share_prefix, "off", "'off'"),
               ("rollout.inflight_slots", rl.rollout.inflight_slots, 0, "0"),
               ("environment.name", rl.environment.name, "", "'' (single-turn)")]
  elif rl.replays_engine:  # (the engine's schedule replayed on the actor's mesh)
    wanted += [("batching.num_minibatches", rl.batching.num_minibatches, 1,
                "1 (the engine's schedule replays whole batches)"),
               ("schedule.partial_rollouts", rl.schedule.partial_rollouts, False, "False")]
  if rl.rollout.exact == "replay" and rl.environment.name:  # (turns in a requests engine)
    wanted += [("environment.keep_turn_cache", rl.environment.keep_turn_cache or
                bool(rl.rollout.inflight_slots), True, "True (or rollout.inflight_slots > 0)")]
  for field, value, ok, want in wanted:
    if value != ok:
      raise ValueError(f"{field}: not with rollout.exact={rl.rollout.exact!r}; expected "
                       f"{want}, got {value!r}")
