"""`jaxrl-eval`: a policy's accuracy, pass@k, mean reward and response length on a data set.

  jaxrl-eval --model runs/NAME/checkpoints/rl             the run's own held-out set, greedy
  jaxrl-eval --model runs/NAME/checkpoints/rl/40 --n 16 --temperature 1.0 --k 1,4,16
  jaxrl-eval --model HF_DIR --config configs/gsm8k_tiny.py --config.data.heldout_path=FILE

  --model PATH         a jaxrl checkpoint (RUN/checkpoints/STAGE, its latest step, or
                       RUN/checkpoints/STAGE/STEP) or a Hugging Face model directory
  --config FILE        the data, task, reward and placement settings (the same `data.*`, `task.*`
                       and `rl.verifier` fields as training); default: the checkpoint's run
                       config, or configs/default.py for a Hugging Face directory (whose model
                       section then comes from the directory's config.json)
  --config.a.b=VALUE   override a field, e.g. --config.data.heldout_path=test.jsonl
  --split NAME         heldout (default) or train
  --limit N            the first N examples of the split (default: all)
  --n N                samples per prompt (default 1)
  --temperature T      0 (default): greedy, which needs --n 1; else sampled at T
  --k LIST             pass@k for each k, comma-separated, each <= n (default: 1 and n)
  --solved_at S        a sample solves its prompt when its score is >= S (default 1.0)
  --seed S             the sampling seed (default 0)
  --samples FILE       every sample with its score, one JSON object per line (default: for
                       a jaxrl checkpoint RUN/eval/STAGE-STEP-SPLIT.jsonl, beside its run; for
                       a Hugging Face directory none; "" for none)

Greedy with n = 1 is exactly the training run's held-out evaluation (`heldout_acc`; the same
code, train/task/heldout.py). Prints a table, then the summary as one JSON line (the last line).
User errors print one line and exit 2.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

from absl import flags
from ml_collections import config_flags

from train.cli.flags import (UsageError, absl_argv, check_overrides, default_config, fail,
                             flag_value, load_config_file, print_help, start_jax)


def _config_arg(argv: list[str]) -> tuple[str, list[str]]:
  """(the --config FILE, or "", argv without it)."""
  path = flag_value(argv, "config") or ""  # (given twice: a UsageError)
  rest, skip = [], False
  for i, arg in enumerate(argv):
    if skip:
      skip = False
      continue
    skip = arg == "--config" and i + 1 < len(argv)
    if not (skip or arg.startswith("--config=")):
      rest.append(arg)
  return path, rest


def base_config(model: str, config_file: str):
  """The ConfigDict before overrides, and the checkpoint (stage dir, step) or None."""
  from train.cli.model_io import refuse_run_dir, run_config, split_checkpoint_path
  from jaxrl.config import ConfigError, config_dict, to_dict
  try:
    refuse_run_dir(model, "--model")
  except ConfigError as e:
    raise UsageError(str(e)) from None
  if os.path.isfile(os.path.join(model, "config.json")):  # a Hugging Face directory
    config = load_config_file(config_file or default_config())
    config.model.hf_path = os.path.abspath(model)
    return config, None
  try:
    run_dir, stage_dir, step = split_checkpoint_path(model, "--model")
    run = run_config(run_dir)
  except ConfigError as e:
    raise UsageError(str(e)) from None
  config = load_config_file(config_file) if config_file else config_dict(run)
  config.model = type(config.model)(to_dict(run.model))  # the checkpoint's model
  return config, (stage_dir, step)


def parse(argv: list[str]):
  """argv -> (locked ConfigDict with overrides, checkpoint or None, flag values)."""
  config_file, argv = _config_arg(argv)
  model = flag_value(argv, "model")
  if model is None:
    raise UsageError("--model: required (a jaxrl checkpoint or a Hugging Face directory)")
  config, checkpoint = base_config(model, config_file)
  check_overrides(config, argv)
  fv = flags.FlagValues()
  with absl_argv(argv):
    holder = config_flags.DEFINE_config_dict("config", config, flag_values=fv,
                                             lock_config=True)
    flags.DEFINE_string("model", None, "checkpoint or Hugging Face directory", flag_values=fv)
    flags.DEFINE_enum("split", "heldout", ["heldout", "train"], "which examples",
                      flag_values=fv)
    flags.DEFINE_integer("limit", 0, "the first N examples (0: all)", lower_bound=0,
                         flag_values=fv)
    flags.DEFINE_integer("n", 1, "samples per prompt", lower_bound=1, flag_values=fv)
    flags.DEFINE_float("temperature", 0.0, "0: greedy", lower_bound=0.0, flag_values=fv)
    flags.DEFINE_list("k", [], "pass@k for each k", flag_values=fv)
    flags.DEFINE_float("solved_at", 1.0, "the score that solves a prompt", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "sampling seed", lower_bound=0, flag_values=fv)
    flags.DEFINE_string("samples", None, "per-sample jsonl (default: in the run's eval/)",
                        flag_values=fv)
    fv(argv)
  return holder.value, checkpoint, fv


def _ks(fv) -> list[int]:
  try:
    ks = sorted({int(k) for k in fv.k}) if fv.k else sorted({1, fv.n})
  except ValueError:
    raise UsageError(f"--k: expected comma-separated integers, got {','.join(fv.k)!r}") from None
  if fv.temperature == 0 and fv.n != 1:
    raise UsageError(f"--n: greedy decoding (--temperature 0) gives one completion per "
                     f"prompt, got {fv.n}")
  bad = [k for k in ks if not 1 <= k <= fv.n]
  if bad:
    raise UsageError(f"--k: expected each k in [1, n={fv.n}], got {bad}")
  return ks


def _policy(ctx, checkpoint, fv) -> tuple[str, str]:
  """Loads the weights into the actor: what was loaded, for the table, and the samples' file
  (`--samples`, else a jaxrl checkpoint's RUN/eval/STAGE-STEP-SPLIT.jsonl; "": none)."""
  from jaxrl.config import ConfigError
  if checkpoint is None:
    ctx.cluster.initialize_actor()
    return fv.model, fv.samples or ""
  stage_dir, step = checkpoint
  try:
    step = ctx.cluster.load_actor(stage_dir, step=step, what="--model")
  except ValueError as e:  # none there, or it does not fit the model
    raise ConfigError(str(e)) from None
  run_dir = os.path.dirname(os.path.dirname(stage_dir))
  beside = os.path.join(run_dir, "eval", f"{os.path.basename(stage_dir)}-{step}-{fv.split}.jsonl")
  return f"{stage_dir} step {step}", beside if fv.samples is None else fv.samples


def run(raw, checkpoint, fv) -> dict:
  """The evaluation: its summary (after printing it and writing the samples)."""
  import jax

  from jaxrl.config_files import with_gin
  from train.stages.context import RunContext
  from train.task.heldout import evaluate
  ks = _ks(fv)
  cfg = with_gin(raw)
  with tempfile.TemporaryDirectory() as scratch, RunContext(cfg, scratch,
                                                           initialize=False) as ctx:
    source, samples = _policy(ctx, checkpoint, fv)
    examples = ctx.task.heldout if fv.split == "heldout" else ctx.task.train
    examples = examples[:fv.limit or None]
    result = evaluate(ctx.generator, ctx.task, ctx.judge, ctx.cluster.sampler_weights.fresh(),
                      examples, batch_size=cfg.eval.batch_size, n=fv.n,
                      temperature=fv.temperature, seed=fv.seed)
  summary = result.summary(ks, fv.solved_at)
  if jax.process_index() == 0:
    if samples:
      os.makedirs(os.path.dirname(os.path.abspath(samples)), exist_ok=True)
      with open(samples, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in result.records())
    how = "greedy" if fv.temperature == 0 else f"temperature {fv.temperature:g}"
    print(f"jaxrl-eval: {source} on {fv.split} ({len(examples)} prompts x {fv.n}, {how})")
    for key, value in summary.items():
      print(f"  {key:<20} {value:.4f}" if isinstance(value, float) else f"  {key:<20} {value}")
    if samples:
      print(f"jaxrl-eval: samples in {samples}")
    print(json.dumps({"model": source, "split": fv.split, **summary}), flush=True)
  return summary


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv if argv is None else argv
  if print_help(argv, __doc__):
    return 0
  try:
    raw, checkpoint, fv = parse(argv)
    start_jax(raw)
  except UsageError as e:
    return fail(str(e))
  from jaxrl.config import ConfigError
  try:
    run(raw, checkpoint, fv)
  except (ConfigError, UsageError, OSError) as e:
    return fail(str(e))
  return 0


def cli() -> None:
  code = main()
  from sharding.distributed import leave
  leave()  # (on several processes: a normal end, not a death for the others' peer watch)
  sys.exit(code)


if __name__ == "__main__":
  cli()
