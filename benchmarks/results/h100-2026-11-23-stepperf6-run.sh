#!/bin/bash
# stepperf6 final device run: suite, demo, then branch (native launch on by default) and base side by side
set -u
export PYTHONUNBUFFERED=1 OFFLOAD_ENGINE_CACHE_DIR=/tmp/oe-native
ROOT=$PWD
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
B=benchmarks/device/bench_cuda.py
P=$ROOT/benchmarks/device/probe_step_perf.py
{ which cc gcc; cc --version | head -1; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch,sys,numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, 'python', sys.version.split()[0])"; date -u; git -C $ROOT log -1 --format=%H 2>/dev/null; } 2>&1 | tee $OUT/env.log
echo "== GPU suite" | tee $OUT/suite.log
PYTHONPATH=$ROOT timeout 150 python -m pytest tests/gpu tests/test_device_handler.py tests/test_integrity.py tests/test_layout.py tests/test_launch_in_submitter.py tests/test_tier_over.py tests/test_hardening.py tests/test_npu_handler.py tests/test_polled_completion.py tests/test_native_launch.py -q -p no:cacheprovider 2>&1 | tail -5 | tee -a $OUT/suite.log
echo "== demo at $(el) s" | tee -a $OUT/suite.log
PYTHONPATH=$ROOT timeout 60 python -m offload_engine demo --device cuda --quick 2>&1 | grep -i "corrupt\|native\|note" | tee -a $OUT/suite.log
PYTHONPATH=$ROOT timeout 30 python -c "
from offload_engine.runtimes.cuda import CudaRuntime; rt = CudaRuntime(); p = rt.native_program(); print('native program', type(p).__name__, 'notes', rt.notes)" 2>&1 | tee -a $OUT/suite.log
for t in branch base; do
  d=$ROOT; [ $t = base ] && d=$ROOT/base
  echo "== probe ($t) at $(el) s" | tee -a $OUT/probe.log
  (cd $d && PYTHONPATH=$d PROBE_SECTIONS=36 PROBE_SLOTS=allocator timeout 100 python $P) 2>&1 | grep -v "^1\.\|^2\." | tee -a $OUT/probe.log
done
for t in branch base; do
  d=$ROOT; [ $t = base ] && d=$ROOT/base
  echo "== cpu ($t) at $(el) s" | tee -a $OUT/cpu.log
  (cd $d && PYTHONPATH=$d timeout 60 python $B --passes cpu --strategies staged --launch-modes loop --tokens 16 --slots allocator,random) 2>&1 | grep -E "^  cpu|Error|error" | tee -a $OUT/cpu.log
done
for r in 1 2; do
  order="branch base"; [ $r = 2 ] && order="base branch"
  for t in $order; do
    if [ $(el) -gt 330 ]; then echo "== bandwidth $t $r skipped at $(el) s" | tee -a $OUT/bw.log; continue; fi
    d=$ROOT; [ $t = base ] && d=$ROOT/base
    echo "== bandwidth ($t $r) at $(el) s" | tee -a $OUT/bw.log
    (cd $d && PYTHONPATH=$d timeout 70 python $B --passes bandwidth --strategies staged --per-job 8,32,512 --tokens 16 --slots random,allocator) 2>&1 | grep -E "ceiling|^  bw|Error|error" | tee -a $OUT/bw.log
  done
done
for t in branch base; do
  if [ $(el) -gt 450 ]; then echo "== step $t skipped at $(el) s" | tee -a $OUT/step.log; continue; fi
  d=$ROOT; [ $t = base ] && d=$ROOT/base
  echo "== step ($t) at $(el) s" | tee -a $OUT/step.log
  (cd $d && PYTHONPATH=$d timeout 75 python $B --passes step --tokens 16 --step-strategies auto --launch-modes loop,submitter-polled --step-steps 40 --reps 3) 2>&1 | grep -E "^  step|Error|error" | tee -a $OUT/step.log
done
echo "== done at $(el) s"
# then a log summariser (not kept) wrote $OUT/table.log: h100-2026-11-23-stepperf6-table.log
