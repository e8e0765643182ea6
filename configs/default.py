"""Default experiment: a tiny Llama learns to reverse strings with SFT, then GRPO, on the CPU.

The SFT demonstrations come from an imperfect teacher with an off-by-one bug: 60% of its answers
reverse all but the last character (`rev abcde=` -> `dcbae` instead of `edcba`). SFT copies the
bug; GRPO with the exact-match verifier fixes it. Set `task.teacher_error=0` for clean demos.

Run:   make run
  or:  .venv/bin/python -m train.main --config=configs/default.py
Override any field: --config.rl.steps=50 --config.task.name=addition --config.task.num_digits=2
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.run_dir = "runs"
  c.run_name = ""
  c.checkpoint_every = 50
  c.keep_checkpoints = 3
  c.progress = True
  c.init_checkpoint = ""  # e.g. runs/NAME/checkpoints/sft: start from saved actor weights

  c.model = dict(vocab_size=264, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                 d_ff=512, rope_theta=10_000.0, norm_eps=1e-6, tie_embeddings=True, dtype="float32")
  c.task = dict(name="reverse", num_digits=5, n_train=4096, n_heldout=256, teacher_error=0.6,
                verifier="exact_match")
  # Separate placement on 8 (fake) devices: the trainer fsdp-shards the actor over devices 0-3,
  # the sampler decodes on devices 4-7 ({data: 2, tensor: 2}) from a shadow copy resharded
  # after every update.
  c.placement = dict(strategy="separate", train_devices=4, sampler_tensor=2,
                     reshard_bucket_mb=256, cpu_devices=8)
  c.sft = dict(steps=800, batch_size=64, learning_rate=1e-3, warmup_steps=20, weight_decay=0.0,
               pack_length=0)
  # DPO after SFT (0 steps: off) and the reward model (trained when rl.reward="reward_model");
  # empty pairs_path: synthetic pairs from the verifier, written to the run dir.
  c.dpo = dict(steps=0, batch_size=32, learning_rate=1e-4, warmup_steps=10, beta=0.1,
               pairs_path="", pairs_per_prompt=1, policy_negatives=True)
  c.reward_model = dict(steps=300, batch_size=32, learning_rate=3e-4, warmup_steps=20,
                        pairs_path="", pairs_per_prompt=2, policy_negatives=True)
  # GRPO with the verifier's reward. See configs/{grpo,rloo,reinforce_pp,ppo_rlhf}_*.py and
  # docs/algorithms.md for the other algorithms.
  c.rl = dict(steps=150, mode="sync", max_staleness=1, prompts_per_step=64, group_size=8,
              num_minibatches=2, learning_rate=3e-4, advantage="grpo", reward="verifier", policy_loss="ppo_clip", aipo_rho=4.0,
              tis_cap=0.0, clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.02, kl_estimator="k3",
              kl_mode="loss", entropy_coef=0.0, gamma=1.0, lam=0.95, whiten_advantages=False,
              critic_learning_rate=1e-4, value_clip_eps=0.2, loss_aggregation="token_mean",
              temperature=1.0, top_k=0, max_grad_norm=1.0)
  c.eval = dict(every=10, batch_size=256)
  return ml_collections.ConfigDict(c)
