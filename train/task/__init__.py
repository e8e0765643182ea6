"""The run's task: tokenizer, examples, prompt batches, the reward (`Judge`), the environment,
held-out evaluation, preference pairs."""
