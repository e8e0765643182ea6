"""A run checked and planned before it launches, allocating nothing: the dry run's memory table
(dry_run.py, by the planner's footprint model), the run's programs compiled ahead of time for a
TPU slice by its own compiler (target_compile.py; the generation programs as the Generator runs
them: target_generation.py; the report: target_report.py; matrix-product FLOPs read off the
compiled HLO: hlo_flops.py; the compile in a child process: compile_guard.py), docs/lora.md's
fit table (fit_table.py) and the planner's calibration runs on this machine (calibration.py).
`jaxrl-train --dry_run [--target]`, `jaxrl-plan` and the benchmarks call it."""
