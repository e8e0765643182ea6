#!/usr/bin/env bash
# jaxrl on a TPU pod slice: the same command on every TPU VM worker (docs/launch.md).
#
# From your workstation, fan out to every worker of the slice (each has the repo at the same
# path, with its .venv made by `make run` or `pip install -e ".[tpu]"`):
#   JAXRL_TPU=my-v5p-64 JAXRL_ZONE=us-east5-a launch/tpu_pod.sh --config=configs/qwen2_5_7b_gsm8k.py
# On one worker (what the fan-out runs on each): the config and its overrides, as for jaxrl-train:
#   launch/tpu_pod.sh --config=configs/qwen2_5_7b_gsm8k.py --config.run_dir=/mnt/shared/runs
#
# jax.distributed finds the coordinator, the process count and this worker's id from the TPU
# metadata itself. JAXRL_COORDINATOR / JAXRL_NUM_PROCESSES / JAXRL_PROCESS_ID set them
# explicitly instead (e.g. 2 local processes on a CPU, as tests/test_multihost.py runs this file).
# JAXRL_PYTHON picks the interpreter (default: the repo's .venv, else python3); JAXRL_DIR the
# repo path on the workers (default: this checkout's). Resume: the same command plus --resume.
set -euo pipefail
repo="${JAXRL_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"

if [[ -n "${JAXRL_TPU:-}" ]]; then  # the fan-out: this script again on every worker
  args=$(printf '%q ' "$@")
  exec gcloud compute tpus tpu-vm ssh "$JAXRL_TPU" --zone "${JAXRL_ZONE:?set JAXRL_ZONE}" \
    ${JAXRL_PROJECT:+--project "$JAXRL_PROJECT"} --worker=all \
    --command "cd $(printf '%q' "$repo") && JAXRL_PYTHON=${JAXRL_PYTHON:-} launch/tpu_pod.sh $args"
fi

cd "$repo"
python="${JAXRL_PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
exec "$python" -m train.cli.train "$@"
