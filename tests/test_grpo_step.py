"""The GRPO loss of train/updates/ against a numpy reference built from the same log-probs."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.config_rl import KLConfig, LossConfig, RLConfig
from jaxrl.algos.losses import aggregation_weights
from jaxrl.models.transformer import LanguageModel
from train.loop.experience import Experience, advantages
from train.updates.forward import completion_logprobs
from train.updates.policy import policy_loss


def _weights(exp, cfg):
  """The loss's token weights and the token mean's (for the mismatch metrics)."""
  return (aggregation_weights(cfg.loss.aggregation, exp.completion_mask_BN),
          aggregation_weights("token_mean", exp.completion_mask_BN))


def test_policy_loss_matches_numpy(tiny_cfg):
  graphdef, params = nnx.split(LanguageModel(tiny_cfg, rngs=nnx.Rngs(3)))
  rng = np.random.default_rng(0)
  b, p, n = 4, 3, 4
  tokens = jnp.asarray(rng.integers(0, 256, (b, p + n)), jnp.int32)
  completion_mask = np.ones((b, n), bool)
  completion_mask[1, 2:] = False
  valid = jnp.asarray(np.concatenate([np.ones((b, p), bool), completion_mask], 1))
  cfg = RLConfig(group_size=2, kl=KLConfig(coef=0.1), loss=LossConfig(eps_low=0.2, eps_high=0.3))
  logp, _ = completion_logprobs(graphdef, params, tokens, valid, p)
  logp = np.asarray(logp, np.float64)
  old = logp + rng.normal(size=(b, n)) * 0.2
  ref = logp + rng.normal(size=(b, n)) * 0.2
  rewards = np.array([1.0, 0.0, 0.0, 0.0])
  adv = np.asarray(advantages(jnp.asarray(rewards), jnp.asarray(completion_mask), cfg=cfg)[0])
  np.testing.assert_allclose(adv[:, 0], [0.7071, -0.7071, 0, 0], atol=1e-3)
  assert (adv[1, 2:] == 0).all()  # padding carries no advantage
  exp = Experience(tokens_BT=tokens, valid_BT=valid,
                   completion_mask_BN=jnp.asarray(completion_mask),
                   old_logprobs_BN=jnp.asarray(old, jnp.float32),
                   ref_logprobs_BN=jnp.asarray(ref, jnp.float32), advantages_BN=jnp.asarray(adv),
                   sampler_logprobs_BN=jnp.asarray(old, jnp.float32))
  assert exp.prompt_len == p
  loss, metrics = policy_loss(params, (exp, *_weights(exp, cfg)), graphdef=graphdef, cfg=cfg)

  ratio = np.exp(logp - old)
  pg = -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.3) * adv)
  d = ref - logp
  kl = np.exp(d) - d - 1
  m = completion_mask.astype(np.float64)
  np.testing.assert_allclose(loss, ((pg + 0.1 * kl) * m).sum() / m.sum(), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(metrics["kl"], (kl * m).sum() / m.sum(), rtol=1e-4, atol=1e-6)


def test_completion_logprobs_are_next_token_logprobs(tiny_cfg):
  model = LanguageModel(tiny_cfg, rngs=nnx.Rngs(1))
  graphdef, params = nnx.split(model)
  tokens = jnp.asarray([[257, 49, 43, 50, 61, 51, 258]], jnp.int32)
  valid = jnp.ones_like(tokens, bool)
  logp, entropy = completion_logprobs(graphdef, params, tokens, valid, 5)
  logits = model(tokens, jnp.arange(7)[None], valid)[0][0]
  want = [jax.nn.log_softmax(logits[t])[tokens[0, t + 1]] for t in (4, 5)]
  np.testing.assert_allclose(logp[0], want, rtol=1e-5)
  assert entropy.shape == (1, 2) and (np.asarray(entropy) > 0).all()
