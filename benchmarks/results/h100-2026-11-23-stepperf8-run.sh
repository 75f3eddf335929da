#!/bin/bash
# stepperf8 device run: suite, demo, then branch (submit's checks on lists / in one
# native call, prepare's fixed facts made once, cheaper loop-thread test and route
# lookup) and base (main at the branch point) side by side, order alternating
set -u
export PYTHONUNBUFFERED=1 OFFLOAD_ENGINE_CACHE_DIR=/tmp/oe-native
ROOT=$PWD
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
B=benchmarks/device/bench_cuda.py
P=$ROOT/benchmarks/device/probe_step_perf.py
L=$ROOT/benchmarks/device/profile_submit_local.py
{ which cc gcc; cc --version | head -1; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch,sys,numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, 'python', sys.version.split()[0])"; nproc; lscpu | grep -E "Model name|MHz"; date -u; } 2>&1 | tee $OUT/env.log
echo "== GPU suite" | tee $OUT/suite.log
PYTHONPATH=$ROOT timeout 150 python -m pytest tests/gpu tests/test_device_handler.py tests/test_integrity.py tests/test_layout.py tests/test_launch_in_submitter.py tests/test_tier_over.py tests/test_hardening.py tests/test_npu_handler.py tests/test_polled_completion.py tests/test_native_launch.py tests/test_tier_checks.py -q -p no:cacheprovider 2>&1 | tail -8 | tee -a $OUT/suite.log
echo "== demo at $(el) s" | tee -a $OUT/suite.log
PYTHONPATH=$ROOT timeout 45 python -m offload_engine demo --device cuda --quick 2>&1 | grep -i "corrupt\|native\|note\|error" | tee -a $OUT/suite.log
cpu() {
  d=$ROOT; [ $1 = base ] && d=$ROOT/base
  if [ $(el) -gt 300 ]; then echo "== cpu $1 $2 skipped at $(el) s" | tee -a $OUT/cpu.log; return; fi
  echo "== cpu ($1, round $2) at $(el) s" | tee -a $OUT/cpu.log
  (cd $d && PYTHONPATH=$d timeout 45 python $B --passes cpu --strategies staged --launch-modes loop --tokens 16 --slots allocator,random) 2>&1 | grep -E "^  cpu|Error|error" | tee -a $OUT/cpu.log
}
probe() {
  d=$ROOT; [ $1 = base ] && d=$ROOT/base
  if [ $(el) -gt 290 ]; then echo "== probe $1 skipped at $(el) s" | tee -a $OUT/probe.log; return; fi
  echo "== probe ($1) at $(el) s" | tee -a $OUT/probe.log
  (cd $d && PYTHONPATH=$d PROBE_SECTIONS=34 PROBE_SLOTS=allocator timeout 45 python $P) 2>&1 | tee -a $OUT/probe.log
}
local_profile() {  # the driverless submit profile, on this host's CPU (script from the branch)
  d=$ROOT; [ $1 = base ] && d=$ROOT/base
  if [ $(el) -gt 310 ]; then echo "== local profile $1 skipped at $(el) s" | tee -a $OUT/local.log; return; fi
  echo "== local profile ($1) at $(el) s" | tee -a $OUT/local.log
  (cd $d && PYTHONPATH=$d timeout 30 python $L --jobs 100) 2>&1 | tee -a $OUT/local.log
}
for r in 1 2; do
  order="branch base"; [ $r = 2 ] && order="base branch"
  for t in $order; do cpu $t $r; done
done
for t in branch base; do probe $t; done
for t in base branch; do local_profile $t; done
echo "== done at $(el) s" | tee -a $OUT/cpu.log
