"""Sampling methods: small pure functions `(logits_BV, u_B, cfg) -> (tokens_B, logprobs_B)`.

`u_B` is one uniform draw in [0, 1) per row: a token is drawn by inverting the cumulative
distribution (the first token whose cumulative probability exceeds u x total), which is exact
and needs one random number per row instead of a Gumbel draw per vocabulary entry. The engine
draws all of a call's uniforms before its decode loop. The returned log-prob is that of the
chosen token under the distribution actually sampled from (after temperature, top-k and top-p),
which is what off-policy corrections need as mu.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sampler.stops import StopText

NEG_INF = -1e30
DECODE_LAYOUTS = ("auto", "features", "rows")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Static (hashable) decode settings; a change recompiles, so keep them per experiment."""
  max_new_tokens: int
  eos_id: int
  pad_id: int
  method: str = "temperature"  # one of SAMPLERS
  temperature: float = 1.0
  top_k: int = 0  # 0 keeps the whole vocabulary
  top_p: float = 1.0  # nucleus mass kept; 1.0 keeps everything
  ignore_eos: bool = False  # fixed-length generation (benchmarks)
  stop_sequences: tuple[tuple[int, ...], ...] = ()  # token sequences that end a row, like EOS
  stop_text: StopText | None = None  # strings that end a row, matched on its decoded text
  # The decode loop runs in up to this many segments; in each, attention reads only the KV-cache
  # slots that can be filled by its end (the cache grows between segments). Segments are at least
  # MIN_SEGMENT steps, so short generations run as one loop (one compiled body per segment).
  decode_segments: int = 4
  # Activation layout of a decode step: "features" ([features, rows]: weight @ activations, the
  # faster product for XLA:CPU's small-row matrix products), "rows" (the model's own
  # [rows, features]), or "auto": features on a CPU, rows elsewhere. Same results either way.
  decode_layout: str = "auto"

  def __post_init__(self):
    if self.method not in SAMPLERS:
      raise ValueError(f"sampling method: expected one of {sorted(SAMPLERS)}, got {self.method!r}")
    if self.method != "greedy" and self.temperature <= 0:
      raise ValueError(f"temperature: expected > 0, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p: expected in (0, 1], got {self.top_p}")
    if self.decode_segments < 1:
      raise ValueError(f"decode_segments: expected >= 1, got {self.decode_segments}")
    if self.decode_layout not in DECODE_LAYOUTS:
      raise ValueError(f"decode_layout: expected one of {list(DECODE_LAYOUTS)}, "
                       f"got {self.decode_layout!r}")
    if any(len(s) == 0 for s in self.stop_sequences):
      raise ValueError("stop_sequences: every stop sequence needs at least one token")


def _pick(logp_BV, tokens_B):
  """logp_BV[b, tokens_B[b]] as a masked sum (cheaper than a gather on the CPU)."""
  hit_BV = jnp.arange(logp_BV.shape[-1]) == tokens_B[:, None]
  return jnp.sum(jnp.where(hit_BV, logp_BV, 0.0), axis=-1)


def _first(hit_BV, default):
  """Index of the first True per row (`default` where none), as a min-reduction."""
  v = hit_BV.shape[-1]
  first_B = jnp.min(jnp.where(hit_BV, jnp.arange(v), v), axis=-1)
  return jnp.where(first_B == v, default, first_B).astype(jnp.int32)


def _forced(tokens_B, forced_B):
  """The drawn tokens, but `forced_B`'s where it holds one (>= 0): a replay feeds the tokens
  drawn before through the program that drew them (sampler/inflight.py)."""
  return tokens_B if forced_B is None else jnp.where(forced_B >= 0, forced_B, tokens_B)


def greedy(logits_BV, u_B, cfg: SamplingConfig, forced_B=None):
  del u_B, cfg
  tokens_B = _forced(_first(logits_BV == jnp.max(logits_BV, axis=-1, keepdims=True), 0),
                     forced_B)
  return tokens_B, _pick(jax.nn.log_softmax(logits_BV, -1), tokens_B)


def inverse_cdf(logp_BV, u_B):
  """The first token whose cumulative probability exceeds u x total; tokens of probability 0
  are never chosen (even where rounding in the cumulative sum would put u on one of them)."""
  probs_BV = jnp.exp(logp_BV)
  cdf_BV = jnp.cumsum(probs_BV, axis=-1)
  allowed_BV = probs_BV > 0
  last_B = jnp.max(jnp.where(allowed_BV, jnp.arange(logp_BV.shape[-1]), 0), axis=-1)
  return _first(allowed_BV & (cdf_BV > u_B[:, None] * cdf_BV[:, -1:]), last_B)


def top_k_filter(logits_BV, k: int):
  if k <= 0 or k >= logits_BV.shape[-1]:
    return logits_BV
  kth_B1 = jax.lax.top_k(logits_BV, k)[0][:, -1:]
  return jnp.where(logits_BV < kth_B1, NEG_INF, logits_BV)


def top_p_filter(logits_BV, p: float):
  """Keeps the smallest set of most likely tokens whose mass reaches p (always the top one)."""
  if p >= 1.0:
    return logits_BV
  sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
  probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
  mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
  kept_BV = mass_before_BV < p
  threshold_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits_BV < threshold_B1, NEG_INF, logits_BV)


def temperature(logits_BV, u_B, cfg: SamplingConfig, forced_B=None):
  scaled_BV = top_p_filter(top_k_filter(logits_BV / cfg.temperature, cfg.top_k), cfg.top_p)
  logp_BV = jax.nn.log_softmax(scaled_BV, axis=-1)
  tokens_B = _forced(inverse_cdf(logp_BV, u_B), forced_B)
  return tokens_B, _pick(logp_BV, tokens_B)


SAMPLERS = {"greedy": greedy, "temperature": temperature}
