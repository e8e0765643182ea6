"""Models: the Llama-style decoder and its value / reward heads."""
from jaxrl.models.heads import RewardModel, ValueModel
from jaxrl.models.llama import KVCache, LanguageModel, ModelConfig, init_kv_cache, positions_from_valid

__all__ = ["KVCache", "LanguageModel", "ModelConfig", "RewardModel", "ValueModel", "init_kv_cache",
           "positions_from_valid"]
