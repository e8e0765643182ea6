"""Command-line entry points: training, sampling and export, planning, dry runs."""
