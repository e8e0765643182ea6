import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.dtypes import compute_dtypes
from jaxrl.models.transformer import LanguageModel
from jaxrl.models.rope import positions_from_valid
from jaxrl.partitioning import activation_rules
from sharding.mesh import param_shardings
from sharding.placement import PlacementError, make_placement
from sharding.reshard import plan_buckets, reshard
from sharding.rules import SAMPLER_RULES, TRAIN_RULES

from sharded_init import init_sharded

CFG = ModelConfig(vocab_size=264, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  d_ff=128)


@pytest.mark.parametrize("strategy", ["colocate", "interleave", "separate"])
def test_presets_and_sharded_logprobs_equal_single_device(strategy):
  placement = make_placement(strategy, 8, train_devices=4, sampler_tensor=2)
  actor, sampler = placement.roles["actor"], placement.roles["sampler"]
  assert placement.roles["actor"] == placement.roles["critic"]
  if strategy == "separate":
    assert not set(actor.devices) & set(sampler.devices)
  if strategy == "interleave":
    assert placement.roles["reference"] != placement.roles["reward"]
  model = LanguageModel(CFG, rngs=nnx.Rngs(0))
  tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 10)), jnp.int32)
  valid_BT = jnp.ones((8, 10), bool)
  want = jax.nn.log_softmax(model(tokens_BT, positions_from_valid(valid_BT), valid_BT)[0])
  for role, rules in [("actor", TRAIN_RULES), ("reference", TRAIN_RULES),
                      ("sampler", SAMPLER_RULES)]:
    mesh = placement.mesh(role)
    graphdef, state, _ = init_sharded(lambda: LanguageModel(CFG, rngs=nnx.Rngs(0)), rules, mesh)

    @jax.jit
    def logp(state, tokens_BT, valid_BT):
      with activation_rules(mesh, rules):
        logits = nnx.merge(graphdef, state)(tokens_BT, positions_from_valid(valid_BT), valid_BT)[0]
        return jax.nn.log_softmax(logits)

    np.testing.assert_allclose(logp(state, tokens_BT, valid_BT), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs,message", [
    (dict(strategy="separate", train_devices=8),
     "placement.train_devices: 8 does not split the 8 devices"),
    (dict(strategy="separate", train_devices=5, sampler_tensor=2),
     "placement.sampler_tensor: the sampler's mesh axis tensor=2 does not divide its 3 devices"),
    (dict(strategy="interleave", train_devices=7), "interleave needs >= 2 devices"),
    (dict(strategy="pipeline", train_devices=4), "placement.strategy: expected one of"),
    (dict(strategy="colocate", train_devices=8, train_fsdp=3),
     "placement.train_fsdp: 3 does not divide the trainer's 8 devices"),
])
def test_bad_placements_fail_with_one_line(kwargs, message):
  with pytest.raises(PlacementError) as e:
    make_placement(n_devices=8, **kwargs)
  assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs,mesh", [
    (dict(), {"data": 2, "fsdp": 2}),  # GPU hosts: fsdp inside a host, data-parallel across
    (dict(train_fsdp=1), {"data": 4, "fsdp": 1}),
])
def test_the_trainer_mesh_over_two_hosts(kwargs, mesh):
  placement = make_placement("interleave", 8, train_devices=4, n_hosts=2, **kwargs)
  assert placement.roles["actor"].devices == (0, 1, 4, 5)  # each host's first two
  assert {k: v for k, v in placement.roles["actor"].shape.items() if k != "tensor"} == mesh
  # a TPU slice: fsdp over its ICI, on hosts of the trainer's own (part of each is refused)
  tpu = make_placement("separate", 8, train_devices=4, n_hosts=2, one_network=True)
  assert tpu.roles["actor"].devices == (0, 1, 2, 3) and tpu.roles["actor"].shape["fsdp"] == 4
  with pytest.raises(PlacementError, match="interleave on 2 hosts of a TPU slice"):
    make_placement("interleave", 8, train_devices=4, n_hosts=2, one_network=True)


def test_separate_on_whole_hosts_gives_each_group_hosts_of_its_own():
  """`train_devices` filling whole hosts: the trainer on the first ones, the sampler on the rest
  (each group on processes of its own); otherwise each host is split."""
  placement = make_placement("separate", 16, train_devices=8, n_hosts=4)
  assert placement.roles["actor"].devices == tuple(range(8))  # hosts 0 and 1
  assert placement.roles["sampler"].devices == tuple(range(8, 16))
  assert placement.roles["actor"].shape["fsdp"] == 4  # inside a host; data-parallel over two
  assert placement.groups() == {"trainer": tuple(range(8)), "sampler": tuple(range(8, 16))}
  split = make_placement("separate", 16, train_devices=4, n_hosts=2)
  assert split.roles["actor"].devices == (0, 1, 8, 9)  # each host's first two
  assert split.groups() == {"trainer": tuple(range(16))}  # every process runs every program


def test_generator_replicas_take_whole_hosts_of_the_samplers():
  """`placement.sampler_replicas`: each generator on whole hosts of the sampler's, one mesh
  shape; refused in one line where the hosts do not split, where the sampler shares hosts, and
  where the trainer's mirror of one generator would not reach each trainer host."""
  placement = make_placement("separate", 12, train_devices=4, n_hosts=6, replicas=2)
  assert placement.replicas == ((4, 5, 6, 7), (8, 9, 10, 11))
  assert placement.roles["sampler"].devices == (4, 5, 6, 7)
  assert placement.groups() == {"trainer": (0, 1, 2, 3), "sampler": (4, 5, 6, 7),
                                "sampler1": (8, 9, 10, 11)}
  with pytest.raises(PlacementError, match="do not split the sampler's 4 hosts"):
    make_placement("separate", 12, train_devices=4, n_hosts=6, replicas=3)
  with pytest.raises(PlacementError, match="need the sampler on hosts of its own"):
    make_placement("separate", 8, train_devices=4, n_hosts=1, replicas=2)
  with pytest.raises(PlacementError, match="must reach each of its hosts"):
    make_placement("separate", 4, train_devices=2, n_hosts=4, replicas=2)


def test_the_scorers_apart_takes_the_trainers_count_of_devices_after_them():
  """`placement.scorers_apart`: the reference, the reward model and the critic on the
  `train_devices` after the trainer's, in the trainer's mesh shape (whole hosts on several; on
  one host devices of their own), the sampler on the rest; refused in one line where they
  cannot stand apart."""
  placement = make_placement("separate", 6, train_devices=2, n_hosts=3, scorers_apart=True)
  assert placement.roles["reference"].devices == placement.roles["reward"].devices == (2, 3)
  assert placement.roles["reference"].mesh == placement.roles["actor"].mesh
  assert placement.roles["sampler"].devices == (4, 5)
  assert placement.roles["critic"] == placement.roles["reference"]  # (it trains there)
  assert placement.roles["actor"].devices == (0, 1)
  assert placement.groups() == {"trainer": (0, 1), "scorers": (2, 3), "sampler": (4, 5)}
  one = make_placement("separate", 6, train_devices=2, scorers_apart=True)
  assert one.roles["reference"].devices == (2, 3) and one.roles["sampler"].devices == (4, 5)
  assert list(one.groups()) == ["trainer"]  # (one host: devices of their own, one process)
  for kwargs in (dict(strategy="colocate", n_hosts=4), dict(strategy="separate", n_hosts=2),
                 dict(strategy="separate", n_hosts=4, train_devices=4),
                 dict(strategy="interleave", n_hosts=4, train_devices=2)):
    with pytest.raises(PlacementError, match="placement.scorers_apart: the reference, the "
                                             "reward model and the critic stand on devices"):
      make_placement(n_devices=8, **{"train_devices": 2, **kwargs}, scorers_apart=True)


@pytest.mark.parametrize("n_hosts", [1, 2, 4])
def test_interleave_with_the_scorers_apart_gives_each_group_half(n_hosts):
  """`interleave` with `scorers_apart`: the trainer and the sampler on the first half of the
  devices (whole hosts on several, as a TPU slice needs), the reference, the reward model and
  the critic on the other half in the trainer's mesh shape; without it a TPU slice's hosts would be
  split, refused in one line that names this placement."""
  placement = make_placement("interleave", 8, train_devices=4, n_hosts=n_hosts,
                             one_network=True, scorers_apart=True)
  assert placement.roles["actor"].devices == placement.roles["sampler"].devices == (0, 1, 2, 3)
  assert placement.roles["reference"].devices == placement.roles["reward"].devices == (4, 5, 6, 7)
  assert placement.roles["critic"] == placement.roles["reference"]
  assert placement.roles["reference"].mesh == placement.roles["actor"].mesh
  assert placement.groups() == ({"trainer": (0, 1, 2, 3), "scorers": (4, 5, 6, 7)}
                                if n_hosts > 1 else {"trainer": tuple(range(8))})
  if n_hosts > 1:
    with pytest.raises(PlacementError, match="'interleave' with placement.scorers_apart=True "
                                             "and train_devices=4"):
      make_placement("interleave", 8, train_devices=4, n_hosts=n_hosts, one_network=True)


def test_plan_buckets():
  assert plan_buckets([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
  assert plan_buckets([], 8) == []


def test_reshard_moves_values_into_the_target_layout_across_devices():
  placement = make_placement("separate", 8, train_devices=4, sampler_tensor=2)
  train_mesh, sampler_mesh = placement.mesh("actor"), placement.mesh("sampler")
  _, state, _ = init_sharded(lambda: LanguageModel(CFG, rngs=nnx.Rngs(0)), TRAIN_RULES, train_mesh)
  target = param_shardings(state, SAMPLER_RULES, sampler_mesh)
  host = jax.tree.map(np.asarray, state)
  moved, stats = reshard(state, target, bucket_bytes=64 << 10)
  flat_moved, flat_target = jax.tree.leaves(moved), jax.tree.leaves(target)
  for x, want, sharding in zip(flat_moved, jax.tree.leaves(host), flat_target):
    assert x.sharding == sharding
    np.testing.assert_array_equal(np.asarray(x), want)
  assert stats.bytes == sum(x.nbytes for x in jax.tree.leaves(host)) and stats.buckets > 1
  back, _ = reshard(moved, jax.tree.map(lambda x: x.sharding, state))
  for x, want in zip(jax.tree.leaves(back), jax.tree.leaves(host)):
    np.testing.assert_array_equal(np.asarray(x), want)


def test_bucket_cap_bounds_live_memory_when_donating():
  placement = make_placement("separate", 8, train_devices=4, sampler_tensor=2)
  train_mesh, sampler_mesh = placement.mesh("actor"), placement.mesh("sampler")
  cfg = ModelConfig(vocab_size=264, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
                    d_ff=512)
  _, state, _ = init_sharded(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)), TRAIN_RULES, train_mesh)
  target = param_shardings(state, SAMPLER_RULES, sampler_mesh)
  cap = 256 << 10
  total = sum(x.nbytes for x in jax.tree.leaves(state))
  assert total > 8 * cap
  live = lambda: sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())
  others = live() - total
  r = sampler_mesh.shape["data"]  # the sampler layout replicates weights over `data`
  steady = max(total, r * total)  # footprint before (source) and after (r copies of the target)
  extra = []
  moved, stats = reshard(state, target, bucket_bytes=cap, donate=True,
                         on_bucket=lambda b: extra.append(live() - others - steady))
  assert stats.largest_bucket_bytes <= cap and stats.buckets >= 8
  # At the peak (a bucket landed, its sources not yet freed) at most r bucket copies are extra;
  # moving everything at once would be `total` extra.
  assert max(extra) <= r * cap < total
  assert all(x.is_deleted() for x in jax.tree.leaves(state))
  assert all(not x.is_deleted() for x in jax.tree.leaves(moved))


@pytest.mark.parametrize("tie,scale", [(True, True), (False, True)])  # the head from the
# float32 embedding, and a head of its own
def test_the_samplers_compute_dtype_copy_decodes_as_the_float32_weights(tie, scale):
  """A bf16 model's sampler copy holds its matrices in bf16 (half the bytes moved and held),
  and decodes to the same tokens and log-probs, bit for bit, as its float32 weights."""
  from sampler.engine import generate
  from sampler.methods import SamplingConfig
  cfg = dataclasses.replace(CFG, d_model=80, dtype="bfloat16", tie_embeddings=tie,
                            scale_tied_head=scale)  # 80**-0.5 rounds in bf16
  placement = make_placement("separate", 8, train_devices=4, sampler_tensor=2)
  graphdef, state, _ = init_sharded(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)), TRAIN_RULES,
                                    placement.mesh("actor"))
  target = param_shardings(state, SAMPLER_RULES, placement.mesh("sampler"))
  plain, plain_stats = reshard(state, target)
  cast, cast_stats = reshard(state, target, dtypes=compute_dtypes(cfg, state))
  kept = {x.dtype for x in jax.tree.leaves(cast) if x.ndim == 1}
  assert kept == {np.dtype("float32")}  # norm scales (and biases) stay float32
  assert np.dtype(jnp.bfloat16) in {x.dtype for x in jax.tree.leaves(cast)}
  assert cast_stats.bytes < 0.65 * plain_stats.bytes
  sampling = SamplingConfig(max_new_tokens=6, eos_id=-1, pad_id=0, method="temperature")
  fn = jax.jit(lambda p, t, v, k: generate(graphdef, p, t, v, k, cfg=sampling, n=2))
  tokens = jnp.tile(jnp.arange(1, 9, dtype=jnp.int32), (4, 1))
  valid = jnp.ones((4, 8), bool)
  a, b = fn(plain, tokens, valid, jax.random.key(1)), fn(cast, tokens, valid, jax.random.key(1))
  np.testing.assert_array_equal(a.tokens_BT, b.tokens_BT)
  np.testing.assert_array_equal(a.logprobs_BN, b.logprobs_BN)


def test_reshard_into_the_same_layout_copies_unless_donating():
  """One device, colocated: the layouts match, yet the trainer later donates its buffers, so
  the sampler's copy must not alias them (it did: the first greedy eval hit a deleted buffer)."""
  mesh = make_placement("colocate", 1, train_devices=1, sampler_tensor=1).mesh("actor")
  _, state, _ = init_sharded(lambda: LanguageModel(CFG, rngs=nnx.Rngs(0)), TRAIN_RULES, mesh)
  host = jax.tree.map(np.asarray, state)
  same = jax.tree.map(lambda x: x.sharding, state)
  copy, _ = reshard(state, same)
  jax.tree.map(lambda x: x.delete(), state)
  for x, want in zip(jax.tree.leaves(copy), jax.tree.leaves(host)):
    np.testing.assert_array_equal(np.asarray(x), want)
  moved, _ = reshard(copy, same, donate=True)  # donating: aliasing is fine and nothing is freed
  assert all(not x.is_deleted() for x in jax.tree.leaves(moved))


def test_donating_into_an_equivalent_layout_keeps_the_buffers_it_shares():
  """Another mesh over the same devices whose shards are the same (the trainer's mirror of the
  sampler's mesh, a replicated leaf): `device_put` gives a new array over the source's buffers,
  so donating must not delete the source (it did: LoRA's merged push on several processes
  decoded with a deleted norm scale)."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  two = np.asarray(jax.devices()[:2], dtype=object)
  rows, cols = (Mesh(two.reshape(shape), ("data", "tensor")) for shape in ((2, 1), (1, 2)))
  x = jax.device_put(np.arange(32, dtype=np.float32), NamedSharding(rows, PartitionSpec()))
  moved, _ = reshard({"scale": x}, {"scale": NamedSharding(cols, PartitionSpec())}, donate=True)
  np.testing.assert_array_equal(np.asarray(moved["scale"]), np.arange(32))


@pytest.mark.parametrize("src,dst", [
    ((("data", 2), ("tensor", 2)), (("fsdp", 4),)),  # sampler rows 2 ways -> trainer 4 ways
    ((("fsdp", 4),), (("data", 2), ("tensor", 2))),
    ((("fsdp", 4),), (("fsdp", 2),)),  # onto fewer devices
    ((("tensor", 2),), (("fsdp", 4),)),  # replicated rows -> split
])
def test_move_copies_batches_device_to_device(src, dst):
  from jax.sharding import NamedSharding, PartitionSpec

  from sharding.mesh import make_mesh
  from sharding.reshard import move
  src_mesh = make_mesh(dict(src), jax.devices()[4:4 + int(np.prod([n for _, n in src]))])
  dst_mesh = make_mesh(dict(dst), jax.devices()[:int(np.prod([n for _, n in dst]))])
  rows = lambda mesh: NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
  x = jax.device_put(np.arange(8 * 3, dtype=np.float32).reshape(8, 3), rows(src_mesh))
  y = jax.device_put(np.arange(8, dtype=np.int32), rows(src_mesh))
  # No host round trip, explicit or not (jax.device_put would take one for src0 -> dst0).
  with jax.transfer_guard_host_to_device("disallow_explicit"), \
      jax.transfer_guard_device_to_host("disallow_explicit"):
    moved = move({"x": x, "y": y}, {"x": rows(dst_mesh), "y": rows(dst_mesh)})
  np.testing.assert_array_equal(np.asarray(moved["x"]), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(moved["y"]), np.asarray(y))
  assert moved["x"].sharding == rows(dst_mesh) and moved["y"].sharding == rows(dst_mesh)
