#!/usr/bin/env bash
# offload-engine under vLLM's CUDA build: install it from a wheel folder, then run the
# end-to-end check of every mode and the time-to-first-token and decode bench.
#
#   bash benchmarks/device/vllm_gpu.sh WHEELS [--check] [--check-compiled MODE...] [--bench MODE...]
#
# Run it from the repository root on a CUDA host. WHEELS is one folder holding install.sh and
# the files of every part that the workplace's wheelhouse tool lays out on a machine with a
# registry (offline_wheelhouse.py --preset vllm-0.32-cuda --out DIR: DIR/parts/p*/, DIR/install.sh).
# vLLM, torch 2.13 and what they need go to /tmp/vllm-site (once per machine), this project
# to /tmp/oe-site; the image's own packages stay as they are.
#
#   --check               every mode eager, several engines at once on the GPU (each a small
#                         KV cache), against plain vLLM: ids and top-5 logprobs after a hit
#   --check-eager M..     the same for modes M only (lmcache is not among every mode)
#   --extra-wheels DIR    another wheel folder of the same tool, installed once into its own
#                         target (/tmp/extra-site, ahead of vLLM's on the path; with WHEELS'
#                         install.sh when DIR has none). For lmcache: --installed a freeze of
#                         the image with this preset's wheels, REQ lmcache==0.5.6
#   --check-compiled M..  the same with vLLM's default compilation and CUDA graphs, for modes M
#   --bench M..           time to first token and decode, eager, one mode after another
#   --bench-compiled M..  the same with compilation and CUDA graphs
#   --bench-args "A.."    more arguments for each bench (vllm_gpu.py bench --help), e.g.
#                         "--heads 32768 --suffixes 64 --decode-repeats 0 --profile"
#   --decode M..          decode only, eager, plain vLLM and modes M in turn, the order reversed
#                         every other round (--rounds N, default 3; --first-round R numbers them
#                         from R, so rounds can be split over several calls)
#   --decode-compiled M.. the same with compilation and CUDA graphs
#   --out DIR             results (default: $OUT, else ./vllm-gpu-out); a table is printed last
#
# Modes: plain vllm-cpu-spec engine-spec tiering-disk async-step async-polled async-nostore
#        async-lw lw-step lw-lw lmcache null (vLLM's connector path with nothing behind it)
set -uo pipefail

WHEELS=${1:?usage: vllm_gpu.sh WHEELS [--check] [--check-compiled MODE...] [--bench MODE...]}
shift
ROOT=$(pwd)
OUTDIR=${OUT:-$ROOT/vllm-gpu-out}
CHECK=0
CHECK_COMPILED=()
CHECK_EAGER=()
EXTRA=""
BENCH=()
BENCH_COMPILED=()
BENCH_ARGS=""
DECODE=()
DECODE_COMPILED=()
ROUNDS=3
FIRST_ROUND=1
list=""
while [ $# -gt 0 ]; do
    case "$1" in
        --check) CHECK=1; list="" ;;
        --check-compiled) list=CHECK_COMPILED ;;
        --check-eager) list=CHECK_EAGER ;;
        --extra-wheels) EXTRA=$2; shift ;;
        --bench) list=BENCH ;;
        --bench-compiled) list=BENCH_COMPILED ;;
        --bench-args) BENCH_ARGS=$2; shift ;;
        --decode) list=DECODE ;;
        --decode-compiled) list=DECODE_COMPILED ;;
        --rounds) ROUNDS=$2; shift ;;
        --first-round) FIRST_ROUND=$2; shift ;;
        --out) OUTDIR=$2; shift ;;
        --*) echo "vllm_gpu.sh: unknown option $1" >&2; exit 2 ;;
        *)
            [ -n "$list" ] || { echo "vllm_gpu.sh: mode $1 outside a list" >&2; exit 2; }
            eval "$list+=(\"\$1\")"
            ;;
    esac
    shift
done
mkdir -p "$OUTDIR"

SITE=/tmp/vllm-site
if [ ! -d "$SITE/vllm" ]; then
    # the image's torchvision and torchaudio are built for its own torch
    python3 -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1
    bash "$WHEELS/install.sh" "$WHEELS" "$SITE" || exit 1
fi
EXTRA_SITE=/tmp/extra-site
if [ -n "$EXTRA" ] && [ ! -f "$EXTRA_SITE/.installed" ]; then
    installer="$EXTRA/install.sh"; [ -f "$installer" ] || installer="$WHEELS/install.sh"
    bash "$installer" "$EXTRA" "$EXTRA_SITE" && touch "$EXTRA_SITE/.installed" || exit 1
fi
if [ ! -d /tmp/oe-site/offload_engine ]; then
    python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir --target /tmp/oe-site "$ROOT" \
        || exit 1
fi
export PYTHONPATH=/tmp/oe-site${EXTRA:+:$EXTRA_SITE}:$SITE
export LD_LIBRARY_PATH=$SITE/nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-/tmp/vllm-cache}
export PYTHONUNBUFFERED=1
DRIVER="$ROOT/benchmarks/device/vllm_gpu.py"
python3 -c "import torch, vllm, offload_engine; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"

MODEL=/tmp/vllm-gpu-model
[ -f "$MODEL/config.json" ] || python3 "$DRIVER" model --out "$MODEL" >/dev/null 2>&1 || exit 1

# several engines at once: each waits for its process; a failed one is reported in its log
checks() {  # $1: eager|compiled, then modes
    local how=$1; shift
    local flag=""; [ "$how" = eager ] && flag=--eager
    local pids=()
    for mode in "$@"; do
        VLLM_CACHE_ROOT=/tmp/vllm-cache/check-$how-$mode \
            python3 "$DRIVER" check --mode "$mode" --model "$MODEL" $flag \
            --out "$OUTDIR/check-$how-$mode.json" >"$OUTDIR/check-$how-$mode.log" 2>&1 &
        pids+=($!)
    done
    local i=0
    for mode in "$@"; do
        wait "${pids[$i]}" || { echo "check $how $mode failed:"; tail -25 "$OUTDIR/check-$how-$mode.log"; }
        i=$((i + 1))
    done
}

benches() {  # $1: eager|compiled, then modes
    local how=$1; shift
    local flag=""; [ "$how" = eager ] && flag=--eager
    for mode in "$@"; do
        # shellcheck disable=SC2086  # BENCH_ARGS: several arguments
        python3 "$DRIVER" bench --mode "$mode" $flag $BENCH_ARGS \
            --out "$OUTDIR/bench-$how-$mode.json" >"$OUTDIR/bench-$how-$mode.log" 2>&1 \
            || { echo "bench $how $mode failed:"; tail -25 "$OUTDIR/bench-$how-$mode.log"; }
    done
}

decodes() {  # $1: eager|compiled, then modes (plain is added first)
    local how=$1; shift
    local flag=""; [ "$how" = eager ] && flag=--eager
    local modes=(plain "$@") r order m
    for ((r = FIRST_ROUND; r < FIRST_ROUND + ROUNDS; r++)); do
        order=("${modes[@]}")
        if [ $((r % 2)) = 0 ]; then
            order=(); for ((m = ${#modes[@]} - 1; m >= 0; m--)); do order+=("${modes[$m]}"); done
        fi
        for m in "${order[@]}"; do
            python3 "$DRIVER" bench --mode "$m" $flag --heads --decode-repeats 3 --round "$r" \
                --out "$OUTDIR/decode-$how-r$r-$m.json" >"$OUTDIR/decode-$how-r$r-$m.log" 2>&1 \
                || { echo "decode $how $m round $r failed:"; tail -25 "$OUTDIR/decode-$how-r$r-$m.log"; }
        done
    done
}

ALL="plain vllm-cpu-spec engine-spec tiering-disk async-step async-lw lw-step lw-lw"
# shellcheck disable=SC2086
[ "$CHECK" = 1 ] && checks eager $ALL
[ ${#CHECK_EAGER[@]} -gt 0 ] && checks eager plain "${CHECK_EAGER[@]}"
[ ${#CHECK_COMPILED[@]} -gt 0 ] && checks compiled plain "${CHECK_COMPILED[@]}"
[ ${#BENCH[@]} -gt 0 ] && benches eager "${BENCH[@]}"
[ ${#BENCH_COMPILED[@]} -gt 0 ] && benches compiled "${BENCH_COMPILED[@]}"
[ ${#DECODE[@]} -gt 0 ] && decodes eager "${DECODE[@]}"
[ ${#DECODE_COMPILED[@]} -gt 0 ] && decodes compiled "${DECODE_COMPILED[@]}"
python3 "$DRIVER" report "$OUTDIR"
