"""The command line, train/'s top room (docs/architecture.md): `jaxrl-train` (train.py, with
`--dry_run [--target]` through train/preflight/), `jaxrl-eval` (evaluate.py), `jaxrl-export`
(export.py), `jaxrl-sample` (sample.py), `jaxrl-plan` (plan.py); what they share: config files,
overrides, one-line errors and starting JAX (flags.py), a policy from a checkpoint or a Hugging
Face directory (model_io.py). A room of train/, so that nothing installs a top-level `cli`."""
