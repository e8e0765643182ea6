"""`jax.nn.dot_product_attention` (the fused path: XLA's on a CPU, cuDNN's flash attention on a
GPU) computes what the explicit einsum attention does, with left padding and packed segments."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import LanguageModel, ModelConfig
from jaxrl.models.config import from_fields
from jaxrl.models.attention import attention_impl
from jaxrl.models.rope import positions_from_segments, positions_from_valid

CFG = ModelConfig(vocab_size=64, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=8,
                  d_ff=96, family="qwen2")


def _forward(cfg, params, tokens_BT, valid_BT, segments_BT):
  graphdef, _ = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  model = nnx.merge(graphdef, params)
  positions = (positions_from_valid(valid_BT) if segments_BT is None
               else positions_from_segments(segments_BT))
  logits_BTV, _ = model(tokens_BT, positions, valid_BT, segment_ids_BT=segments_BT)
  return jnp.where(valid_BT[..., None], logits_BTV, 0.0)  # padded queries' outputs are unused


# Sliding-window attention (Gemma 3): layer 0 local (keys fewer than 5 positions back, its own
# RoPE base), layer 1 global.
WINDOWED = {"attention.sliding_window": 5, "attention.global_every": 2, "rope.local_theta": 100.0}


@pytest.mark.parametrize("impl,packed,window", [("xla", False, False), ("xla", True, False),
                                                ("splash", True, False), ("xla", False, True),
                                                ("splash", True, True)])
def test_fused_attention_equals_the_einsum_form(impl, packed, window):
  """XLA's `jax.nn.dot_product_attention` with the dense mask, and the splash kernel (Pallas'
  interpret mode here) with segment ids, forward and backward; with a sliding window, the
  splash kernel's local mask."""
  rng = np.random.default_rng(0)
  b, t = 4, 16
  tokens = jnp.asarray(rng.integers(0, 64, (b, t)), jnp.int32)
  if packed:  # three segments, then right padding; the last row: left padding, one segment
    segments = np.zeros((b, t), np.int32)
    segments[:, :5], segments[:, 5:9], segments[:, 9:14] = 1, 2, 3
    segments[-1] = np.arange(t) >= 6
    segments, valid = jnp.asarray(segments), jnp.asarray(segments > 0)
  else:  # left padding of 0..6 tokens
    segments, valid = None, jnp.asarray(np.arange(t)[None] >= np.array([[0], [3], [6], [1]]))
  base = from_fields(WINDOWED if window else {}, base=CFG)
  _, params = nnx.split(LanguageModel(base, rngs=nnx.Rngs(0)))
  outs = {}
  for form in ("einsum", impl):
    cfg = from_fields({"attention.impl": form}, base=base)
    loss = lambda p: (_forward(cfg, p, tokens, valid, segments)**2).mean()
    outs[form] = jax.jit(lambda p: (_forward(cfg, p, tokens, valid, segments),
                                    jax.grad(loss)(p)))(params)
  np.testing.assert_allclose(outs[impl][0], outs["einsum"][0], atol=1e-5, rtol=1e-5)
  for a, e in zip(jax.tree.leaves(outs[impl][1]), jax.tree.leaves(outs["einsum"][1])):
    np.testing.assert_allclose(a, e, atol=1e-5, rtol=1e-4)


def _recorded_cudnn(monkeypatch) -> list:
  """`jax.nn.dot_product_attention` recording its calls (implementation, keywords); off a GPU
  XLA's implementation runs the cuDNN path's call."""
  reference, calls = jax.nn.dot_product_attention, []
  def recorded(*args, implementation, **kwargs):
    calls.append((implementation, sorted(kwargs)))
    gpu = jax.default_backend() == "gpu"
    return reference(*args, implementation=implementation if gpu else "xla", **kwargs)
  monkeypatch.setattr(jax.nn, "dot_product_attention", recorded)
  return calls


@pytest.mark.parametrize("window,packed", [(False, False), (True, False), (False, True),
                                           (True, True)])
def test_cudnn_form_equals_the_einsum_form(monkeypatch, window, packed):
  """The cuDNN path's own inputs (valid tokens moved to the front of each row, `is_causal`, the
  rows' lengths, no mask array but packed rows' segments; a sliding window as
  `local_window_size`), run by XLA's implementation of the same call off a GPU: left and right
  padding, a row of padding alone, packed segments, forward and backward."""
  calls = _recorded_cudnn(monkeypatch)
  rng = np.random.default_rng(1)
  b, t = 4, 16
  tokens = jnp.asarray(rng.integers(0, 64, (b, t)), jnp.int32)
  starts, ends = np.array([[0], [3], [6], [t]]), np.array([[t], [12], [9], [t]])
  valid = jnp.asarray((np.arange(t)[None] >= starts) & (np.arange(t)[None] < ends))
  segments = None
  if packed:  # three segments, then right padding; the last row: left padding, one segment
    ids = np.zeros((b, t), np.int32)
    ids[:, :5], ids[:, 5:9], ids[:, 9:14] = 1, 2, 3
    ids[-1] = np.arange(t) >= 6
    segments, valid = jnp.asarray(ids), jnp.asarray(ids > 0)
  base = from_fields(WINDOWED if window else {}, base=CFG)
  _, params = nnx.split(LanguageModel(base, rngs=nnx.Rngs(0)))
  outs = {}
  for impl in ("einsum", "cudnn"):
    cfg = from_fields({"attention.impl": impl, "layers.remat": "dots"}, base=base)
    loss = lambda p: (_forward(cfg, p, tokens, valid, segments)**2).mean()
    outs[impl] = jax.jit(lambda p: (_forward(cfg, p, tokens, valid, segments),
                                    jax.grad(loss)(p)))(params)
  kwargs = ["is_causal", "key_value_seq_lengths", "query_seq_lengths", "scale"]
  kwargs = sorted(kwargs + ["mask"]) if packed else kwargs
  local = ("cudnn", sorted(kwargs + ["local_window_size"]))
  assert calls and all(c == ("cudnn", kwargs) or (window and c == local) for c in calls)
  assert (local in calls) == window
  np.testing.assert_allclose(outs["cudnn"][0], outs["einsum"][0], atol=1e-5, rtol=1e-5)
  for a, e in zip(jax.tree.leaves(outs["cudnn"][1]), jax.tree.leaves(outs["einsum"][1])):
    np.testing.assert_allclose(a, e, atol=1e-5, rtol=1e-4)


def test_a_cudnn_prefill_is_causal_and_equals_the_einsum_form(monkeypatch):
  """A prefill (left-padded prompts, the cache written) tells cuDNN its mask is causal (its
  causal mask type, the dense mask for the padding), its last block's one query not: the
  logits and the cache equal the einsum form's."""
  from jaxrl.models.decoding import LMDecoding
  calls = _recorded_cudnn(monkeypatch)
  valid = jnp.asarray(np.arange(12)[None] >= np.array([[0], [4], [9]]))
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (3, 12)), jnp.int32)
  graphdef, params = nnx.split(LanguageModel(CFG, rngs=nnx.Rngs(0)))
  outs = {}
  for impl in ("einsum", "cudnn"):
    cfg = from_fields({"attention.impl": impl}, base=CFG)
    model = nnx.merge(nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))[0], params)
    outs[impl] = jax.jit(lambda m: LMDecoding.of(m).prefill(tokens, valid)[:2])(model)
  assert ("cudnn", ["is_causal", "mask", "scale"]) in calls and ("cudnn", ["mask", "scale"]) in calls
  for a, e in zip(jax.tree.leaves(outs["cudnn"]), jax.tree.leaves(outs["einsum"])):
    np.testing.assert_allclose(a, e, atol=1e-5, rtol=1e-5)


def test_auto_picks_cudnn_only_on_a_gpu_in_half_precision():
  gpu = jax.default_backend() == "gpu"
  assert attention_impl(CFG) == "xla"  # float32: cuDNN's kernel takes bf16 / fp16 only
  assert attention_impl(dataclasses.replace(CFG, dtype="bfloat16")) == ("cudnn" if gpu else "xla")
  assert attention_impl(from_fields({"attention.impl": "einsum"}, base=CFG)) == "einsum"
  with pytest.raises(ValueError, match="attention.impl"):
    from_fields({"attention.impl": "flash"}, base=CFG)
  from jaxrl import platform
  with platform.building_for("tpu"):  # what a target compile builds
    assert attention_impl(CFG) == "splash"


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_the_memory_models_count_scores_by_the_models_own_choice(backend):
  """One decision: the planner's workload (and through it the dry run's model) holds [T, T]
  scores exactly where the model's attention on that platform does (auto in bf16 on the CPU is
  XLA's form, which holds them; on a GPU cuDNN's flash kernel)."""
  from jaxrl.config import ExperimentConfig
  from planner.cost import Workload
  for model in (CFG, dataclasses.replace(CFG, dtype="bfloat16"),
                from_fields({"attention.impl": "cudnn"}, base=CFG)):
    w = Workload.from_config(ExperimentConfig(model=model), backend)
    assert w.flash_attention == (attention_impl(model, backend) in ("cudnn", "splash"))
  bf16 = Workload.from_config(ExperimentConfig(model=dataclasses.replace(CFG, dtype="bfloat16")),
                              backend)
  assert bf16.flash_attention == (backend != "cpu")


def test_soft_capped_scores_against_numpy():
  """`model.attention.softcap`: every score c * tanh(s / c) before the mask and the softmax, in
  the cacheless einsum form and the decode step's alike."""
  from jaxrl.models.attention import attend, attend_one
  rng = np.random.default_rng(0)
  q = rng.normal(size=(2, 3, 1, 2, 4)).astype(np.float32) * 3  # [B, T, K, G, H]
  k = rng.normal(size=(2, 1, 4, 3)).astype(np.float32) * 3  # [B, K, H, S]
  v = rng.normal(size=(2, 1, 3, 4)).astype(np.float32)  # [B, K, S, H]
  mask = np.tril(np.ones((3, 3), bool))[None].repeat(2, 0)
  s = np.einsum("btkgh,bkhs->bkgts", q, k)
  s = np.where(mask[:, None, None], 2.0 * np.tanh(s / 2.0), -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  want = np.einsum("bkgts,bksh->btkgh", p / p.sum(-1, keepdims=True), v)
  np.testing.assert_allclose(attend(q, k, v, mask, softcap=2.0), want, atol=1e-5)
  np.testing.assert_allclose(attend_one(q[:, 2], k, v, mask[:, 2], softcap=2.0), want[:, 2],
                             atol=1e-5)
  assert float(np.abs(attend(q, k, v, mask) - want).max()) > 1e-2  # (uncapped: other)
