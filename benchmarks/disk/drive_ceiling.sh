#!/usr/bin/env bash
# What the drive under DIR gives at all, whoever asks: fio with libaio (many
# requests in flight from one thread, no per-request syscall), O_DIRECT,
# sequential write then read of one file, in 1 MiB and 8 MiB requests at
# queue depths 4, 16 and 64. The disk bench's systems are held to this.
#
#   bash benchmarks/disk/drive_ceiling.sh DIR [MiB, default 2048]
set -euo pipefail
dir=${1:?usage: $0 DIR [MiB]}
mib=${2:-2048}
work="$dir/drive-ceiling-$$"
mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
gbps() { python3 -c "import json,sys;d=json.load(sys.stdin)['jobs'][0]['$1'];print(round(d['io_bytes']/d['runtime']/1e6,2))"; }
for bs in 1m 8m; do
    for qd in 4 16 64; do
        w=$(fio --name=ceiling --directory="$work" --rw=write --bs=$bs --size=${mib}m --ioengine=libaio \
            --iodepth=$qd --direct=1 --fallocate=none --output-format=json | gbps write)
        r=$(fio --name=ceiling --directory="$work" --rw=read --bs=$bs --size=${mib}m --ioengine=libaio \
            --iodepth=$qd --direct=1 --output-format=json | gbps read)
        echo "bs=$bs iodepth=$qd write $w GB/s read $r GB/s"
        rm -f "$work"/*
    done
done
