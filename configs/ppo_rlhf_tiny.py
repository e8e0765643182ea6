"""PPO with the four RLHF models on the default task (reverse, imperfect teacher), on the CPU.

actor (trained) + critic (value head, trained alongside, initialised from the reward model) +
reward model (Bradley-Terry on synthetic verifier pairs, trunk from the SFT actor) + frozen
reference. The policy is optimised against the reward model's score, not the verifier; the
verifier only measures held-out accuracy. KL(pi || ref) is folded into per-token rewards
(k1, as OpenRLHF), advantages by GAE, whitened over the batch.

Run:  .venv/bin/jaxrl-train --config=configs/ppo_rlhf_tiny.py
"""
from jaxrl.config_files import sibling

default = sibling(__file__, "default")


def get_config():
  c = default.get_config()
  c.reward_model.update(steps=800, batch_size=32, learning_rate=3e-4, pairs_per_prompt=4)
  c.rl.update(reward="reward_model")
  c.rl.advantage.update(name="gae", gamma=1.0, lam=0.95, whiten=True)
  c.rl.kl.update(mode="reward", estimator="k1", coef=0.1)
  c.rl.critic.update(learning_rate=3e-4, clip_eps=0.2)
  return c
