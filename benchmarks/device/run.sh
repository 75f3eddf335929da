#!/usr/bin/env bash
# The GPU checks and measurements that docs/performance.md reports, in one call on a CUDA machine.
#
#   bash benchmarks/device/run.sh [options] PASS...
#
# Run it from the repository root. Every pass writes a log (and the bench passes a JSON per round)
# into the output directory. With --baseline, every bench round runs this tree and the baseline
# tree one after the other, the order alternating between rounds, so that their figures come from
# the same machine minutes apart (these machines differ by more than most changes do).
set -uo pipefail

usage() {
    cat <<'EOF'
usage: bash benchmarks/device/run.sh [options] PASS...

passes (any order; they run in the order below):
  --env          versions: GPU, driver, torch, numpy, Python, compiler, CPU cores
  --suite        the GPU test suite (bit-exact round trips of every layout x strategy)
  --demo         offload-engine demo --device cuda --quick (every load compared byte for byte),
                 and examples/layerwise_forward.py on cuda
  --bandwidth    GB/s per job size against the same-run contiguous ceiling (16-token blocks,
                 8/32/512 blocks per job, random and allocator slots): staged and dma forced,
                 then auto, in a process that has closed those engines
  --gemm         512-block jobs under a long GEMM, against the contiguous copy under that GEMM
  --cpu          CPU per job: submit in the caller's thread, launch in the launcher thread
  --step         a decode-like model step's slowdown while it stores and loads N = 4/16/32 blocks
                 each way (per-layer and cross-layer KV cache, eager and graph, default and side
                 stream; the engine's auto and dma, each also with submitter_launch and
                 polled_completion), against the same bytes as one contiguous copy (the floor);
                 step.png: slowdown against N from this tree's rounds, floor drawn in
  --gaps         the gaps between a Python thread's kernel launches while the engine keeps a
                 store and a load of 8/64/512 blocks in flight, against no engine
  --ttft         time to first token on a prefix hit (H 2k/8k/32k, N 128/512/2048): load then
                 compute, layer-wise (G 1, 2, 4 and 8 layers a job), recompute, load alone, compute
                 alone; its table is printed again at the end
  --ttft-stores  a prefill's stores of its new blocks (H 2k/8k/32k, N 128/512/2048): after the
                 forward pass, or layer-wise (G 1, 4 and 8 layers a job) as the layers finish
  --overhead     benchmarks/engine_overhead.py (the engine alone, instant handler)
  --multipath    benchmarks/device/multipath_bandwidth.py: device 0's loads and stores over its
                 own link and 1..all peers' (hosts of several GPUs), engine against the raw
                 multi-path copy of the same run
  --all          every pass above

options:
  --out DIR         where logs and JSON go (default: $OUT, else ./device-out)
  --baseline DIR    another checkout of the project (e.g. from git worktree or git archive);
                    bench passes run it beside this tree, with its own copy of the scripts
  --rounds N        rounds of each bench pass (default 2)
  --max-inflight K  jobs in flight per handler for --bandwidth (default 16, DeviceHandlerConfig's)
  --bandwidth-launch M,..  --bandwidth also with small jobs launched elsewhere than the engine's
                    loop (loop, submitter, launcher, polled, submitter-polled), rows
                    <strategy>/<mode> (this tree only: a baseline's bench may lack it)
  --timeout S       limit per command in seconds (default 300)
  --slow            run the suite's slow variants too (--run-slow)
  --dry-run         print the commands instead of running them
  -h, --help        this text

examples:
  bash benchmarks/device/run.sh --env --suite --demo
  bash benchmarks/device/run.sh --bandwidth --cpu --baseline ../before --rounds 3 --out /tmp/ab
EOF
}

ROOT=$(pwd)
OUTDIR=${OUT:-$ROOT/device-out}
BASELINE=""
ROUNDS=2
MAX_INFLIGHT=""
BANDWIDTH_LAUNCH=""
LIMIT=300
SLOW=""
DRY=""
declare -A WANT=()
PASSES=(env suite demo bandwidth gemm cpu step gaps ttft ttft-stores overhead multipath)

while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --all) for p in "${PASSES[@]}"; do WANT[$p]=1; done ;;
        --env|--suite|--demo|--bandwidth|--gemm|--cpu|--step|--gaps|--ttft|--ttft-stores|--overhead|--multipath) WANT[${1#--}]=1 ;;
        --out) OUTDIR=${2:?--out needs a directory}; shift ;;
        --baseline) BASELINE=${2:?--baseline needs a directory}; shift ;;
        --rounds) ROUNDS=${2:?--rounds needs a number}; shift ;;
        --max-inflight) MAX_INFLIGHT=${2:?--max-inflight needs a number}; shift ;;
        --bandwidth-launch) BANDWIDTH_LAUNCH=${2:?--bandwidth-launch needs modes}; shift ;;
        --timeout) LIMIT=${2:?--timeout needs seconds}; shift ;;
        --slow) SLOW=--run-slow ;;
        --dry-run) DRY=1 ;;
        *) echo "run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
if [ ${#WANT[@]} -eq 0 ]; then usage >&2; exit 2; fi
if ! [[ $ROUNDS =~ ^[1-9][0-9]*$ ]]; then echo "run.sh: --rounds must be a positive integer" >&2; exit 2; fi
if [ -n "$BASELINE" ]; then
    BASELINE=$(cd "$BASELINE" && pwd) || { echo "run.sh: no directory $BASELINE" >&2; exit 2; }
fi
if [ ! -f "$ROOT/benchmarks/device/bench_cuda.py" ]; then
    echo "run.sh: run it from the repository root" >&2; exit 2
fi
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 OFFLOAD_ENGINE_CACHE_DIR=${OFFLOAD_ENGINE_CACHE_DIR:-/tmp/oe-native}

BENCH=benchmarks/device/bench_cuda.py
# Every async test runs on asyncio and on trio. A GPU image without trio can be given its wheels:
# put them in .whl/ (pip download --no-deps for the machine's Python: trio, outcome,
# sortedcontainers, attrs, sniffio, idna) and they are unpacked to a private folder on the path.
EXTRA_PATH=""
if ! python -c "import trio" 2>/dev/null && ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    python -m pip install -q --no-index --no-deps --target /tmp/oe-site "$ROOT"/.whl/*.whl \
        && EXTRA_PATH=/tmp/oe-site
fi

# The GPU suite: tests/gpu plus the device tests that run on the real runtime when CUDA is there.
SUITE=(tests/gpu tests/test_device_handler.py tests/test_integrity.py tests/test_layout.py
       tests/test_launch_in_submitter.py tests/test_tier_over.py tests/test_hardening.py
       tests/test_npu_handler.py tests/test_polled_completion.py tests/test_native_launch.py
       tests/test_tier_checks.py tests/test_cuda_connections.py tests/test_layerwise_engine.py
       tests/test_signals.py)

# run LOG TREE CMD...: from TREE's root, with TREE's package first on the path, run CMD under the
# time limit; its output is appended to LOG and shown.
run() {
    local log=$1 tree=$2; shift 2
    echo "== [$tree] $* ($(date -u +%H:%M:%S))" | tee -a "$OUTDIR/$log"
    if [ -n "$DRY" ]; then return 0; fi
    (cd "$tree" && PYTHONPATH="$tree${EXTRA_PATH:+:$EXTRA_PATH}" timeout "$LIMIT" "$@") 2>&1 | tee -a "$OUTDIR/$log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || echo "== exit status $rc" | tee -a "$OUTDIR/$log"
    return 0
}

# bench_rounds NAME ARGS...: ROUNDS rounds of bench_cuda.py ARGS, beside the baseline if given.
bench_rounds() {
    local name=$1; shift
    local r trees
    for r in $(seq 1 "$ROUNDS"); do
        trees="$ROOT"
        if [ -n "$BASELINE" ]; then
            if [ $((r % 2)) -eq 1 ]; then trees="$ROOT $BASELINE"; else trees="$BASELINE $ROOT"; fi
        fi
        for t in $trees; do
            local tag=tree; [ "$t" = "$BASELINE" ] && tag=baseline
            run "$name.log" "$t" python "$BENCH" "$@" --json "$OUTDIR/$name-$tag-$r.json"
        done
    done
}

if [ -n "${WANT[env]:-}" ] && [ -z "$DRY" ]; then
    {
        nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
        python -c "import sys, numpy, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__, 'python', sys.version.split()[0])"
        cc --version 2>/dev/null | head -1
        echo "cores $(nproc)"; lscpu 2>/dev/null | grep -m1 "Model name"
        git -C "$ROOT" log -1 --format='commit %h %cd' 2>/dev/null
        date -u
    } 2>&1 | tee "$OUTDIR/env.log"
fi
if [ -n "${WANT[suite]:-}" ]; then
    tests=()
    for t in "${SUITE[@]}"; do
        if [ -e "$t" ]; then tests+=("$t"); else echo "== missing: $t" | tee -a "$OUTDIR/suite.log"; fi
    done
    # a GPU image may lack pytest-asyncio, whose ini options pytest then warns about (an error
    # under the project's filterwarnings); none of these tests uses it
    run suite.log "$ROOT" python -m pytest "${tests[@]}" -q -p no:cacheprovider \
        -W ignore::pytest.PytestConfigWarning $SLOW
fi
if [ -n "${WANT[demo]:-}" ]; then
    run demo.log "$ROOT" python -m offload_engine demo --device cuda --quick
    run demo.log "$ROOT" python examples/layerwise_forward.py --device cuda
fi
if [ -n "${WANT[bandwidth]:-}" ]; then
    # the guards hold for DeviceHandlerConfig's default jobs in flight (16) unless told
    extra=(--max-inflight "${MAX_INFLIGHT:-16}")
    [ -n "$BANDWIDTH_LAUNCH" ] && extra+=(--bandwidth-launch "$BANDWIDTH_LAUNCH")
    bench_rounds bandwidth --passes bandwidth --strategies staged,dma,auto --tokens 16 --per-job 8,32,512 \
        --slots random,allocator "${extra[@]}"
fi
if [ -n "${WANT[gemm]:-}" ]; then
    bench_rounds gemm --passes gemm --gemm-variants contiguous,pieces,staged:256:2,staged:512:4,dma:256:2 \
        --gemm-inflight 1
fi
if [ -n "${WANT[cpu]:-}" ]; then
    bench_rounds cpu --passes cpu --strategies staged --launch-modes loop --tokens 16 \
        --slots allocator,random
fi
if [ -n "${WANT[step]:-}" ]; then
    bench_rounds step --passes step --tokens 16 --step-strategies auto,dma --launch-modes loop,submitter-polled \
        --step-blocks 4,16,32 --step-layouts per-layer,cross-layer --step-steps 40 --reps 3
    step_json=("$OUTDIR"/step-tree-*.json)
    if [ -z "$DRY" ] && [ -e "${step_json[0]}" ]; then
        # one figure from every round of this tree: medians, bars from the lowest to the highest
        PYTHONPATH="$ROOT${EXTRA_PATH:+:$EXTRA_PATH}" python -c '
import json, sys
from pathlib import Path
from offload_engine.bench.plots import step_figure
runs = [json.load(open(f)) for f in sys.argv[2:]]
rows = [r for run in runs for r in run["rows"] if r["pass"] == "step"]
if rows:
    note = f"benchmarks/device/run.sh --step, {len(runs)} rounds"
    print("== figure:", step_figure(rows, runs[0]["device"], runs[0]["date"], Path(sys.argv[1]), note))
' "$OUTDIR/step.png" "${step_json[@]}" 2>&1 | tee -a "$OUTDIR/step.log"
    fi
fi
if [ -n "${WANT[gaps]:-}" ]; then
    bench_rounds gaps --passes gaps --gap-blocks 8,64,512 --gap-strategies auto,dma,auto/submitter-polled --reps 3
fi
if [ -n "${WANT[ttft]:-}" ]; then
    bench_rounds ttft --passes ttft --ttft-hits 2048,8192,32768 --ttft-new 128,512,2048 \
        --ttft-layers-per-load 1,2,4,8 --reps 3 --ttft-figure "$OUTDIR/ttft.png"
fi
if [ -n "${WANT[ttft-stores]:-}" ]; then
    bench_rounds ttft-stores --passes ttft-stores --ttft-hits 2048,8192,32768 \
        --ttft-new 128,512,2048 --ttft-layers-per-load 1,4,8 --reps 3
fi
if [ -n "${WANT[multipath]:-}" ]; then
    run multipath.log "$ROOT" python benchmarks/device/multipath_bandwidth.py \
        --json "$OUTDIR/multipath.json"
fi
if [ -n "${WANT[overhead]:-}" ]; then
    if [ -n "$BASELINE" ]; then
        run overhead.log "$ROOT" python benchmarks/engine_overhead.py --baseline "$BASELINE" \
            --rounds "$ROUNDS" --jobs 50000 --latency-samples 3000 --json "$OUTDIR/overhead.json"
    else
        run overhead.log "$ROOT" python benchmarks/engine_overhead.py --rounds "$ROUNDS" \
            --jobs 100000 --latency-samples 3000 --json "$OUTDIR/overhead.json"
    fi
fi
if [ -n "${WANT[ttft]:-}" ] && [ -z "$DRY" ]; then
    # the time-to-first-token tables last, one per round (and tree), from the JSON files
    for f in "$OUTDIR"/ttft-*.json; do
        [ -e "$f" ] || continue
        echo "== time to first token: $f"
        PYTHONPATH="$ROOT${EXTRA_PATH:+:$EXTRA_PATH}" python -c '
import json, sys
from offload_engine.bench.ttft import format_ttft_rows
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["pass"] == "ttft"]
print("\n".join(format_ttft_rows(rows)))
' "$f" | tee -a "$OUTDIR/ttft.log"
    done
fi
echo "== done; output in $OUTDIR"
