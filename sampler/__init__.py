"""Decoding, with one entrance: `Sampler` (sampler.py), a frozen description of how to decode
(`generate`, `complete`, `stream`, `requests`; `variant` for other settings). Below it: the
static engine (engine.py: prefill, then segmented decode loops), in-flight slots (inflight.py),
streams of prompt batches with weight swaps (stream.py), requests served across the turns of
conversations (requests.py), and the sampling methods (methods.py).

Imports only `jaxrl` and `sharding` (docs/architecture.md; held by tests/test_layers.py): nothing
of the RL run's policy lives here, no schedule and no staleness bound (a stream records, per
token, the weights' version its caller gives it).
"""
