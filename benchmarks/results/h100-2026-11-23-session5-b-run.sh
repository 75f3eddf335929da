#!/bin/bash
# session 5 coordinator rerun after merging stepperf7: main (planner in C) vs base (8f70b45)
set -u
export PYTHONUNBUFFERED=1 OFFLOAD_ENGINE_CACHE_DIR=/tmp/oe-native
ROOT=$PWD
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
B=benchmarks/device/bench_cuda.py
P=$ROOT/benchmarks/device/probe_step_perf.py
{ which cc gcc; cc --version | head -1; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch,sys,numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, 'python', sys.version.split()[0])"; nproc; date -u; } 2>&1 | tee $OUT/env.log
echo "== GPU suite" | tee $OUT/suite.log
PYTHONPATH=$ROOT timeout 170 python -m pytest tests/gpu tests/test_device_handler.py tests/test_integrity.py tests/test_layout.py tests/test_launch_in_submitter.py tests/test_tier_over.py tests/test_hardening.py tests/test_npu_handler.py tests/test_polled_completion.py tests/test_native_launch.py -q -p no:cacheprovider 2>&1 | tail -8 | tee -a $OUT/suite.log
echo "== demo at $(el) s" | tee -a $OUT/suite.log
PYTHONPATH=$ROOT timeout 60 python -m offload_engine demo --device cuda --quick 2>&1 | grep -i "corrupt\|native\|note\|error" | tee -a $OUT/suite.log
cpu() {
  d=$ROOT; [ $1 = base ] && d=$ROOT/base
  echo "== cpu ($1, round $2) at $(el) s" | tee -a $OUT/cpu.log
  (cd $d && PYTHONPATH=$d timeout 60 python $B --passes cpu --strategies staged --launch-modes loop --tokens 16 --slots allocator,random) 2>&1 | grep -E "^  cpu|Error|error" | tee -a $OUT/cpu.log
}
probe() {
  d=$ROOT; [ $1 = base ] && d=$ROOT/base
  if [ $(el) -gt 400 ]; then echo "== probe $1 $2 skipped at $(el) s" | tee -a $OUT/probe.log; return; fi
  echo "== probe ($1, round $2) at $(el) s" | tee -a $OUT/probe.log
  (cd $d && PYTHONPATH=$d PROBE_SECTIONS=36 PROBE_SLOTS=allocator timeout 90 python $P) 2>&1 | tee -a $OUT/probe.log
}
for r in 1 2; do
  order="main base"; [ $r = 2 ] && order="base main"
  for t in $order; do cpu $t $r; done
  [ $r = 1 ] && for t in $order; do probe $t $r; done
done
for r in 1 2; do order="main base"; [ $r = 2 ] && order="base main"; for t in $order; do
  if [ $(el) -gt 470 ]; then echo "== bandwidth $t skipped at $(el) s" | tee -a $OUT/bw.log; continue; fi
  d=$ROOT; [ $t = base ] && d=$ROOT/base
  echo "== bandwidth ($t $r) at $(el) s" | tee -a $OUT/bw.log
  (cd $d && PYTHONPATH=$d timeout 45 python $B --passes bandwidth --strategies staged --per-job 8,32,512 --tokens 16 --slots random,allocator) 2>&1 | grep -E "ceiling|^  bw|Error|error" | tee -a $OUT/bw.log
done; done
echo "== done at $(el) s" | tee -a $OUT/bw.log
