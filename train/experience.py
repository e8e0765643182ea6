"""The verifier stage of experience making: decode completions on the host and check them.

(The other stages, on the role meshes, are driven by train/controller.py.)"""
from __future__ import annotations

import numpy as np

from jaxrl.data.tokenizer import ByteTokenizer
from sampler.engine import Rollout


def verify(tok: ByteTokenizer, rollout: Rollout, answers, verifier) -> np.ndarray:
  """Decodes completions on the host and verifies each against its answer: [B] in {0, 1}."""
  tokens_BT = np.asarray(rollout.tokens_BT)
  p = tokens_BT.shape[1] - rollout.completion_mask_BN.shape[1]
  return np.array([verifier(tok.decode(row[p:]), a) for row, a in zip(tokens_BT, answers)],
                  np.float32)
