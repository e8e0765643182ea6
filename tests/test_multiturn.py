"""Multi-turn rollouts: token ids in and out (with a tokenizer whose decode-then-encode does not
round-trip), the loss mask on the model's own tokens, and an RL run with an environment."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config_files import shipped
from jaxrl.data import tiny_tokenizer
from jaxrl.data.tasks import Example
from jaxrl.data.tokenizer import load_tokenizer
from jaxrl.envs import Step
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import LanguageModel
from sampler.methods import SamplingConfig
from sampler.sampler import Sampler
from train.rollout.multiturn import MultiTurn, as_rollout
from train.run import Experiment
from train.task.heldout import evaluate
from train.updates.forward import completion_logprobs

tiny = shipped("tiny")

TEXTS = ["the answer is 42 and the tool said 42", "calc 12*7 then add 3 to get 87"] * 50


class Recorder:
  """Three model turns, each answered with the same reply; records what it was given, and the
  order of every conversation's steps (`order`: (conversation, turn))."""
  log: list = []
  order: list = []

  def __init__(self, tok, verifier):
    self.tok, self.stop_strings, self.turns = tok, (" then",), []

  def reset(self, example):
    self.turns, self.conversation = [], len(Recorder.log)
    Recorder.log.append(self.turns)
    return []

  def step(self, turn_ids):
    Recorder.order.append((self.conversation, len(self.turns) // 2 + 1))
    self.turns.append(list(turn_ids))
    reply = self.tok.encode(" tool says 42.")
    self.turns.append(reply)
    return Step(reply, 1.0, len(self.turns) >= 6)  # one point a turn


class Replies:
  """Answers every turn with [1]; never done."""
  stop_strings = ()

  def reset(self, example):
    return []

  def step(self, turn_ids):
    return Step([1], 1.0, False)


def test_each_multiturn_owns_its_threads_and_counts():
  """A MultiTurn (each Generator's) steps its conversations' environments in threads of its own
  and counts what they decoded apart from another's, from several threads at once; closing it
  stops its threads while the other's go on."""
  import concurrent.futures
  from train.rollout.multiturn import Conversation
  first, second = MultiTurn(threads=4), MultiTurn()
  with second:
    talks = [Conversation(Replies(), i) for i in range(16)]
    for talk in talks:
      talk.reset(None, 100)
    assert first.reply_all([(t, [5, 6], [-0.5, -0.5]) for t in talks], 100) == [True] * 16
    assert all(t.ids == [5, 6, 1] and t.policy == [True, True, False] for t in talks)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      list(pool.map(lambda _: first.count({"emitted": 1, "admitted": 2}), range(4000)))
    assert first.stats() == {"emitted": 4000, "admitted": 8000} and second.stats() == {}
    first.close()
    assert first.closed and not second.closed
    with pytest.raises(RuntimeError, match="shutdown"):
      first.reply_all([(talks[0], [5], [-0.5])], 100)
    assert second.reply_all([(talks[0], [5], [-0.5])], 100) == [True]
  assert second.closed


# static turns, each prefilling its conversation; in-flight across turns, in as many slots as
# rows, each continuing its kept cache; in 6 slots for 6 rows, prefilling whole
@pytest.mark.parametrize("slots,keep", [(0, False), (0, True), (6, False)])
def test_trained_ids_are_the_sampled_and_appended_ids(tmp_path, slots, keep):
  tiny_tokenizer.train_bpe(TEXTS, 300, tmp_path)
  tok = load_tokenizer(str(tmp_path))
  cfg = ModelConfig(vocab_size=304, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16,
                    d_ff=64)
  graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  # " then" and one token in nine end a turn: several turns of uneven lengths per conversation
  stops = (tuple(tok.encode(" then")),) + tuple((t,) for t in range(5, 304, 9))
  sampler = Sampler(graphdef, SamplingConfig(max_new_tokens=40, eos_id=tok.eos_id,
                                             pad_id=tok.pad_id, stop_sequences=stops,
                                             method="temperature", temperature=1.0),
                    inflight_slots=slots)
  Recorder.log, Recorder.order = [], []
  prompts = [tok.encode(t) for t in ("calc 12*7", "the answer", "add 3", "the tool", "12", "x")]
  envs = [Recorder(tok, None) for _ in prompts]
  with MultiTurn() as multiturn:
    talks = multiturn.converse(sampler, params, prompts, [Example("x", "1")] * len(prompts),
                               envs, jax.random.key(3), max_new_tokens=40, max_turns=3,
                               keep_cache=keep)
    stats = multiturn.stats()
  # what the turns decoded: every token the model emitted, counted once
  assert stats["emitted"] == sum(sum(talk.policy) for talk in talks)
  assert max(turn for _, turn in Recorder.order) == 3
  # In-flight, a conversation's next turn starts as soon as its reply is in: some conversation
  # has its second turn answered before another's first (static turns: never).
  first_done = {i: Recorder.order.index((i, 1)) for i in range(len(prompts))}
  overtaken = any(Recorder.order.index(step) < max(first_done.values())
                  for step in Recorder.order if step[1] == 2)
  assert overtaken == bool(slots or keep)
  round_trips = []
  for talk, log in zip(talks, Recorder.log):
    emitted = [ids for k, ids in enumerate(log) if k % 2 == 0]
    kept = log[:5] if len(log) == 6 else log  # the reply of the last step (done) is not appended
    assert talk.ids == sum(kept, [])[:40]  # what the sampler emitted and the env appended
    want_policy = sum([[k % 2 == 0] * len(ids) for k, ids in enumerate(kept)], [])[:40]
    assert talk.policy == want_policy
    lp = np.asarray(talk.logprobs)
    assert (lp[np.asarray(talk.policy)] < 0).all() and (lp[~np.asarray(talk.policy)] == 0).all()
    round_trips += [tok.encode(tok.decode(ids)) == ids for ids in emitted]
  assert not all(round_trips)  # decoding and encoding again would have changed the ids
  p = max(map(len, prompts))
  tokens_BP = np.stack([np.pad(x, (p - len(x), 0)) for x in prompts]).astype(np.int32)
  valid_BP = np.stack([np.arange(p) >= p - len(x) for x in prompts])
  rollout = as_rollout(talks, tokens_BP, valid_BP, budget=40, pad_id=tok.pad_id)
  # The trainer's log-probs of the stacked conversations equal what the sampler drew with, at
  # every policy token: the ids and their log-probs stayed aligned through the turns.
  logp_BN, _ = completion_logprobs(graphdef, params, jnp.asarray(rollout.tokens_BT),
                                   jnp.asarray(rollout.valid_BT), p)
  policy = rollout.loss_mask_BN
  np.testing.assert_allclose(np.asarray(logp_BN)[policy], rollout.logprobs_BN[policy], atol=1e-5)
  for r, talk in enumerate(talks):
    n = len(talk.ids)
    assert rollout.tokens_BT[r, p:p + n].tolist() == talk.ids
    assert rollout.loss_mask_BN[
        r, :n].tolist() == talk.policy and not rollout.loss_mask_BN[r, n:].any()
    assert rollout.rewards_B[r] == talk.reward == len(Recorder.log[r]) // 2


def test_an_rl_run_with_an_environment_trains_on_the_models_tokens_only(tmp_path):
  raw = tiny.get_config().to_dict()
  raw.update(run_dir=str(tmp_path), run_name="env")
  # in-flight across turns (the static turns' path is the one above with slots=0); the scoring
  # passes and the update over packed rows (their log-probs are the sampler's: mismatch_max)
  raw["rl"].update(steps=2)
  raw["rl"]["environment"].update(name="test_multiturn:Recorder", max_turns=3)
  raw["rl"]["rollout"].update(max_new_tokens=16, inflight_slots=8)
  raw["rl"]["batching"].update(pack_length=64)
  with Experiment(raw) as exp:
    summary = exp.run()
    rows = [r for r in exp.writer.rows if r["phase"] == "rl" and "mismatch_max" in r]
    # jaxrl-eval's sampled mode converses too: 2 conversations per prompt, the environment's
    # rewards (a point a turn), the lengths counting the model's tokens only
    ctx = exp.ctx
    sampled = evaluate(ctx.generator, ctx.task, ctx.judge, ctx.cluster.sampler_weights.fresh(),
                       ctx.task.heldout[:4], batch_size=ctx.cfg.eval.batch_size, n=2,
                       temperature=1.0)
  # the run's environment threads and the processes of its user environment stopped with it
  assert ctx.generator.multiturn.closed and ctx.processes.closed
  assert sampled.scores_EN.shape == (4, 2) and sampled.scores_EN.min() >= 1.0
  assert (sampled.lengths_EN > 0).all() and len(sampled.texts[3]) == 2
  assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)
  assert all(r["padding_fraction"] < 0.5 for r in rows)  # packed: little of the rows is padding
  # the replies' slots hold no sampler log-prob: were they in the loss's mask, the mismatch
  # |log mu - log pi| would be the whole log-prob there
  assert summary["mismatch_max"] <= 1e-5
  assert all(r["reward_mean"] > 0 for r in rows)  # the environment's rewards
  # evaluation conversed too: one point a turn (a single completion scores <= 1 on exact match)
  assert summary["heldout_acc_rl"] >= 1.0
