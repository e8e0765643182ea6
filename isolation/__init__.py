"""Processes the run can kill, and limits that hold for a whole tree of them: user functions in
killable worker processes (workers.py), objects hosted in processes of their own and called by
message (hosts.py), Python programs in a sandbox of Linux namespaces (sandbox.py), memory and
process count per process tree by a cgroup or a budget (process_limits.py). The standard
library and pebble only: nothing of the project, nothing of JAX."""
