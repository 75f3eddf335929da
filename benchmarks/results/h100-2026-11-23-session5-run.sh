#!/bin/bash
set -u
export PYTHONUNBUFFERED=1 OFFLOAD_ENGINE_CACHE_DIR=/tmp/oe-native
ROOT=$PWD
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
B=benchmarks/device/bench_cuda.py
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch,sys,numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, 'python', sys.version.split()[0])"; date -u; which fio; lsblk -d -o NAME,ROTA,SIZE,MODEL; df -h /tmp | tail -1; } 2>&1 | tee $OUT/env.log
echo "== GPU suite" | tee $OUT/suite.log
PYTHONPATH=$ROOT timeout 200 python -m pytest tests/gpu tests/test_device_handler.py tests/test_integrity.py tests/test_layout.py tests/test_launch_in_submitter.py tests/test_tier_over.py tests/test_hardening.py tests/test_npu_handler.py tests/test_polled_completion.py tests/test_native_launch.py -q -p no:cacheprovider 2>&1 | tail -4 | tee -a $OUT/suite.log
echo "== demo at $(el) s" | tee -a $OUT/suite.log
PYTHONPATH=$ROOT timeout 60 python -m offload_engine demo --device cuda --quick 2>&1 | grep -i "corrupt\|native" | tee -a $OUT/suite.log
for r in 1 2; do
  order="main base"; [ $r = 2 ] && order="base main"
  for t in $order; do
    if [ $(el) -gt 420 ]; then echo "== step $t $r skipped at $(el) s" | tee -a $OUT/step.log; continue; fi
    d=$ROOT; [ $t = base ] && d=$ROOT/base
    echo "== step ($t $r) at $(el) s" | tee -a $OUT/step.log
    (cd $d && PYTHONPATH=$d timeout 80 python $B --passes step --tokens 16 --step-strategies auto --launch-modes loop,submitter-polled --step-steps 40 --reps 3) 2>&1 | grep -E "^  step|Error|error" | tee -a $OUT/step.log
  done
done
echo "== done at $(el) s"
