"""Pure update steps, each `update(state, batch, *, graphdef, optimizer, ...) -> (state, metrics)`
jitted in exactly one place (train/roles/learner.py) with the state donated, by family: sft.py,
rl.py (policy and critic), preference.py (reward model, DPO); with the pieces they share: state.py
(the train state, the optimizer), forward.py (log-probs, values, scores), batching.py (minibatches,
micro-batches, gradient accumulation)."""
