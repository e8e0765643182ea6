"""Packed SFT rows: each segment is trained exactly as if it were alone in its row."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.data.pipeline import (Encoding, _sft_row, pack_rows, prompt_length, sft_dataset,
                                 target_length)
from jaxrl.data.tasks import make_splits
from jaxrl.data.tokenizer import ByteTokenizer
from jaxrl.models.transformer import LanguageModel
from jaxrl.models.rope import positions_from_segments
from train.updates.forward import token_logprobs


def test_positions_restart_per_segment():
  seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0]])
  np.testing.assert_array_equal(positions_from_segments(seg), [[0, 1, 2, 0, 1, 0, 0, 1]])


def test_packed_logprobs_equal_unpacked(tiny_cfg):
  tok = ByteTokenizer()
  enc = Encoding(tok)
  train, _ = make_splits("addition", 2, 40, 4, seed=0)
  rows = pack_rows(train, enc, row_len=48, seed=0)
  assert sum(int(r["segment_ids"].max()) for r in rows) == len(train)  # nothing dropped
  assert all(r["loss_mask"].sum() > 0 for r in rows)
  graphdef, params = nnx.split(LanguageModel(tiny_cfg, rngs=nnx.Rngs(0)))
  row = rows[0]
  logp_packed, _ = token_logprobs(graphdef, params, jnp.asarray(row["tokens"])[None],
                                        jnp.asarray(row["valid"])[None],
                                        jnp.asarray(row["segment_ids"])[None])
  seq_len = prompt_length(train, enc) + target_length(train, enc)
  by_text = {e.prompt + e.target: e for e in train}
  for seg in range(1, int(row["segment_ids"].max()) + 1):
    where = np.flatnonzero(row["segment_ids"] == seg)
    ex = by_text[tok.decode(row["tokens"][where])]
    alone = _sft_row(ex, enc, seq_len)
    logp_alone, _ = token_logprobs(graphdef, params, jnp.asarray(alone["tokens"])[None],
                                         jnp.asarray(alone["valid"])[None])
    n = len(where)
    # Targets inside the segment (next-token predictions from its own tokens).
    np.testing.assert_allclose(logp_packed[0, where[0]:where[0] + n - 1], logp_alone[0, :n - 1],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(row["loss_mask"][where], alone["loss_mask"][:n])


def test_packed_dataset_and_length_error():
  tok = ByteTokenizer()
  enc = Encoding(tok)
  train, _ = make_splits("addition", 2, 64, 4, seed=0)
  batch = next(iter(sft_dataset(train, enc, batch_size=4, seq_len=0, seed=0, pack_length=64)))
  assert batch["tokens"].shape == (4, 64) and batch["segment_ids"].max() >= 5
  with pytest.raises(ValueError, match="sft.pack_length: example"):
    pack_rows(train, enc, row_len=5, seed=0)
