#!/bin/bash
# session 5 coordinator check after merging stepperf8: GPU suite on main (d35f835), then the
# cpu pass, main beside base (df24905, before stepperf8), two rounds alternating order
set -u
export PYTHONUNBUFFERED=1 OFFLOAD_ENGINE_CACHE_DIR=/tmp/oe-native
ROOT=$PWD
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
B=benchmarks/device/bench_cuda.py
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch,sys,numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, 'python', sys.version.split()[0])"; date -u; } 2>&1 | tee $OUT/env.log
echo "== GPU suite" | tee $OUT/suite.log
PYTHONPATH=$ROOT timeout 170 python -m pytest tests/gpu tests/test_device_handler.py tests/test_integrity.py tests/test_layout.py tests/test_launch_in_submitter.py tests/test_tier_over.py tests/test_hardening.py tests/test_npu_handler.py tests/test_polled_completion.py tests/test_native_launch.py tests/test_tier_checks.py -q -p no:cacheprovider 2>&1 | tail -3 | tee -a $OUT/suite.log
echo "== demo at $(el) s" | tee -a $OUT/suite.log
PYTHONPATH=$ROOT timeout 60 python -m offload_engine demo --device cuda --quick 2>&1 | grep -i "corrupt\|error" | tee -a $OUT/suite.log
for r in 1 2; do
  order="main base"; [ $r = 2 ] && order="base main"
  for t in $order; do
    d=$ROOT; [ $t = base ] && d=$ROOT/base
    echo "== cpu ($t, round $r) at $(el) s" | tee -a $OUT/cpu.log
    (cd $d && PYTHONPATH=$d timeout 60 python $B --passes cpu --strategies staged --launch-modes loop --tokens 16 --slots allocator,random) 2>&1 | grep -E "^  cpu|Error|error" | tee -a $OUT/cpu.log
  done
done
echo "== done at $(el) s" | tee -a $OUT/cpu.log
