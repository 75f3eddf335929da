#!/bin/bash
# session 6: the gemm pass with CUDA's default 8 hardware queues and with 32, two rounds in turn:
# do the bench's own streams (contiguous_ceiling's four, the GEMM's, the engines') put a load's
# DMA stream on the GEMM stream's queue?
set -u
export PYTHONUNBUFFERED=1 OFFLOAD_ENGINE_CACHE_DIR=/tmp/oe-native PYTHONPATH=$PWD
B=benchmarks/device/bench_cuda.py
date -u | tee $OUT/env.log
for r in 1 2; do
  order="8 32"; [ $r = 2 ] && order="32 8"
  for c in $order; do
    echo "== round $r, CUDA_DEVICE_MAX_CONNECTIONS=$c" | tee -a $OUT/gemm.log
    CUDA_DEVICE_MAX_CONNECTIONS=$c timeout 120 python $B --passes gemm --gemm-variants contiguous,staged:256:2,staged:512:4 --gemm-inflight 1 2>&1 | grep -E "^  |GEMM alone|Error|error" | grep -v "^  gemm" | tee -a $OUT/gemm.log
  done
done
