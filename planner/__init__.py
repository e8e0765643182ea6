"""The execution-plan planner (ReaL, adaptive placement, LlamaRL): a cost model of an RL step
(cost.py) over device tables (devices.py), calibrated on this machine or a run's trace
(calibrate.py), searched over placements, meshes, micro-batches and sync / async (search.py);
`placement.strategy = "plan"` (plan.py) and `jaxrl-plan` (train/cli/plan.py) use it, and
`python -m planner.scaling` simulates clusters we do not have (docs/scaling.md)."""
