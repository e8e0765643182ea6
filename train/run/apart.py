"""A process the placement gives to a group apart (`separate` on whole hosts): the sampler's,
which serves the async generator the trainer's processes start (train/rollout/remote.py), or the
scorers' (`placement.scorers_apart`, train/loop/remote_scorers.py), instead of running
the experiment."""
from __future__ import annotations

import contextlib
import logging
import signal

from sharding.distributed import post_stop
from train.loop.remote_scorers import ScorersHost
from train.roles.layout import Layout
from train.rollout.remote import SamplerHost
from train.rollout.source import make_worker
from train.stages.context import RunContext


def serve(layout: Layout) -> int:
  """Builds what this process's group needs (tokenizer, prompts, environments, the sampler's or
  the scorers' programs; the models abstract) on the run's `layout` and serves the trainer until
  it is done; the exit code."""
  with RunContext(layout.cfg, "", initialize=False, layout=layout) as ctx, _stops_passed_on():
    if layout.split.here == "scorers":
      return ScorersHost(ctx).serve()
    return SamplerHost(ctx, make_worker).serve()


@contextlib.contextmanager
def _stops_passed_on():
  """SIGTERM / SIGINT here (a preemption reaches every host) become the job's stop request: the
  trainer stops after its step, saves a checkpoint (the generator's state brought over), and
  releases these processes, which then exit 0."""
  def handle(signum, frame):
    name = signal.Signals(signum).name
    logging.getLogger("jaxrl").warning("%s: the trainer stops after its current step and saves "
                                       "a checkpoint; this process leaves when it is done", name)
    post_stop(name)
  old = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
  try:
    yield
  finally:
    for sig, handler in old.items():
      signal.signal(sig, handler)
