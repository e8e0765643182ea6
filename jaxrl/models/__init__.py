"""Models: the one decoder (transformer.py) in the families of families.py, its value / reward
heads, and the sampler's view of it (decoding.py)."""
from jaxrl.models.attention import KVCache, init_kv_cache
from jaxrl.models.config import ModelConfig
from jaxrl.models.rope import positions_from_valid
from jaxrl.models.transformer import LanguageModel
from jaxrl.models.value_models import RewardModel, ValueModel

__all__ = ["KVCache", "LanguageModel", "ModelConfig", "RewardModel", "ValueModel", "init_kv_cache",
           "positions_from_valid"]
