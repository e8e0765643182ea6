"""A process of the sampler's own (placement `separate` on whole hosts): it serves the async
generator the trainer's processes start (train/rollout/remote.py) instead of running the
experiment."""
from __future__ import annotations

from jaxrl.config_files import resolve
from train.rollout.remote import SamplerHost
from train.rollout.source import make_worker
from train.stages.context import RunContext


def serve(config) -> int:
  """Builds what the generator needs (tokenizer, prompts, environments, the sampler's programs;
  the models stay abstract) and serves the trainer until it is done; the exit code."""
  cfg = resolve(config)
  with RunContext(cfg, "", initialize=False) as ctx:
    return SamplerHost(ctx, make_worker).serve()
