#!/bin/bash
# session 6, loads under a GEMM: the floor (the same bytes as one contiguous pinned copy under
# the same GEMM) beside the engine, with one and two rounds of jobs in flight; then probe
# section 5 (a staged job's device timeline alone and under the GEMM)
set -u
export PYTHONUNBUFFERED=1 OFFLOAD_ENGINE_CACHE_DIR=/tmp/oe-native PYTHONPATH=$PWD
B=benchmarks/device/bench_cuda.py
V=contiguous,staged:256:2,staged:256:3,staged:512:2,dma:256:2
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader; python -c "import torch,sys,numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, 'python', sys.version.split()[0])"; date -u; } 2>&1 | tee $OUT/env.log
for r in 1 2; do
  for k in 1 2; do
    echo "== gemm round $r, $k round(s) in flight" | tee -a $OUT/gemm.log
    timeout 120 python $B --passes gemm --gemm-variants $V --gemm-inflight $k 2>&1 | grep -E "^  |GEMM alone|Error|error" | grep -v "^  gemm" | tee -a $OUT/gemm.log
  done
done
echo "== probe section 5" | tee -a $OUT/gemm.log
PROBE_SECTIONS=5 timeout 120 python benchmarks/device/probe_step_perf.py 2>&1 | tail -40 | tee -a $OUT/gemm.log
