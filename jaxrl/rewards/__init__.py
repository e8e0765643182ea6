"""Rewards: verifiers `(response, answer) -> float` and user reward functions."""
from jaxrl.rewards.math import math_equal
from jaxrl.rewards.user import RewardFnError, call_reward_fn, load_reward_fn
from jaxrl.rewards.verifier import VERIFIERS, exact_match

__all__ = ["VERIFIERS", "RewardFnError", "call_reward_fn", "exact_match", "load_reward_fn",
           "math_equal"]
