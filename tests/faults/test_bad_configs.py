"""Bad configs: one line naming the field, what was expected and what was given, exit code 2,
no traceback, before anything is trained (tests/faults/conftest.py runs the CLI)."""
import pytest

CASES = [
    (["--config.rl.learning_rate=-1"], "config.rl.learning_rate: expected > 0, got -1.0"),
    (["--config.sft.learning_rate=0"], "config.sft.learning_rate: expected > 0, got 0.0"),
    (["--config.rl.learning_rate=nan"], "config.rl.learning_rate: expected a finite number, got nan"),
    (["--config.rl.kl.coef=-0.1"], "config.rl.kl.coef: expected >= 0, got -0.1"),
    (["--config.rl.loss.eps_low=1.5"], "config.rl.loss.eps_low: the ratio's lower bound "
     "1 - eps_low cannot be negative, expected <= 1, got 1.5"),
    (["--config.rl.stepz=3"], "config.rl.stepz: unknown field; did you mean 'steps'?"),
    (["--config.rl.lerning_rate=3"], "config.rl.lerning_rate: unknown field; did you mean "
     "'learning_rate'?"),
    (["--config.rl.loss.eps_hihg=3"], "config.rl.loss.eps_hihg: unknown field; did you mean "
     "'eps_high'?"),
    (["--config.rl.zzz=3"], "config.rl.zzz: unknown field, and none of the section's"),
    (["--config.rl.steps=abc"], "flag --config.rl.steps=abc: invalid literal for int()"),
    (["--config.rl.schedule.mode=asyncc"],
     "config.rl.schedule.mode: expected one of ['async', 'sync'], got 'asyncc'"),
    (["--config.rl.rollout.temperature=0"], "config.rl.rollout.temperature: expected > 0, got 0.0"),
    (["--config.seed=-1"], "config.seed: expected >= 0, got -1"),
    (["--config.model.d_model=0"], "config.model.d_model: expected > 0, got 0"),
    (["--config.model.n_heads=3"], "config.model.n_heads: 3 must be a multiple of n_kv_heads=2"),
    (["--config.rl.rollout.max_new_tokens=2"],
     "config.rl.rollout.max_new_tokens: the task 'reverse' needs 6 "
     "tokens, got 2"),
    (["--config.rl.prompts_per_step=3"],
     "config.rl.batching.num_minibatches: prompts_per_step*group_size"
     "=6 must split into 2 minibatches divisible by the trainer's 4-way batch split"),
    (["--config.placement.strategy=pipeline"], "config.placement.strategy: expected one of "
     "['colocate', 'interleave', 'plan', 'separate'], got 'pipeline'"),
    (["--config.placement.train_devices=8"],
     "placement.train_devices: 8 does not split the 8 devices"),
    (["--config.model.n_heads=3", "--config.model.n_kv_heads=3",
      "--config.placement.sampler_tensor=2"],
     "config.placement.sampler_tensor: the sampler's mesh axis tensor=2 does not divide "
     "decoder/blocks/0/attn/wk (dimension 3); set placement.sampler_tensor to a divisor of 3"),
    (["--config.rl.schedule.mode=async", "--config.placement.strategy=colocate"],
     "config.rl.schedule.mode: async needs the sampler on devices of its own"),
    (["--config.rl.schedule.partial_rollouts=True"],
     "config.rl.schedule.partial_rollouts: needs mode='async'"),
    (["--config.rl.reward=reward_model", "--config.reward_model.steps=0"],
     "config.reward_model.steps: rl.reward='reward_model' needs a trained reward model"),
    (["--config.task.name=chess"], "config.task.name: expected one of"),
    (["--config.sft.batch_size=10"], "config.sft.batch_size: 10 is not divisible by the 4-way "
     "batch split of its mesh"),
    (["--config.eval.batch_size=3"], "config.eval.batch_size: 3 is not divisible by the 2-way "
     "batch split of its mesh"),
    (["--config.placement.sampler_tensor=3"], "config.placement.sampler_tensor: the sampler's "
     "mesh axis tensor=3 does not divide its 4 devices"),
    (["--config.rl.environment.name=chess"], "config.rl.environment.name: expected one of "
     "['calculator', 'python',"),
    (["--config.dpo.steps=2", "--config.dpo.pairs_path=/nonexistent/pairs.jsonl"],
     "config.dpo.pairs_path: /nonexistent/pairs.jsonl: no such file"),
    (["--config.model.vocab_size=256"], "config.model.vocab_size: expected >= 264 for the "
     "tokenizer"),
    (["--config.sft.pack_length=4"], "sft.pack_length: example"),
    (["--gin_file=missing.gin"], "gin: Unable to open file: missing.gin"),
    (["--gin_param=rl.stepz=3"], "gin: Configurable 'rl' doesn't have a parameter named 'stepz'"),
    # a string unquoted in gin: the binding and the value, not Python's ast message
    (["--gin_param=rl.verifier=char_match"], "gin: --gin_param 'rl.verifier=char_match': cannot "
     "read the value 'char_match' (a string is quoted in gin: 'char_match';"),
    # a field from before the RL settings' sections: where it lives now
    (["--config.rl.num_minibatches=2"], "config.rl.num_minibatches: has moved to "
     "config.rl.batching.num_minibatches (--config.rl.batching.num_minibatches=...)"),
    (["--gin_param=rl.num_minibatches=2"],
     "gin: rl.num_minibatches has moved to rl.batching.num_minibatches"),
    (["--config.model.rope_theta=10.0"], "config.model.rope_theta: has moved to "
     "config.model.rope.theta"),
    (["--config=configs/nope.py"], "--config: given 2 times (configs/tiny.py, configs/nope.py); "
     "pass it once"),
]


@pytest.mark.parametrize("args,message", CASES, ids=[c[0][-1] for c in CASES])
def test_a_bad_config_is_one_line_and_exit_2(cli, args, message):
  rc, line = cli(*args)
  assert rc == 2 and message in line, line


def test_a_config_file_that_does_not_exist_or_fails(cli, tmp_path):
  assert cli(config="configs/nope.py") == (2, "--config: no such config file 'configs/nope.py'")
  broken = tmp_path / "broken.py"
  broken.write_text("def get_config():\n  return 1 / 0\n")
  rc, line = cli(config=str(broken))
  assert rc == 2 and line == f"--config: {broken} failed to load: ZeroDivisionError: division by zero"


def test_a_model_that_does_not_split_2_ways_decodes_1_way(cli, caplog):
  """The default placement (sampler_tensor=0) picks a tensor degree the model splits by, and
  says so; 3 KV heads (SmolLM2-135M's count) trained one step."""
  caplog.set_level("INFO", logger="jaxrl")
  rc, _ = cli("--config.model.n_heads=3", "--config.model.n_kv_heads=3", "--config.sft.steps=1",
              "--config.rl.steps=1")
  assert rc == 0
  assert "the sampler decodes without tensor parallelism (the model's 3 heads, 3 KV heads" in \
      caplog.text
