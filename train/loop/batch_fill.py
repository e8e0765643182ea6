"""DAPO's dynamic sampling: a step's batch made of the prompt groups whose rewards differ, with
more prompt batches generated while too few do."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxrl.algos.advantages import informative_groups
from jaxrl.config_rl import RLConfig
from train.io.host_transfers import HostTransfers
from train.loop.experience import combine_rollouts
from train.rollout.batches import RolloutBatch
from train.task.reward import Judge


@dataclasses.dataclass
class FilledBatch:
  rollout: object
  prompts: dict
  verified_B: np.ndarray | None  # None: not verified yet (scoring verifies it)
  version: int  # the oldest policy version of its tokens
  versions_BN: np.ndarray  # each completion slot's policy version
  waited: float  # seconds spent waiting for the extra rounds' batches
  metrics: dict


def fill_batch(batch: RolloutBatch, *, cfg: RLConfig, judge: Judge,
               next_batch: Callable[[], tuple[RolloutBatch, float]],
               transfers: HostTransfers) -> FilledBatch:
  """While fewer than `prompts_per_step` groups have rewards that differ, the next prompt batch
  (`next_batch()`) is generated too (at most `dynamic_sampling_rounds` more); the step's batch
  is the informative groups in order, filled up with the others when the rounds run out (the
  kept rows' indices go up as `transfers`' "kept rows")."""
  g, want, parts, rounds, waited = cfg.group_size, cfg.prompts_per_step, [], 0, 0.0
  n = cfg.rollout.max_new_tokens
  while True:
    examples_B = np.repeat(batch.prompts["examples"], g)
    verified_B = judge.rewards(batch.rollout, examples_B)
    parts.append((batch, verified_B, informative_groups(verified_B, g)))
    kept = sum(int(p[2].sum()) for p in parts)
    if kept >= want or rounds == cfg.dapo.dynamic_sampling_rounds:
      break
    rounds += 1
    batch, w = next_batch()
    waited += w
  metrics = {"dynamic_rounds": rounds, "informative_frac": min(kept, want) / want}
  version = min(p[0].version for p in parts)
  if len(parts) == 1:
    return FilledBatch(batch.rollout, batch.prompts, verified_B, version,
                       batch.token_versions(n), waited, metrics)
  order = [(i, j) for keep in (True, False) for i, p in enumerate(parts)
           for j in np.flatnonzero(p[2] == keep)][:want]
  first = np.cumsum([0] + [len(p[0].prompts["examples"]) for p in parts])
  rows = np.concatenate([(first[i] + j) * g + np.arange(g) for i, j in order])
  # The row indices go up; the rollouts stay where they are.
  with transfers.allowed("kept rows", rows):
    rollout = combine_rollouts(tuple(p[0].rollout for p in parts), rows,
                               parts[0][0].rollout.lengths_B.sharding)
  examples = np.array([parts[i][0].prompts["examples"][j] for i, j in order], dtype=object)
  verified_B = np.concatenate([parts[i][1][j * g:(j + 1) * g] for i, j in order])
  versions_BN = np.concatenate([p[0].token_versions(n) for p in parts])[rows]
  return FilledBatch(rollout, {"examples": examples}, verified_B, version, versions_BN, waited,
                     metrics)
