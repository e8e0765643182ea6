"""A seconds-long smoke config (used by the tests): tiny model, a few SFT and GRPO steps.

A 1-layer model of width 32 learns little in 40 SFT steps (held-out exact match 0), so RL is
rewarded by partial credit (`char_match`: the share of letters in place) and every RL step has
a nonzero reward and gradient: the policy moves, and 3 and 5 steps end at other weights.

Run:  .venv/bin/jaxrl-train --config=configs/tiny.py --config.run_dir=/tmp/jaxrl
"""
from jaxrl.config_files import sibling

default = sibling(__file__, "default")


def get_config():
  c = default.get_config()
  c.model.update(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, d_ff=64)
  c.task.update(n_train=256, n_heldout=16)
  c.sft.update(steps=40, batch_size=16, warmup_steps=1, learning_rate=3e-3)
  c.rl.update(steps=3, prompts_per_step=8, group_size=2, verifier="char_match")
  c.rl.batching.update(num_minibatches=2)
  c.eval.update(every=2, batch_size=16)
  c.checkpoint_every = 2
  c.progress = False
  return c
