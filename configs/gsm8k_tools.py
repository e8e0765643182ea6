"""Tool use on the CPU: GSM8K-style problems whose numbers are too large for a tiny model's
arithmetic (products up to 99 x 999, sums of 3-digit numbers), solved by calling a calculator.

The assets (jaxrl/data/gsm8k_tiny.py --tools, made on first use under data/gsm8k_tools/): the worked
solutions call the calculator, `... = <calc>56*35</calc> <result>1960</result> dollars`, and SFT
learns that form. RL then runs multi-turn (train/rollout/multiturn.py): a model turn ends at `</calc>`,
the calculator environment (jaxrl/envs) appends ` <result>1960</result>` as token ids (trained
with loss mask 0), the model goes on; a turn without a call ends the conversation, and
math-verify scores its `#### N` against the reference. Against: the same config with
`--config.rl.environment.name=` (the model writes the results itself). Numbers in
docs/algorithms.md.

Run:  .venv/bin/jaxrl-train --config=configs/gsm8k_tools.py
"""
import os

from jaxrl.config_files import sibling
from jaxrl.data.gsm8k_tiny import ensure

gsm8k_tiny = sibling(__file__, "gsm8k_tiny")

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


def tool_config(tool: str, assets: str, max_new_tokens: int):
  """gsm8k_tiny's config on the `tool` variant's assets (made under data/`assets` on first use),
  multi-turn with the environment of the same name."""
  c = gsm8k_tiny.get_config()
  directory = ensure(os.path.join(DATA, assets), tools=tool)
  c.model.update(hf_path=os.path.join(directory, "model"))
  c.data.update(train_path=os.path.join(directory, "train.jsonl"),
                heldout_path=os.path.join(directory, "test.jsonl"), max_prompt_tokens=64)
  c.rl.environment.update(name=tool, max_turns=4)
  c.rl.rollout.update(max_new_tokens=max_new_tokens)
  return c


def get_config():
  return tool_config("calculator", "gsm8k_tools", max_new_tokens=96)
