"""`jaxrl-export`: hand a trained policy on.

  jaxrl-export --checkpoint runs/NAME/checkpoints/rl --out exported/NAME [--dtype bfloat16]
      writes a directory transformers and vLLM load as is (config.json, safetensors split at
      --max_shard_gb with an index, generation_config.json, the tokenizer's files); a LoRA
      run's adapters folded in, or with --peft only the adapters, as a PEFT adapter directory.

User errors (a missing directory, a checkpoint that does not fit) print one line and exit 2.
"""
from __future__ import annotations

import sys

from train.cli.flags import ArgParser, fail, start_jax_on_one_device


def main(argv: list[str] | None = None) -> int:
  parser = ArgParser(prog="jaxrl-export", description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", required=True,
                      help="RUN/checkpoints/STAGE (its latest step) or RUN/checkpoints/STAGE/STEP")
  parser.add_argument("--out", required=True, help="the directory to write (must not exist)")
  parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
  parser.add_argument("--max_shard_gb", type=float, default=4.0)
  parser.add_argument("--peft", action="store_true",
                      help="a LoRA run: write its adapters alone, as a PEFT adapter directory")
  args = parser.parse_args(argv)
  start_jax_on_one_device()
  from train.cli.model_io import load_policy
  from jaxrl.models.hf_export import generation_config
  from jaxrl.config import ConfigError
  from jaxrl.models.hf import HFError
  from jaxrl.models.hf_export import export, export_peft
  try:
    policy = load_policy(args.checkpoint, what="--checkpoint", merge=not args.peft)
    if args.peft:
      if policy.adapters is None:
        return fail(f"--peft: {policy.source} has no LoRA adapters (its run has lora.rank=0)")
      export_peft(policy.adapters, policy.lora, args.out, base_model=policy.base_model)
      print(f"jaxrl: exported the LoRA adapters of {policy.source} to {args.out}")
      return 0
    export(policy.params, policy.cfg, args.out, dtype=args.dtype,
           max_shard_bytes=int(args.max_shard_gb * (1 << 30)),
           tokenizer_dir=policy.tokenizer_dir or None,
           generation_config=generation_config(policy.tok, policy.tokenizer_dir))
  except (ConfigError, HFError, ValueError) as e:  # TokenizerError is a ValueError
    return fail(str(e))
  print(f"jaxrl: exported {policy.source} to {args.out}"
        + ("" if policy.tokenizer_dir else " (byte tokenizer: no tokenizer files)"))
  return 0


def cli() -> None:
  sys.exit(main())
