"""The assets of `configs/gsm8k_tiny.py` (and, with `--tools`, of `configs/gsm8k_tools.py`; with
`--tools python`, of `configs/gsm8k_code.py`), made by code (nothing is downloaded):

  DIR/train.jsonl, DIR/test.jsonl   procedural grade-school word problems in GSM8K's format
                                    (jaxrl/data/gsm8k_synth.py: worked solutions ending `#### N`)
  DIR/model/                        a Hugging Face model directory: a randomly initialised jaxrl
                                    model written by the exporter (jaxrl/models/hf.py) and a byte-
                                    level BPE tokenizer trained on the problems, with a ChatML
                                    chat template (jaxrl/data/tiny_tokenizer.py)

    python -m jaxrl.data.gsm8k_tiny --out data/gsm8k_tiny
    python -m jaxrl.data.gsm8k_tiny --out data/gsm8k_tools --tools
    python -m jaxrl.data.gsm8k_tiny --out data/gsm8k_code --tools python

`ensure(DIR)` makes them once, in a subprocess (a config file must not start JAX: the CLI sets up
its devices after reading the config); DIR appears whole or not at all.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

N_TRAIN, N_HELDOUT, SEED = 20_000, 256, 0
# SFT learns from an imperfect teacher's demonstrations (train.jsonl's `demo` field): on this
# fraction of the two-step problems it stops after the first step (gsm8k_synth.teacher_slip).
# SFT copies the habit; the verifier's reward in GRPO trains it away. Every `answer` (the worked
# solution whose `#### N` is the reference) is correct, in train.jsonl and test.jsonl.
TEACHER_ERROR = 0.5
# Small numbers keep the tiny model's arithmetic mostly right after SFT, so the teacher's slips
# are its main mistake; half the problems take two steps.
DIFFICULTY = dict(max_operand=10, max_factor=5, two_step=0.5)
# The tool variants (`--tools`, configs/gsm8k_tools.py; `--tools python`, configs/gsm8k_code.py):
# numbers too large for the tiny model's arithmetic (factors up to 99 x 999, sums of 3-digit
# numbers), no teacher slips, and worked solutions that call the calculator or run a program
# (gsm8k_synth.tool_calls).
TOOLS_DIFFICULTY = dict(max_operand=999, max_factor=99, two_step=0.5)
TOKENIZER_VOCAB = 512
# The Python variant's tags are tokens of their own (a BPE trained on `print(56*35)</python>`
# merges `)</`, and the turn's stop string would not be found); the calculator's are learnt.
TOOL_TAGS = {"python": ("<python>", "</python>", "<output>", "</output>")}
MODEL = dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384)


def make(out: str, *, n_train: int = N_TRAIN, n_heldout: int = N_HELDOUT,
         model: dict | None = None, teacher_error: float = TEACHER_ERROR,
         tools: str = "") -> None:
  """Writes the assets to `out` (atomically); `model`: ModelConfig fields over MODEL's;
  `tools`: "calculator" or "python", a tool variant."""
  from flax import nnx

  from jaxrl.data import gsm8k_synth
  from jaxrl.data.tiny_tokenizer import train_bpe
  from jaxrl.data.tokenizer import load_tokenizer
  from jaxrl.models.config import ModelConfig
  from jaxrl.models.hf_export import export, generation_config
  from jaxrl.models.transformer import LanguageModel

  tmp = f"{out.rstrip('/')}.tmp{os.getpid()}"  # several processes may make it at once
  os.makedirs(tmp)
  difficulty = gsm8k_synth.Difficulty(**(TOOLS_DIFFICULTY if tools else DIFFICULTY))
  rows = gsm8k_synth.generate(n_train + n_heldout, SEED, difficulty)
  if tools:
    rows = [{**r, "answer": gsm8k_synth.tool_calls(r["answer"], tools)} for r in rows]
    teacher_error = 0.0
  train, heldout = gsm8k_synth.split(rows, n_heldout, SEED)
  train = gsm8k_synth.with_teacher_demos(train, teacher_error, SEED)
  gsm8k_synth.write_jsonl(train, os.path.join(tmp, "train.jsonl"))
  gsm8k_synth.write_jsonl(heldout, os.path.join(tmp, "test.jsonl"))
  tok_dir = os.path.join(tmp, "tokenizer")
  train_bpe([t for r in train for t in (r["question"], r["answer"])], TOKENIZER_VOCAB, tok_dir,
            atomic=TOOL_TAGS.get(tools, ()))
  tok = load_tokenizer(tok_dir)
  vocab = -(-tok.vocab_size // 64) * 64  # a multiple of common mesh sizes
  cfg = ModelConfig(vocab_size=vocab, tie_embeddings=True, scale_tied_head=False,
                    **{**MODEL, **(model or {})})
  params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(SEED)))[1]
  export(params, cfg, os.path.join(tmp, "model"), dtype="float32", tokenizer_dir=tok_dir,
         generation_config=generation_config(tok))
  shutil.rmtree(tok_dir)
  try:
    os.rename(tmp, out)
  except OSError:  # another process got there first
    if not os.path.isdir(out):
      raise
    shutil.rmtree(tmp)


def ensure(out: str, *, tools: str = "") -> str:
  """`out`, made first (by a subprocess) if it is not there yet. The subprocess runs XLA with
  its own defaults whoever starts it (not the caller's XLA_FLAGS: the tests' lower optimisation
  level rounded the random weights otherwise, 1 ULP in 3.7% of them, and a run's held-out
  accuracy then depended on which process had made the assets)."""
  if not os.path.isdir(out):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run([sys.executable, "-m", "jaxrl.data.gsm8k_tiny", "--out", out]
                   + (["--tools", tools] if tools else []), check=True,
                   env={**env, "JAX_PLATFORMS": "cpu"})
  return out


def main(argv: list[str] | None = None) -> None:
  import argparse
  parser = argparse.ArgumentParser(prog="python -m jaxrl.data.gsm8k_tiny",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--tools", nargs="?", const="calculator", default="",
                      choices=["calculator", "python"], help="a tool variant")
  args = parser.parse_args(argv)
  make(args.out, tools=args.tools)


if __name__ == "__main__":
  main()
