"""Shared prefixes (`rl.batching.share_prefix`): a piece's rows of one prompt run over it once,
unpacked (its KV cache computed once: train/updates/prefix.py) or packed as a tree (the prompt
once, each completion a branch that sees it: train/updates/packing.py), give the log-probs,
entropies, loss and gradients of the unshared batch, for every family (Gemma 3's window
counted in positions, Qwen3-MoE's routes replayed per branch), scanned with remat, and LoRA."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.algos.losses import POLICY_LOSSES, aggregation_weights
from jaxrl.config_rl import BatchingConfig, KLConfig, LossConfig, RLConfig, RolloutConfig
from jaxrl.models.config import from_fields
from jaxrl.models.lora import LoRAConfig
from jaxrl.models.transformer import LanguageModel
from jaxrl.models.value_models import RewardModel, ValueModel
from model_checks import perturbed
from train.loop.experience import Experience
from train.updates.forward import completion_logprobs, completion_values, sequence_scores
from train.updates.packing import plan
from train.updates.policy import policy_loss, policy_update
from train.updates.preference import pair_logprobs, pair_scores
from train.updates.prefix import prefix_logprobs, prefix_scores, prefix_values
from train.updates.state import TrainState, model_of

P, N, B, G = 6, 10, 8, 4  # two prompts of four rows each
LENGTHS = np.array([0, 10, 3, 7, 9, 2, 5, 1])  # an empty one, a full one
BASE = dict(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
MODELS = {
    "llama": {}, "llama_scanned_remat": {"layers.scan": True, "layers.remat": "full"},
    "llama_dots": {"layers.remat": "dots"},
    "gemma3_splash": {"family": "gemma3", "n_layers": 3, "attention.sliding_window": 3,
                      "attention.global_every": 2, "attention.impl": "splash"},
    "gemma3": {"family": "gemma3", "n_layers": 3, "attention.sliding_window": 3,
               "attention.global_every": 2},
    "qwen3_moe": {"family": "qwen3_moe", "moe.experts": 4, "moe.per_token": 2, "moe.d_ff": 16,
                  "moe.routing_replay": "rollout"},
    "llama_lora": {}}


def _batch(model: str, **fields):
  cfg = from_fields({**BASE, **MODELS[model], **fields, "dtype": "float32"})
  if model.endswith("lora"):
    graphdef, params = perturbed(cfg, LoRAConfig(rank=4, alpha=8.0))
  else:
    graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(1)))
  rng = np.random.default_rng(0)
  prompt_lens = np.repeat([4, 6], G)
  valid = np.zeros((B, P + N), bool)
  for b in range(B):
    valid[b, P - prompt_lens[b]:P + LENGTHS[b]] = True
  tokens = rng.integers(2, 48, (B, P + N))
  tokens[:, :P] = np.repeat(tokens[::G, :P], G, axis=0)  # a group's rows share their prompt
  tokens = jnp.asarray(np.where(valid, tokens, 0), jnp.int32)
  valid, mask = jnp.asarray(valid), jnp.asarray(valid[:, P:])
  routes = None
  if model == "qwen3_moe":  # the experts the sampler chose: one forward's, replayed
    routes = model_of(graphdef, params).decoder.forward(tokens, jnp.cumsum(valid, 1) - 1,
                                                         valid)[2].ids
  logp, _ = completion_logprobs(graphdef, params, tokens, valid, P, routes)
  noisy = lambda scale: jnp.where(mask, logp + scale * rng.standard_normal(mask.shape), 0.0)
  exp = Experience(tokens_BT=tokens, valid_BT=valid, completion_mask_BN=mask,
                   sampler_logprobs_BN=noisy(0.3), ref_logprobs_BN=noisy(0.5),
                   advantages_BN=jnp.asarray(rng.standard_normal((B, N)) * mask, jnp.float32),
                   old_logprobs_BN=noisy(0.2), routes_BTLK=routes)
  return graphdef, params, exp, prompt_lens


def _shared(exp, prompt_lens, pieces: int, length: int = 48):
  pack = plan(prompt_lens, LENGTHS, prompt_width=P, completion_slots=N, pieces=pieces,
              length=length, row_buckets=(1, 2, B // pieces), group=G)
  return exp.replace(pack=jax.tree.map(jnp.asarray, pack)), pack


def test_the_plan_holds_a_pieces_prompt_once_its_completions_branches_of_it():
  prompt_lens = np.repeat([4, 6], G)
  for pieces, prompts in ((1, 2), (2, 4)):  # (pieces of 2 rows of either prompt: 4 copies)
    pack = plan(prompt_lens, LENGTHS, prompt_width=P, completion_slots=N, pieces=pieces,
                length=48, row_buckets=(B // pieces,), group=G)
    assert (pack.source_PRL >= 0).sum() == LENGTHS.sum() + prompts // 2 * (4 + 6)
    segments, parents, positions = pack.segment_ids_PRL, pack.parent_ids_PRL, pack.positions_PRL
    branch = (segments != parents) & (segments > 0)
    assert branch.sum() == LENGTHS.sum()  # every completion token in a branch
    roots = (segments == parents) & (segments > 0)
    assert roots.sum() == prompts // 2 * (4 + 6)
    # a branch's positions continue from its prompt's length
    for p, r in zip(*np.nonzero(branch.any(axis=2))):
      for seg in set(segments[p, r][branch[p, r]]):
        at = segments[p, r] == seg
        prompt = segments[p, r] == parents[p, r][at][0]
        assert positions[p, r][at][0] == prompt.sum()
  # a tree too long for a row is cut into trees that each hold the prompt
  pack = plan(prompt_lens, LENGTHS, prompt_width=P, completion_slots=N, pieces=1, length=16,
              row_buckets=(B,), group=G)
  assert (pack.source_PRL >= 0).sum() > LENGTHS.sum() + 10


@pytest.mark.parametrize("model,packed", [(m, False) for m in MODELS] + [
    (m, True) for m in MODELS])
def test_shared_loss_and_gradients_equal_the_unshared(model, packed):
  """Unpacked: the prompt's KV cache computed once, its rows' completions continuing from it
  (train/updates/prefix.py); packed: a tree."""
  graphdef, params, exp, prompt_lens = _batch(model)
  loss = lambda share: RLConfig(  # noqa: E731
      prompts_per_step=B // G, group_size=G, loss=LossConfig(name="ppo_clip", entropy_coef=0.01),
      kl=KLConfig(coef=0.1), rollout=RolloutConfig(max_new_tokens=N),
      batching=BatchingConfig(num_minibatches=1, pack_length=48 * packed, share_prefix=share))
  weights = aggregation_weights("token_mean", exp.policy_mask_BN)
  fn = lambda cfg: jax.jit(jax.value_and_grad(  # noqa: E731
      lambda p, e: policy_loss(p, (e, weights, weights), graphdef=graphdef, cfg=cfg),
      has_aux=True))
  (want, want_m), want_g = fn(loss("off"))(params, exp)
  shared = exp
  if packed:
    shared, pack = _shared(exp, prompt_lens, pieces=1)
    assert pack.packed_tokens < exp.tokens_BT.size
  else:
    assert loss("on").share_group == G
  (got, got_m), got_g = fn(loss("on"))(params, shared)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  for k in want_m:
    np.testing.assert_allclose(got_m[k], want_m[k], atol=1e-5, rtol=0, err_msg=k)
  assert float(jnp.abs(want)) > 1e-3
  for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):  # (a prompt's gradient
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)  # summed over its rows' branches)


@pytest.mark.parametrize("packed", [False, True])
def test_an_update_over_shared_minibatches_moves_the_weights_alike(packed):
  """Two minibatches (the second's loss at moved weights, against the first's pi_old)."""
  graphdef, params, exp, prompt_lens = _batch("llama")
  cfg = lambda share: RLConfig(  # noqa: E731
      prompts_per_step=2, group_size=G, kl=KLConfig(coef=0.1),
      batching=BatchingConfig(num_minibatches=2, pack_length=48 * packed, share_prefix=share),
      rollout=RolloutConfig(max_new_tokens=N))
  optimizer = optax.sgd(1.0)
  update = lambda c: jax.jit(  # noqa: E731
      lambda s, e: policy_update(s, e, graphdef=graphdef, optimizer=optimizer, cfg=c))
  new = lambda: TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state=optimizer.init(params))
  want, want_m = update(cfg("off"))(new(), exp)
  # 2 pieces of 4 rows (rows p, p + 2, ..): two of either prompt, each prompt run once
  assert cfg("on").share_group == 2
  got, got_m = update(cfg("on"))(new(), _shared(exp, prompt_lens, pieces=2)[0] if packed else exp)
  np.testing.assert_allclose(got_m["loss"], want_m["loss"], atol=1e-5, rtol=0)
  for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_critic_values_reward_scores_and_dpo_pairs_equal_the_unshared():
  """The critic's values and their gradient, a reward model's scores, DPO's pair log-probs and
  the reward model's pair scores (a pair's prompt run once for its chosen and rejected
  response) as the unshared passes'."""
  graphdef, params, exp, _ = _batch("llama")
  tokens, valid, mask = exp.tokens_BT, exp.valid_BT, exp.completion_mask_BN
  cfg = from_fields({**BASE, "dtype": "float32"})
  head = jax.random.normal(jax.random.key(3), (cfg.d_model,))
  split = lambda kind: nnx.split(kind(cfg, rngs=nnx.Rngs(2)))  # noqa: E731
  (critic, weights), (scorer, _) = split(ValueModel), split(RewardModel)
  weights["head"][...] = head
  close = lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)  # noqa: E731
  summed = lambda fn: jax.grad(lambda q: (fn(q) * mask).sum())(weights)  # noqa: E731
  want = jax.jit(lambda q: completion_values(critic, q, tokens, valid, P))
  got = jax.jit(lambda q: prefix_values(critic, q, tokens, valid, P, G))
  close(np.asarray(got(weights))[mask], np.asarray(want(weights))[mask])
  jax.tree.map(close, summed(got), summed(want))
  close(prefix_scores(scorer, weights, tokens, valid, P, G),
        sequence_scores(scorer, weights, tokens, valid))
  # pairs (i, i + 4) share a prompt: chosen rows 0, 1, 4, 5, rejected rows 2, 3, 6, 7
  order = np.array([0, 1, 4, 5, 2, 3, 6, 7])
  pairs = (tokens[order], valid[order], mask[order])
  for fn in (lambda q, s: pair_logprobs(graphdef, q, *pairs, prompt_len=P, share=s),
             jax.grad(lambda q, s: pair_logprobs(graphdef, q, *pairs, prompt_len=P,
                                                 share=s).sum())):
    jax.tree.map(close, fn(params, True), fn(params, False))
  # the reward model's Bradley-Terry pairs: their scores and the scores' gradient
  for fn in (lambda q, s: pair_scores(scorer, q, *pairs[:2], prompt_len=P, share=s),
             jax.grad(lambda q, s: pair_scores(scorer, q, *pairs[:2], prompt_len=P,
                                               share=s).sum())):
    jax.tree.map(close, fn(weights, True), fn(weights, False))


def test_auto_shares_where_the_cost_model_prices_the_step_faster():
  """`share_prefix="auto"`: decided as the layout is worked out, by the planner's prices."""
  from jaxrl.config_files import resolve, shipped
  from planner.plan import share_prefix
  from train.roles.layout import layout
  raw = shipped("default").get_config()
  raw.rl.batching.share_prefix = "auto"
  cfg = resolve(raw)
  assert cfg.rl.share_group == 1  # (undecided: nothing shared)
  # 8 rows a prompt in 2 pieces: 4 of each prompt a piece
  assert layout(cfg).cfg.rl.batching.share_prefix == "on"
  assert layout(cfg).cfg.rl.share_group == 4
  # 16 pieces of 32 rows: no piece holds two rows of a prompt, priced alike: off
  raw.rl.batching.num_minibatches = 16
  assert share_prefix(resolve(raw), jax.devices()[0]).rl.batching.share_prefix == "off"


def test_every_policy_loss_shared_equals_the_unshared():
  """Each policy loss (its aggregation, clipping, correction) reads the shared pass's
  log-probs as the unshared pass's: the same loss and metrics."""
  graphdef, params, exp, _ = _batch("llama")
  weights = aggregation_weights("token_mean", exp.policy_mask_BN)
  for name in POLICY_LOSSES:
    rl = lambda share: RLConfig(  # noqa: E731
        prompts_per_step=B // G, group_size=G, loss=LossConfig(name=name),
        rollout=RolloutConfig(max_new_tokens=N),
        batching=BatchingConfig(num_minibatches=1, share_prefix=share))
    (want, want_m), (got, got_m) = (jax.jit(lambda p, share=share: policy_loss(
        p, (exp, weights, weights), graphdef=graphdef, cfg=rl(share)))(params)
                                    for share in ("off", "on"))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=name)
    for k in want_m:
      np.testing.assert_allclose(got_m[k], want_m[k], atol=1e-5, rtol=1e-5, err_msg=k)


@pytest.mark.parametrize("scan", [False, True])
def test_the_shared_route_keeps_what_remat_keeps(scan):
  """The shared route's two cached passes (the prompt's, its rows' completions') run their
  blocks under `model.layers.remat` (jaxrl/models/remat.py): the gradient's compiled
  temporaries shrink from none to dots to full as the unshared pass's do (they were the same
  under each before)."""
  def temporaries(remat):
    graphdef, params, exp, _ = _batch("llama", **{"layers.scan": scan, "layers.remat": remat,
                                                  "d_ff": 512, "n_layers": 4})
    grad = jax.jit(jax.grad(lambda p, e: prefix_logprobs(
        graphdef, p, e.tokens_BT, e.valid_BT, P, G)[0].sum()))
    return grad.lower(params, exp).compile().memory_analysis().temp_size_in_bytes
  none, dots, full = map(temporaries, ("none", "dots", "full"))
  assert none > dots >= full and full < 0.9 * none, (none, dots, full)
