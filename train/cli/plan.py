"""`jaxrl-plan`: the planner's table of execution plans for a config, and its calibration.

  jaxrl-plan --config=configs/default.py                 # plans for this machine's devices
  jaxrl-plan --config=FILE --device=h100 --devices=256   # a cluster we do not have (simulated)
  jaxrl-plan --config=FILE --device=tpu_v5p --devices=64 --slices=2   # Multislice: DCN between
  jaxrl-plan --calibrate=cal.json                        # measure this machine, short runs, fit
  jaxrl-plan --calibration=cal.json --fit=runs/NAME      # re-fit from a finished run's trace
  --all_meshes   also trainer meshes the presets do not build (tensor axis, fsdp across nodes)
  --top=N        rows of the table (default 10); --config.a.b=V overrides as for jaxrl-train

`placement.strategy=plan` runs the first row of the presets-only table in the config's mode.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from train.cli.flags import ArgParser, UsageError, fail, parse_args


def _table(cfg, args) -> list[str]:
  import jax

  from planner.calibrate import Calibration
  from planner.cost import Workload
  from planner.plan import builtin_calibration, calibration_for
  from planner.search import search
  if args.device:
    cal = builtin_calibration(args.device)
  else:
    cal = calibration_for(cfg, jax.devices()[0], jax.local_device_count())
  if args.calibration:
    cal = Calibration.load(args.calibration)
  n = args.devices or jax.device_count()
  if args.slices > 1:  # TPU Multislice: collectives across slices take the data-center network
    if n % args.slices:
      raise UsageError(f"--slices: {args.slices} does not divide the {n} devices")
    try:
      cal = dataclasses.replace(cal, device=dataclasses.replace(cal.device,
                                                                slice_devices=n // args.slices))
    except ValueError as e:
      raise UsageError(f"--slices: {e}") from None
  ranked = search(Workload.from_config(cfg, cal.device.platform), n, cal.device, cal.efficiency,
                  presets_only=not args.all_meshes, top=args.top)
  lines = [f"{n} x {cal.device.name}, model d_model {cfg.model.d_model} x {cfg.model.n_layers} "
           f"layers, {cfg.rl.rollouts} rollouts per step:"]
  lines += [f"{i + 1:>3}. {r.step_s:10.4g} s  {r.plan.describe()}  [{r.reason}]"
            for i, r in enumerate(ranked)]
  return lines if ranked else lines + ["no plan fits in memory and splits the batches"]


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv if argv is None else argv
  parser = ArgParser(prog="jaxrl-plan", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--device", default="", help="simulate this DEVICES kind (h100, tpu_v5p..)")
  parser.add_argument("--devices", type=int, default=0, help="how many (default: this machine's)")
  parser.add_argument("--calibration", default="", help="a calibration JSON to plan with")
  parser.add_argument("--calibrate", default="", help="measure and fit, write this JSON")
  parser.add_argument("--fit", action="append", default=[], help="run dir to re-fit from")
  parser.add_argument("--slices", type=int, default=1,
                      help="TPU slices the devices are split over (Multislice)")
  parser.add_argument("--top", type=int, default=10)
  parser.add_argument("--all_meshes", action="store_true")
  args, rest = parser.parse_known_args(argv[1:])
  from sharding.host import force_cpu_devices
  force_cpu_devices(8)
  try:
    raw, gin_files, gin_params, _ = parse_args([argv[0], *rest])
    from jaxrl.config import ConfigError
    from jaxrl.config_files import with_gin
    cfg = with_gin(raw, gin_files, gin_params)
    if args.device and args.device not in _devices():
      raise UsageError(f"--device: expected one of {sorted(_devices())}, got {args.device!r}")
    if args.calibrate:
      from train.preflight.calibration import calibrate_here
      cal, samples = calibrate_here()
      cal.save(args.calibrate)
      args.calibration = args.calibration or args.calibrate
      print(f"jaxrl-plan: calibrated on {len(samples)} measurements -> {args.calibrate}")
    if args.fit:
      _refit(args)
    print("\n".join(_table(cfg, args)))
  except (UsageError, ConfigError, OSError) as e:
    return fail(str(e))
  return 0


def _devices() -> dict:
  from planner.devices import DEVICES
  return DEVICES


def _refit(args) -> None:
  from planner import calibrate as cal
  if not args.calibration:
    raise UsageError("--fit: give --calibration=FILE, the calibration to re-fit (updated in place)")
  old = cal.Calibration.load(args.calibration)
  samples = [s for run in args.fit for s in cal.samples_from_run(run, old.device)]
  new = dataclasses.replace(old, efficiency=cal.fit(samples, old.device, old.efficiency))
  new.save(args.calibration)
  print(f"jaxrl-plan: re-fitted {args.calibration} on {len(samples)} measurements from "
        f"{len(args.fit)} run(s)")


def cli() -> None:
  sys.exit(main())


if __name__ == "__main__":
  cli()
