"""Model FLOPs of the work an RL step needs: forward, train and decode passes of `ModelConfig`.

Counted as 2 FLOPs per multiply-add of every matrix product the pass must do:
  - the projections and MLP (2 x the non-embedding parameters; of a mixture of experts, the
    active ones: the router and the experts a token is routed to) per token processed;
  - attention: queries x keys and probabilities x values over the keys a query may see (causal:
    query t sees t + 1 positions; a decode step sees its prompt and everything generated; in a
    sliding-window layer at most the window);
  - the LM head (2 x d_model x vocab) only where a token's distribution is needed: log-probs of
    completion tokens, one sampled token per decode step.
Embedding lookups, norms and softmaxes are not counted (they are not matrix products). A
backward pass counts twice its forward. Work a step can skip is never counted: the benchmarks
divide these by measured seconds, so a skipped pass cannot earn credit.
"""
from __future__ import annotations

from jaxrl.models.config import ModelConfig


def mlp_params(cfg: ModelConfig, active: bool = False) -> int:
  """Parameters of one layer's MLP: a mixture of experts' router and its experts (`active`:
  only the `moe.per_token` experts a token uses)."""
  d = cfg.d_model
  if not cfg.moe.experts:
    return 3 * d * cfg.d_ff
  experts = cfg.moe.per_token if active else cfg.moe.experts
  return 3 * d * cfg.moe.d_ff * experts + cfg.moe.experts * d


def token_ff(cfg: ModelConfig) -> int:
  """The MLP's hidden width per token: d_ff, or a mixture of experts' moe.per_token x
  moe.d_ff (a token's rows among the assignments sorted by expert)."""
  return cfg.moe.per_token * cfg.moe.d_ff if cfg.moe.experts else cfg.d_ff


def layer_params(cfg: ModelConfig) -> int:
  """Parameters of one decoder layer: its projections, its MLP and its two norms."""
  d, h = cfg.d_model, cfg.head_dim
  return d * h * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + mlp_params(cfg) + 2 * d


def stored_matmul_params(cfg: ModelConfig) -> int:
  """`matmul_params` as stored: every expert of a mixture (what memory holds and a decode step
  over many rows reads)."""
  return cfg.n_layers * (layer_params(cfg) - 2 * cfg.d_model)


def matmul_params(cfg: ModelConfig) -> int:
  """Parameters of the per-token matrix products (projections and MLP, every layer; of a
  mixture of experts, the router and the experts a token uses: the active parameters)."""
  d, h = cfg.d_model, cfg.head_dim
  return cfg.n_layers * (d * h * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
                         + mlp_params(cfg, active=True))


def causal_keys(seq_len: float, window: int = 0) -> float:
  """Keys per query of a causal pass over `seq_len` positions, on average: (T + 1) / 2, or
  within a sliding `window` (a query sees at most `window` keys)."""
  if not window or window >= seq_len:
    return (seq_len + 1) / 2
  return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def attention_flops(cfg: ModelConfig, queries: int, keys_per_query: float,
                    local_keys: float | None = None) -> float:
  """QK^T and PV over all layers for `queries` queries, each seeing `keys_per_query` keys (a
  sliding-window layer's: `local_keys`, default at most its window)."""
  local = sum(cfg.is_local(i) for i in range(cfg.n_layers))
  if local_keys is None:
    local_keys = min(keys_per_query, cfg.attention.sliding_window or keys_per_query)
  keys = (cfg.n_layers - local) * keys_per_query + local * local_keys
  return 4.0 * cfg.n_heads * cfg.head_dim * queries * keys


def head_flops(cfg: ModelConfig, positions: int) -> float:
  return 2.0 * cfg.d_model * cfg.vocab_size * positions


def forward_flops(cfg: ModelConfig, rows: int, seq_len: int, scored: int) -> float:
  """One causal forward over `rows` x `seq_len` tokens, with the LM head at `scored` positions
  per row (the completion tokens whose log-probs are needed)."""
  tokens = rows * seq_len
  return (2.0 * matmul_params(cfg) * tokens
          + attention_flops(cfg, tokens, (seq_len + 1) / 2,
                            causal_keys(seq_len, cfg.attention.sliding_window))
          + head_flops(cfg, rows * scored))


def shared_forward_flops(cfg: ModelConfig, prompts: int, prompt_len: int, samples: int,
                         scored: int) -> float:
  """`forward_flops` with each prompt run once for its `samples` rows (`rl.batching.share_prefix`,
  train/updates/prefix.py): the prompts' causal pass, then each row's `scored` completion
  positions attending to its prompt and to the completion so far; the LM head at those."""
  rows = prompts * samples
  return (2.0 * matmul_params(cfg) * (prompts * prompt_len + rows * scored)
          + shared_attention_flops(cfg, prompts, prompt_len, samples, scored)
          + head_flops(cfg, rows * scored))


def shared_attention_flops(cfg: ModelConfig, prompts: int, prompt_len: int, samples: int,
                           scored: int) -> float:
  """`shared_forward_flops`' attention: the prompts' causal pass, then each row's completion
  positions over its prompt and the completion so far."""
  window, keys = cfg.attention.sliding_window, prompt_len + (scored + 1) / 2
  return (attention_flops(cfg, prompts * prompt_len, (prompt_len + 1) / 2,
                          causal_keys(prompt_len, window))
          + attention_flops(cfg, prompts * samples * scored, keys, min(keys, window or keys)))


def pass_flops(cfg: ModelConfig, rows: int, seq_len: int, prompt_len: int,
               share_group: int = 1) -> float:
  """A scoring pass over `rows` rows of a `prompt_len`-token prompt and a completion: each
  prompt run once for `share_group` rows of it where > 1 (`shared_forward_flops`)."""
  scored = seq_len - prompt_len
  if share_group > 1:
    return shared_forward_flops(cfg, rows // share_group, prompt_len, share_group, scored)
  return forward_flops(cfg, rows, seq_len, scored)


def train_flops(cfg: ModelConfig, rows: int, seq_len: int, scored: int) -> float:
  """Forward + backward (twice the forward)."""
  return 3.0 * forward_flops(cfg, rows, seq_len, scored)


def generate_flops(cfg: ModelConfig, prompts: int, prompt_len: int, samples: int,
                   new_tokens: float) -> float:
  """Prefill of each prompt once (its KV cache shared by its `samples` rows; the LM head at the
  last position only), then `new_tokens` - 1 decode steps per row on average (the last sampled
  token needs no forward pass), each attending to the prompt and the tokens so far."""
  prefill = (2.0 * matmul_params(cfg) * prompts * prompt_len
             + attention_flops(cfg, prompts * prompt_len, (prompt_len + 1) / 2,
                               causal_keys(prompt_len, cfg.attention.sliding_window))
             + head_flops(cfg, prompts))
  rows, steps = prompts * samples, max(new_tokens - 1, 0)
  decode = (2.0 * matmul_params(cfg) * rows * steps
            + attention_flops(cfg, rows * steps, prompt_len + (steps + 1) / 2)
            + head_flops(cfg, rows * steps))
  return prefill + decode


def recomputes_logits(cfg: ModelConfig, rows: int, scored: int) -> bool:
  """Whether an update's backward computes the LM head's logits again: the chunked log-probs'
  backward recomputes each chunk (its custom VJP, jaxrl/models/lm_head.py), where a pass of `rows`
  rows takes several chunks; a single chunk's two products are one to the compiler (merged as
  equal)."""
  from jaxrl.models.lm_head import chunk_length
  return chunk_length(rows, scored, cfg.vocab_size) < scored


def executed_train_flops(cfg: ModelConfig, rows: int, seq_len: int, scored: int, *,
                         remat: str | None = None, lora_params: int = 0,
                         pass_rows: int | None = None) -> float:
  """The matrix products an update executes, as a compiler counts them (`train_flops` counts a
  model's work, whatever the program does): forward and backward, the LM head's logits again
  where the chunked log-probs recompute them (passes of `pass_rows` rows, default `rows`), less
  the gradients of LoRA's frozen base (with the adapters' `lora_params` in three passes
  instead), plus, under `remat`
  (default `cfg.layers.remat`) `full`, the blocks' attention and the products whose outputs the
  backward reads, again (queries, keys, values, gate, up: XLA recomputes no more, and under
  `dots` nothing: checked against the TPU compiler by benchmarks/target_sweep.py)."""
  tokens = rows * seq_len
  out = train_flops(cfg, rows, seq_len, scored)
  if recomputes_logits(cfg, pass_rows or rows, scored):
    out += head_flops(cfg, rows * scored)
  if lora_params:
    out += 6.0 * lora_params * tokens - 2.0 * matmul_params(cfg) * tokens
    out -= head_flops(cfg, rows * scored)
  if (remat or cfg.layers.remat) == "full":
    d, h = cfg.d_model, cfg.head_dim
    read = cfg.n_layers * (d * h * (cfg.n_heads + 2 * cfg.n_kv_heads)
                           + 2 * mlp_params(cfg, active=True) // 3)
    out += 2.0 * read * tokens + attention_flops(cfg, tokens, (seq_len + 1) / 2,
                                                 causal_keys(seq_len, cfg.attention.sliding_window))
  return out
