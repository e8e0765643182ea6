"""Code execution on the CPU: configs/gsm8k_tools.py's problems (products up to 99 x 999, sums of
3-digit numbers), solved by running programs in the Python tool's sandbox
(jaxrl/envs/code_sandbox.py) instead of calling the calculator.

The assets (cli/gsm8k_tiny.py --tools python, made on first use under data/gsm8k_code/): the
worked solutions run a program, `... = <python>print(56*35)</python> <output>1960\\n</output>
dollars`, and SFT learns that form. RL runs multi-turn: a model turn ends at `</python>`, the
sandbox runs the program and the environment appends its output as token ids (loss mask 0).
Against: the same config with `--config.rl.environment=` (the model writes the outputs itself).
Numbers in docs/environments.md.

Run:  .venv/bin/python -m cli.train --config=configs/gsm8k_code.py
"""
import os

from cli.gsm8k_tiny import ensure
from configs import gsm8k_tiny

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                      "gsm8k_code")


def get_config():
  c = gsm8k_tiny.get_config()
  assets = ensure(ASSETS, tools="python")
  c.model.update(hf_path=os.path.join(assets, "model"))
  c.data.update(train_path=os.path.join(assets, "train.jsonl"),
                heldout_path=os.path.join(assets, "test.jsonl"), max_prompt_tokens=64)
  c.rl.update(environment="python", max_turns=4, max_new_tokens=112)
  return c
