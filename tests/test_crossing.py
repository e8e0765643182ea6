"""The pieces of the several-process mode that run in one process: a group's shared
environment (its first process steps it, the others take its steps) and the crossings' meshes
and descriptions (sharding/crossing.py); the runs on several processes are
tests/test_processes.py's."""
import json

import pytest


class _Store:
  """The coordination service's key-value store, as two processes' mailboxes see it."""

  def __init__(self):
    self.values = {}

  def post(self, n, message):
    assert n not in self.values
    self.values[n] = json.loads(json.dumps(message))  # (JSON, as the store holds it)

  def take(self, n):
    return self.values[n]


def test_a_shared_environment_is_stepped_by_the_first_process_only():
  from jaxrl.data.tasks import Example
  from jaxrl.data.tokenizer import ByteTokenizer
  from jaxrl.envs.synthetic import ShortReplies
  from train.rollout.shared_env import SharedEnvironment

  class Counted(ShortReplies):
    steps = 0

    def step(self, turn_ids):
      Counted.steps += 1
      return super().step(turn_ids)

  store, tok = _Store(), ByteTokenizer()
  leader = SharedEnvironment(Counted(tok, None), store, "0", leader=True)
  follower = SharedEnvironment(Counted(tok, None), store, "0", leader=False)
  example = Example(prompt="1+1", answer="2")
  assert leader.reset(example) == follower.reset(example) == []
  for ids in ([5, 6], [7], [8, 9, 10]):
    assert leader.step(ids) == follower.step(ids)
  assert Counted.steps == 3  # the follower took the leader's steps


def test_a_mirror_has_the_other_sides_shard_shapes_and_descriptions_round_trip():
  """`mirror` lays the sampler's mesh shape over the trainer's devices (what a cross-process
  `device_put` needs); `describe` / `abstract` carry a batch's arrays across as JSON."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec
  from sharding import crossing
  from sharding.mesh import make_mesh
  from sharding.placement import make_placement
  devices = jax.devices()
  sampler = make_mesh({"data": 2, "tensor": 2}, devices[4:8])
  mirrored = crossing.mirror(sampler, devices[:4])
  assert dict(mirrored.shape) == dict(sampler.shape)
  assert {d.id for d in mirrored.devices.flat} == {d.id for d in devices[:4]}
  x = jax.device_put(jnp.zeros((8, 3)), NamedSharding(sampler, PartitionSpec("data")))
  described = crossing.describe({"rollout": {"tokens": x}})
  assert json.loads(json.dumps(described)) == {"rollout/tokens": [[8, 3], "float32", ["data"]]}
  like = crossing.abstract(described, mirrored)["rollout"]["tokens"]
  assert like.shape == (8, 3) and like.sharding.mesh is mirrored
  assert like.sharding.shard_shape(like.shape) == x.sharding.shard_shape(x.shape)
  with pytest.raises(ValueError, match="needs 4 devices on each side"):
    crossing.mirror(sampler, devices[:2])
  placement = make_placement("separate", 8, train_devices=4, sampler_tensor=2)
  assert crossing.process_split(placement, devices) is None  # one process
