"""Code execution on the CPU: configs/gsm8k_tools.py's problems (products up to 99 x 999, sums of
3-digit numbers), solved by running programs in the Python tool's sandbox
(isolation/sandbox.py) instead of calling the calculator.

The assets (jaxrl/data/gsm8k_tiny.py --tools python, made on first use under data/gsm8k_code/): the
worked solutions run a program, `... = <python>print(56*35)</python> <output>1960\\n</output>
dollars`, and SFT learns that form. RL runs multi-turn: a model turn ends at `</python>`, the
sandbox runs the program and the environment appends its output as token ids (loss mask 0).
Against: the same config with `--config.rl.environment.name=` (the model writes the outputs itself).
Numbers in docs/environments.md.

Run:  .venv/bin/jaxrl-train --config=configs/gsm8k_code.py
"""
from jaxrl.config_files import sibling

tool_config = sibling(__file__, "gsm8k_tools").tool_config


def get_config():
  return tool_config("python", "gsm8k_code", max_new_tokens=112)
