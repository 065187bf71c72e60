#!/usr/bin/env bash
# Issue 12 on a lent GPU machine (the `device` tool), in few calls: the machine is bare,
# goes back 30 s after a call, and allows 10 minutes per command and 30 in all, so each
# call builds (unless the build is still there) and runs the stages it names.
#
#   bash benchmarks/gpu_session.sh build cuda ce     # call 1: build, CUDA tests, CE bandwidth
#   bash benchmarks/gpu_session.sh build gpt train   # call 2: GPT benchmarks, a bf16 run
#   bash benchmarks/gpu_session.sh build suite       # call 3: the whole suite
#
# Stages: build | cuda (every CUDA test variant) | suite (pytest -x -q, all of it) |
# ce (bench_cross_entropy.py --device cuda) | gpt (bench_gpt.py, bench_pretrain.py) |
# train (60 steps of examples/pretrain_gpt.py with --bf16 on the GPU).
# gpt and train need the corpus: run `make corpus` here and name `data` in the run's carry.
# Logs go to $OUT (at most 8 files come back); each stage prints its summary last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tpcore-gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TPCORE_CUDA_ARCHS=${TPCORE_CUDA_ARCHS:-90}
status=0

stage() { echo; echo "=== $1 ($(date -u +%H:%M:%S) UTC)"; }
# Run a command, keep its whole output in $OUT/$1.log, show its tail; remember a failure.
logged() {
  local name=$1 lines=$2
  shift 2
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "$lines" "$OUT/$name.log"
  [ $rc -eq 0 ] || { echo "!!! $name failed (exit $rc), full log in $name.log"; status=1; }
  return $rc
}

for s in "$@"; do
  case $s in
    build)
      stage "build (archs $TPCORE_CUDA_ARCHS)"
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      logged build 5 "$PY" -m pip install --no-build-isolation --no-deps --no-index -e . || exit 1
      "$PY" -c "import torch, tpcore._C as c; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(), 'tpcore built with CUDA:', c.built_with_cuda())"
      ;;
    cuda)
      stage "CUDA test variants"
      logged cuda_tests 30 "$PY" -m pytest -q -rs -p no:cacheprovider -k cuda --timeout 600 tests
      ;;
    suite)
      stage "whole suite"
      logged suite 30 "$PY" -m pytest -x -q -rs -p no:cacheprovider tests
      ;;
    ce)
      stage "cross-entropy bandwidth"
      logged ce 30 "$PY" benchmarks/bench_cross_entropy.py --device cuda
      ;;
    gpt)
      stage "GPT step and pretraining throughput"
      logged bench_gpt 25 "$PY" benchmarks/bench_gpt.py --device cuda
      logged bench_pretrain 8 "$PY" benchmarks/bench_pretrain.py --device cuda
      ;;
    train)
      stage "pretraining on the GPU, bf16"
      logged train 15 "$PY" examples/pretrain_gpt.py --config examples/gpt_small.yaml --tensor-parallel-size 1 \
        --device cuda --bf16 --train-iters 60 --log-interval 10 --eval-interval 30 --eval-iters 5 \
        --save "$OUT/ckpt" --save-interval 1000 --sample-tokens 40 --log-dir "$OUT/train_logs"
      rm -rf "$OUT/ckpt" "$OUT/train_logs"  # too many files to come back; the log has the curve
      ;;
    *)
      echo "unknown stage $s (build cuda suite ce gpt train)"
      exit 2
      ;;
  esac
done
exit $status
