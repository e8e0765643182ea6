"""The run: `Experiment` (the one entry point of the CLI, the benchmarks, the tests and the
notebook), its hooks, resume, and `Experiment.sample`."""
from train.run.experiment import Experiment

__all__ = ["Experiment"]
