"""Golden per-parameter PartitionSpecs of the tiny model under the train and sampler rules.

Update `tests/golden/partition_specs.json` only when a rules table or the model's parameter
layout changes on purpose: `UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden_specs.py`,
then review the diff.
"""
import json
import os

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import LanguageModel
from sharding.mesh import param_specs
from sharding.placement import make_placement
from sharding.rules import SAMPLER_RULES, TRAIN_RULES

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "partition_specs.json")
CFG = ModelConfig(vocab_size=264, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16,
                  d_ff=64, tie_embeddings=False)


def _dump() -> dict:
  placement = make_placement("separate", 8, train_devices=4, sampler_tensor=2)
  abstract = nnx.state(nnx.eval_shape(lambda: LanguageModel(CFG, rngs=nnx.Rngs(0))))
  out = {}
  for layout, role, rules in [("train", "actor", TRAIN_RULES), ("sampler", "sampler", SAMPLER_RULES)]:
    specs = param_specs(abstract, rules, placement.mesh(role))
    # Plain strings and lists, so the file does not depend on how a jax or flax version prints.
    out[layout] = {jax.tree_util.keystr(path).removesuffix(".value"):
                   [e if e is None or isinstance(e, str) else list(e) for e in spec]
                   for path, spec in jax.tree_util.tree_leaves_with_path(
                       specs, is_leaf=lambda x: isinstance(x, PartitionSpec))}
  return out


def test_partition_specs_match_golden():
  got = _dump()
  if os.environ.get("UPDATE_GOLDEN"):
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    with open(GOLDEN, "w") as f:
      json.dump(got, f, indent=1, sort_keys=True)
  with open(GOLDEN) as f:
    assert got == json.load(f)
