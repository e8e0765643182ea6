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

from jaxrl.models.attention import Tree
from jaxrl.models.lm_head import chunked_logprobs
from sampler.engine import bucket
from train.updates.forward import router_loss
from train.updates.state import model_of


@flax.struct.dataclass
class Pack:
  # Per piece, packed row r and position l: the flat index (row * T + t) into the piece's
  # [b, T] arrays of the token there; -1: padding.
  source_PRL: jax.Array
  segment_ids_PRL: jax.Array  # 1, 2, ... per packed span in a row; 0: padding
  # The segment each position's segment attends to besides itself: its own (a row's whole
  # span), or the prefix a branch shares (`share_prefix`: a group's prompt, then each row's
  # completion as a branch of it).
  parent_ids_PRL: jax.Array
  positions_PRL: jax.Array  # RoPE positions: a branch continues from its prefix's length
  copies_PRL: jax.Array  # the rows each position stands for (a shared prompt's: its rows')
  # Per piece, row b and completion slot n: the flat index (r * L + l) of the packed position
  # whose hidden state predicts that slot (slots after a row's end: its first position).
  unpack_PBN: jax.Array

  @property
  def packed_tokens(self) -> int:
    return int(np.prod(self.source_PRL.shape))


def _first_fit(sizes: list[int], length: int) -> list[list[int]]:
  """Units (indices into `sizes`) placed first-fit-decreasing into bins of `length`."""
  bins, fill = [], []
  for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
    at = next((k for k, used in enumerate(fill) if used + sizes[i] <= length), len(bins))
    if at == len(bins):
      bins.append([])
      fill.append(0)
    bins[at].append(i)
    fill[at] += int(sizes[i])
  return bins


def _units(rows: np.ndarray, prompt_lens_B, lengths_B, group: int, length: int):
  """A piece's rows (batch indices, in piece order) as units placed whole: a row alone, or
  with `group` > 1 the piece's rows of one prompt (rows g // group alike) behind one copy of
  it, as many as fit `length` tokens a unit. (member indices into `rows`, tokens)."""
  if group <= 1:
    return [([i], int(prompt_lens_B[g] + lengths_B[g])) for i, g in enumerate(rows)]
  units = []
  for prompt in dict.fromkeys(rows // group):
    members = [i for i, g in enumerate(rows) if g // group == prompt]
    p_len = int(prompt_lens_B[rows[members[0]]])
    current, size = [], p_len
    for i in members:
      extra = int(lengths_B[rows[i]])
      if current and size + extra > length:
        units.append((current, size))
        current, size = [], p_len
      current.append(i)
      size += extra
    units.append((current, size))
  return units


def plan(prompt_lens_B: np.ndarray, lengths_B: np.ndarray, *, prompt_width: int,
         completion_slots: int, pieces: int, length: int, row_buckets, group: int = 1) -> Pack:
  """The pack of a batch whose row g holds `prompt_lens_B[g]` prompt tokens (left-padded to
  `prompt_width`) and `lengths_B[g]` completion tokens, in `pieces` pieces (rows p + pieces *
  i); each piece's R rows of `length` tokens, R bucketed to `row_buckets` (the most: the
  piece's own row count). `group` > 1 (`rl.batching.share_prefix`): consecutive rows of
  `group` share their prompt, which a piece then holds once for its rows of it (a tree)."""
  p_w, n = prompt_width, completion_slots
  sizes_B = prompt_lens_B + lengths_B
  if sizes_B.max(initial=0) > length:
    raise ValueError(f"a row of {int(sizes_B.max())} tokens does not fit a packed row of "
                     f"{length}")
  b = len(sizes_B) // pieces
  rows = [np.arange(p, len(sizes_B), pieces) for p in range(pieces)]
  units = [_units(r, prompt_lens_B, lengths_B, group, length) for r in rows]
  bins = [_first_fit([size for _, size in u], length) for u in units]
  r_max = bucket(max(len(x) for x in bins), row_buckets)
  arrays = (np.full((pieces, r_max, length), -1, np.int32),
            *(np.zeros((pieces, r_max, length), np.int32) for _ in range(4)))
  unpack = np.zeros((pieces, b, n), np.int32)
  for p, piece_bins in enumerate(bins):
    for r, placed in enumerate(piece_bins):
      at, seg = 0, 1
      for u in placed:
        at, seg = _place(units[p][u][0], rows[p], (a[p, r] for a in arrays), unpack[p],
                         at, seg, r * length, prompt_lens_B, lengths_B, p_w + n, p_w)
  return Pack(*arrays, unpack)


def _place(members, rows, row_arrays, unpack_BN, at: int, seg: int, offset: int, prompt_lens_B,
           lengths_B, t: int, p_w: int) -> tuple[int, int]:
  """Writes one unit into a packed row (its source, segment, parent and position arrays) from
  position `at` with segments from `seg`: one member, a segment of its prompt and completion;
  several, their prompt once (the first member's), then each completion a branch of it. The
  members' `unpack_BN` point at the positions predicting their slots. (next position, segment)."""
  source, segments, parents, positions, copies = row_arrays
  n = unpack_BN.shape[1]
  first = rows[members[0]]
  p_len = int(prompt_lens_B[first])
  tree = len(members) > 1
  span = np.arange(p_len + (0 if tree else int(lengths_B[first])))
  source[at:at + len(span)] = members[0] * t + p_w - p_len + span
  segments[at:at + len(span)] = parents[at:at + len(span)] = seg
  positions[at:at + len(span)] = span
  copies[at:at + len(span)] = len(members)
  last = at + p_len - 1  # the prompt's last position: what predicts completion slot 0
  branch = at + len(span)
  for k, i in enumerate(members):
    size = int(lengths_B[rows[i]]) if tree else 0
    source[branch:branch + size] = i * t + p_w + np.arange(size)
    segments[branch:branch + size] = seg + 1 + k
    parents[branch:branch + size] = seg
    positions[branch:branch + size] = p_len + np.arange(size)
    copies[branch:branch + size] = 1
    # slot 0: the prompt's last; slot j > 0 in the row: the branch's token j - 1 (one member:
    # the span's p_len + j - 1); after the row's end: the unit's first position
    own = branch - 1 if tree else last
    j = np.arange(n)
    unpack_BN[i] = offset + np.where(j == 0, last,
                                     np.where(j < int(lengths_B[rows[i]]), own + j, at))
    branch += size
  return branch, seg + 1 + (len(members) if tree else 0)


def packed_logprobs(graphdef, params, tokens_BT, pack: Pack, completion_mask_BN,
                    routes_BTLK=None, temperature: float = 1.0, tree: bool = False):
  """(log-probs, entropies) [b, N] of one piece's completion slots (0 after a row's end), its
  model run over the piece's packed rows, at `temperature`; with a mixture of experts also its
  router loss and metrics, as `forward.routed_logprobs`. `tree` (`rl.batching.share_prefix`):
  the pack's branches see their prefix (the model's `TreeMask`), else each segment itself."""
  source_RL, segments_RL, positions_RL, unpack_BN = (
      x[0] for x in (pack.source_PRL, pack.segment_ids_PRL, pack.positions_PRL, pack.unpack_PBN))
  b, t = tokens_BT.shape
  n = completion_mask_BN.shape[1]
  take = jnp.maximum(source_RL, 0)
  tokens_RL = jnp.where(source_RL >= 0, tokens_BT.reshape(b * t)[take], 0)
  routes = None
  if routes_BTLK is not None:
    flat = routes_BTLK.reshape((b * t,) + routes_BTLK.shape[2:])
    routes = jnp.where((source_RL >= 0)[..., None, None], flat[take], -1)
  model = model_of(graphdef, params)
  h_RLD, _, routing = model.decoder.forward(tokens_RL, positions_RL, segments_RL > 0,
                                            segment_ids_BT=segments_RL, routes_BTLK=routes,
                                            tree=Tree(pack.parent_ids_PRL[0],
                                                      pack.copies_PRL[0]) if tree else None)
  h_BND = h_RLD.reshape(-1, h_RLD.shape[-1])[unpack_BN]
  logp_BN, entropy_BN = chunked_logprobs(h_BND, model.head_VD(), tokens_BT[:, t - n:],
                                         softcap=model.cfg.logit_softcap,
                                         temperature=temperature)
  logp_BN, entropy_BN = (jnp.where(completion_mask_BN, x, 0.0) for x in (logp_BN, entropy_BN))
  loss, metrics = router_loss(model.cfg, routing, compared=routes_BTLK is not None)
  return logp_BN, entropy_BN, loss, metrics
