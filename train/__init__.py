"""Everything that makes a run, in rooms layered bottom up (docs/architecture.md; held by
tests/test_layers.py): io (run I/O), updates (pure update steps), roles (models on their meshes
and their weights), rollout (generation, multi-turn, the async worker and its schedule), task (the
run's data, reward and held-out evaluation), rl (the RL loop), stages, run (`Experiment`)."""
