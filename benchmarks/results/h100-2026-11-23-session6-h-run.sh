#!/bin/bash
# session 6 final check on main: the GPU suite (session 5's command plus the new
# tests/test_cuda_connections.py) and the CLI demo's byte-for-byte check
set -u
export PYTHONUNBUFFERED=1 OFFLOAD_ENGINE_CACHE_DIR=/tmp/oe-native PYTHONPATH=$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch,sys,numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, 'python', sys.version.split()[0])"; git log -1 --format=%h 2>/dev/null; date -u; } 2>&1 | tee $OUT/env.log
echo "== GPU suite" | tee $OUT/suite.log
timeout 300 python -m pytest tests/gpu tests/test_device_handler.py tests/test_integrity.py tests/test_layout.py tests/test_launch_in_submitter.py tests/test_tier_over.py tests/test_hardening.py tests/test_npu_handler.py tests/test_polled_completion.py tests/test_native_launch.py tests/test_tier_checks.py tests/test_cuda_connections.py -q -p no:cacheprovider 2>&1 | tail -5 | tee -a $OUT/suite.log
echo "== demo" | tee -a $OUT/suite.log
timeout 90 python -m offload_engine demo --device cuda --quick 2>&1 | grep -i "corrupt\|error\|loads" | tee -a $OUT/suite.log
