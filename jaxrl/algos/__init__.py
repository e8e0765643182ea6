"""RL math: advantage estimators, policy losses, KL estimators; chosen by name from these dicts."""
from jaxrl.algos.advantages import ADVANTAGES
from jaxrl.algos.losses import (AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, bradley_terry_loss,
                                dpo_loss)

__all__ = ["ADVANTAGES", "AGGREGATIONS", "KL_ESTIMATORS", "POLICY_LOSSES", "bradley_terry_loss",
           "dpo_loss"]
