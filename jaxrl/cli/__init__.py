"""The command line, the top room (docs/architecture.md): `jaxrl-train` (train.py, with
`--dry_run [--target]` through preflight/), `jaxrl-eval` (evaluate.py), `jaxrl-export`
(export.py), `jaxrl-sample` (sample.py), `jaxrl-plan` (plan.py); what they share: config files,
overrides, one-line errors and starting JAX (flags.py), a policy from a checkpoint or a Hugging
Face directory (model_io.py). In jaxrl's namespace so that nothing installs a top-level `cli`."""
