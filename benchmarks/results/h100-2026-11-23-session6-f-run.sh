#!/bin/bash
# session 6: small jobs' link rate by jobs in flight per handler (the bench has always used 8;
# DeviceHandlerConfig's default is 16), two rounds in turn
set -u
export PYTHONUNBUFFERED=1 OFFLOAD_ENGINE_CACHE_DIR=/tmp/oe-native PYTHONPATH=$PWD
B=benchmarks/device/bench_cuda.py
date -u | tee $OUT/env.log
for r in 1 2; do
  order="8 16 32"; [ $r = 2 ] && order="32 16 8"
  for k in $order; do
    echo "== round $r, max_inflight $k" | tee -a $OUT/bw.log
    timeout 150 python $B --passes bandwidth --strategies staged --tokens 16 --per-job 8,32 --slots allocator,random --max-inflight $k 2>&1 | grep -E "^  bw|ceiling|Error|error" | tee -a $OUT/bw.log
  done
done
