#!/bin/bash
# session 6, loads under a GEMM, second call: more staging buffers at the same piece size, three
# rounds with two rounds of jobs in flight; probe section 5 whole (load and store timelines)
set -u
export PYTHONUNBUFFERED=1 OFFLOAD_ENGINE_CACHE_DIR=/tmp/oe-native PYTHONPATH=$PWD
B=benchmarks/device/bench_cuda.py
V=contiguous,staged:256:2,staged:512:4,staged:384:3,staged:256:4
date -u | tee $OUT/env.log
PROBE_SECTIONS=5 timeout 120 python benchmarks/device/probe_step_perf.py > $OUT/timeline.log 2>&1
grep -E "wall" $OUT/timeline.log
for r in 1 2 3; do
  echo "== gemm round $r, 2 rounds in flight" | tee -a $OUT/gemm.log
  timeout 150 python $B --passes gemm --gemm-variants $V --gemm-inflight 2 2>&1 | grep -E "^  |GEMM alone|Error|error" | grep -v "^  gemm" | tee -a $OUT/gemm.log
done
