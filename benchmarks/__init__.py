"""`python -m benchmarks.NAME --json`: the last stdout line one JSON object. Beside the top rooms:
a benchmark may import any room (docs/benchmarks.md has the numbers)."""
