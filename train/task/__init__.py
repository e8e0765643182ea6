"""The run's task, by concern: its data (data.py: the tokenizer, the examples, the RL prompt
batches), its reward (reward.py: `make_reward`, and `Judge`, which applies it to rollouts), its
environment (environment.py), the processes it starts beside its models (processes.py:
`UserProcesses`: the reward function's workers, the environment's hosts, the code sandbox), the
held-out evaluation (heldout.py) and preference pairs (pairs.py)."""
