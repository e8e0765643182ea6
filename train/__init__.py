"""Everything that makes a run, and the commands that start one, in rooms layered bottom up
(docs/architecture.md; held by tests/test_layers.py): io (run I/O), updates (pure update steps),
roles (models on their meshes and their weights), rollout (generation, multi-turn, the async
worker and its schedule), task (the run's data, reward, environment and processes), loop (the RL
loop), stages, run (`Experiment`), preflight (the run checked and planned before it launches:
dry runs, target compiles, calibration) and cli (the command line)."""
