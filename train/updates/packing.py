"""Packed RL batches (`rl.batching.pack_length`): the scoring passes and the update run the model
over rows packed to a token budget instead of the [B, T] batch, where long-tailed lengths leave most
slots of a bucket padding.

Only the forward pass is packed. Each piece of the batch (the rows one micro-batch of the
update, and one piece of a scoring pass, hold: rows p, p + n, p + 2n, ... of n pieces) has its
rows' valid spans (left-padded prompt, then the completion) placed first-fit-decreasing into R
rows of L tokens, each span a segment of its own: positions restart and attention stays inside
it, as SFT's packing does. The hidden states are gathered back to the [b, N] completion slots
before the LM head, so every loss, aggregation, ratio and mask downstream sees the same [B, N]
arrays as without packing: unchanged by construction (tests/test_rl_packing.py checks each
policy loss's value and gradients against the unpacked batch).

The plan is made on the host from each row's prompt and completion lengths ([B] integers the
scoring step fetches anyway) and travels as `Pack`, replicated, with a leading axis of pieces
that `split_minibatches` routes to each micro-batch as it routes the rows.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models.lm_head import chunked_logprobs
from jaxrl.models.rope import positions_from_segments
from sampler.engine import bucket
from train.updates.forward import router_loss
from train.updates.state import model_of


@flax.struct.dataclass
class Pack:
  # Per piece, packed row r and position l: the flat index (row * T + t) into the piece's
  # [b, T] arrays of the token there; -1: padding.
  source_PRL: jax.Array
  segment_ids_PRL: jax.Array  # 1, 2, ... per packed span in a row; 0: padding
  # Per piece, row b and completion slot n: the flat index (r * L + l) of the packed position
  # whose hidden state predicts that slot (slots after a row's end: its first position).
  unpack_PBN: jax.Array

  @property
  def packed_tokens(self) -> int:
    return int(np.prod(self.source_PRL.shape))


def _first_fit(sizes: np.ndarray, length: int) -> list[list[int]]:
  """Rows (indices into `sizes`) placed first-fit-decreasing into bins of `length`."""
  bins, fill = [], []
  for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
    at = next((k for k, used in enumerate(fill) if used + sizes[i] <= length), len(bins))
    if at == len(bins):
      bins.append([])
      fill.append(0)
    bins[at].append(i)
    fill[at] += int(sizes[i])
  return bins


def plan(prompt_lens_B: np.ndarray, lengths_B: np.ndarray, *, prompt_width: int,
         completion_slots: int, pieces: int, length: int, row_buckets) -> Pack:
  """The pack of a batch whose row g holds `prompt_lens_B[g]` prompt tokens (left-padded to
  `prompt_width`) and `lengths_B[g]` completion tokens, in `pieces` pieces (rows p + pieces *
  i); each piece's R rows of `length` tokens, R bucketed to `row_buckets` (the most: the
  piece's own row count)."""
  p_w, n = prompt_width, completion_slots
  t = p_w + n
  starts_B = p_w - prompt_lens_B
  sizes_B = prompt_lens_B + lengths_B
  if sizes_B.max(initial=0) > length:
    raise ValueError(f"a row of {int(sizes_B.max())} tokens does not fit a packed row of "
                     f"{length}")
  b = len(sizes_B) // pieces
  rows = [np.arange(p, len(sizes_B), pieces) for p in range(pieces)]
  bins = [_first_fit(sizes_B[r], length) for r in rows]
  r_max = bucket(max(len(x) for x in bins), row_buckets)
  source = np.full((pieces, r_max, length), -1, np.int32)
  segments = np.zeros((pieces, r_max, length), np.int32)
  unpack = np.zeros((pieces, b, n), np.int32)
  slot_t = p_w - 1 + np.arange(n)  # the position whose state predicts completion slot n
  for p, piece_bins in enumerate(bins):
    for r, members in enumerate(piece_bins):
      at = 0
      for seg, i in enumerate(members, 1):
        g, size = rows[p][i], int(sizes_B[rows[p][i]])
        source[p, r, at:at + size] = i * t + starts_B[g] + np.arange(size)
        segments[p, r, at:at + size] = seg
        inside = slot_t < starts_B[g] + size
        unpack[p, i] = r * length + at + np.where(inside, slot_t - starts_B[g], 0)
        at += size
  return Pack(source, segments, unpack)


def packed_logprobs(graphdef, params, tokens_BT, pack: Pack, completion_mask_BN,
                    routes_BTLK=None, temperature: float = 1.0):
  """(log-probs, entropies) [b, N] of one piece's completion slots (0 after a row's end), its
  model run over the piece's packed rows, at `temperature`; with a mixture of experts also its
  router loss and metrics, as `forward.routed_logprobs`."""
  source_RL, segments_RL, unpack_BN = (x[0] for x in (pack.source_PRL, pack.segment_ids_PRL,
                                                      pack.unpack_PBN))
  b, t = tokens_BT.shape
  n = completion_mask_BN.shape[1]
  take = jnp.maximum(source_RL, 0)
  tokens_RL = jnp.where(source_RL >= 0, tokens_BT.reshape(b * t)[take], 0)
  routes = None
  if routes_BTLK is not None:
    flat = routes_BTLK.reshape((b * t,) + routes_BTLK.shape[2:])
    routes = jnp.where((source_RL >= 0)[..., None, None], flat[take], -1)
  model = model_of(graphdef, params)
  h_RLD, _, routing = model.decoder.forward(tokens_RL, positions_from_segments(segments_RL),
                                            segments_RL > 0, segment_ids_BT=segments_RL,
                                            routes_BTLK=routes)
  h_BND = h_RLD.reshape(-1, h_RLD.shape[-1])[unpack_BN]
  logp_BN, entropy_BN = chunked_logprobs(h_BND, model.head_VD(), tokens_BT[:, t - n:],
                                         softcap=model.cfg.logit_softcap,
                                         temperature=temperature)
  logp_BN, entropy_BN = (jnp.where(completion_mask_BN, x, 0.0) for x in (logp_BN, entropy_BN))
  loss, metrics = router_loss(model.cfg, routing, compared=routes_BTLK is not None)
  return logp_BN, entropy_BN, loss, metrics
