#!/usr/bin/env bash
# The checks that need a GPU, as one bounded run: the CUDA tests, then the accelerator benchmarks.
#   bash scripts/gpu_check.sh OUT [tests|bench|reconfig|all]
# Expects tenplex importable (the package installed, or PYTHONPATH=src) and a CUDA build of torch.
# Results land in OUT (logs and the benchmarks' JSON); copy the JSON into results/ to publish it.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT [tests|bench|reconfig|all]}
what=${2:-all}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CI=1

step() {  # step NAME SECONDS CMD...: run with a time limit, log to OUT/NAME.log, say how it ended
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}

if [[ $what == tests || $what == all ]]; then
  nvidia-smi -L
  $py -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
  df -h /dev/shm
  step tests 240 $py -m pytest -q -p no:cacheprovider -rs tests/test_datapath.py tests/test_train_cli.py
fi
if [[ $what == bench || $what == all ]]; then
  step bench_cuda 240 $py benchmarks/bench_cuda.py --size 2 --out "$out/bench_cuda.json"
  step bench_snapshot 240 $py benchmarks/bench_snapshot.py --device cuda --dp 1 \
    --out "$out/bench_snapshot_cuda.json"
fi
if [[ $what == reconfig || $what == all ]]; then
  step bench_reconfig 420 $py benchmarks/bench_reconfig.py --out "$out/bench_reconfig_gpu_host.json"
fi
