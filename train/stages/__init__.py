"""The stages of a run, in the order they run; a run includes those its config enables.

Adding a stage: a `Stage` subclass (train/stages/base.py) in a module of its own, and one entry
here. Stages see the shared `RunContext`, never each other.
"""
from train.stages.base import Stage, StageProgress, Stopped, run_stage
from train.stages.dpo import DPOStage
from train.stages.reward_model import RewardModelStage
from train.stages.rl import RLStage
from train.stages.sft import SFTStage

STAGES: dict[str, type[Stage]] = {"sft": SFTStage, "dpo": DPOStage,
                                  "reward_model": RewardModelStage, "rl": RLStage}

__all__ = ["STAGES", "Stage", "StageProgress", "Stopped", "run_stage"]
