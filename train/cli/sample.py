"""`jaxrl-sample`: look at a policy.

  jaxrl-sample --model DIR --prompt TEXT [--prompt TEXT ...] [--chat] [--greedy]
      [--max_new_tokens N] [--n N] [--temperature T] [--seed S]
      prints completions of a Hugging Face directory or a jaxrl checkpoint (train/cli/model_io.py).

User errors (a missing directory, a checkpoint that does not fit) print one line and exit 2.
"""
from __future__ import annotations

import sys

from train.cli.flags import ArgParser, fail, start_jax_on_one_device


def _prompt_ids(tok, text: str, chat: bool) -> list[int]:
  if chat:  # the template writes the special tokens itself, as transformers tokenizes it
    return tok.encode(tok.chat([{"role": "user", "content": text}]), bos=False)
  return tok.encode(text, bos=True)


def main(argv: list[str] | None = None) -> int:
  parser = ArgParser(prog="jaxrl-sample", description="Print completions.")
  parser.add_argument("--model", required=True,
                      help="a Hugging Face directory or RUN/checkpoints/STAGE[/STEP]")
  parser.add_argument("--prompt", action="append", required=True)
  parser.add_argument("--chat", action="store_true", help="wrap in the chat template")
  parser.add_argument("--greedy", action="store_true")
  parser.add_argument("--max_new_tokens", type=int, default=128)
  parser.add_argument("--n", type=int, default=1)
  parser.add_argument("--temperature", type=float, default=1.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
  args = parser.parse_args(argv)
  start_jax_on_one_device()
  from train.cli.model_io import load_policy
  from jaxrl.config import ConfigError
  from sampler.methods import SamplingConfig
  from sampler.sampler import Sampler
  from train.rollout.generator import rollout_key
  try:
    policy = load_policy(args.model, dtype=args.dtype)
    tok = policy.tok
    ids = [_prompt_ids(tok, text, args.chat) for text in args.prompt]
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens, eos_id=tok.eos_id,
                         pad_id=tok.pad_id, method="greedy" if args.greedy else "temperature",
                         temperature=args.temperature,
                         stop_sequences=tuple((i,) for i in tok.stop_ids if i != tok.eos_id))
    if args.n < 1:
      raise ValueError(f"--n: expected >= 1, got {args.n}")
  except (ConfigError, ValueError) as e:
    return fail(str(e))
  sampler = Sampler(policy.graphdef, cfg, n=args.n)
  rollout = sampler.complete(policy.params, ids, rollout_key(args.seed, 0))
  p = rollout.tokens_BT.shape[1] - rollout.completion_mask_BN.shape[1]
  for i, text in enumerate(args.prompt):
    for j in range(args.n):
      row = i * args.n + j
      tokens = rollout.tokens_BT[row, p:][rollout.completion_mask_BN[row]].tolist()
      print(f"--- prompt {i}, sample {j} ({len(tokens)} tokens) from {policy.source}")
      print(tok.decode(tokens), flush=True)
  return 0


def cli() -> None:
  sys.exit(main())
