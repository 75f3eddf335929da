#!/usr/bin/env bash
# A fast block device for the disk bench: ext4 on a loop device whose backing
# file lives in RAM (tmpfs), preallocated so writes never wait for tmpfs to
# allocate pages. It is not an NVMe drive: the loop driver copies every request
# in one kernel thread, so it shows what each system costs in CPU when the
# device is not the limit. Needs root.
#
#   bash benchmarks/disk/ram_device.sh up [GiB] [MOUNT]   (default 9, /tmp/ramdisk)
#   bash benchmarks/disk/ram_device.sh down [MOUNT]
#   offload-engine bench --tier disk --dir /tmp/ramdisk --chunk-mib 0.25,1,2,8 --volume-mib 256
set -euo pipefail
cmd=${1:-}
if [[ $cmd == up ]]; then
    gib=${2:-9}
    mnt=${3:-/tmp/ramdisk}
    back="$mnt.backing"
    mkdir -p "$back" "$mnt"
    mount -t tmpfs -o "size=$((gib + 1))g" tmpfs "$back"
    fallocate -l "${gib}g" "$back/disk.img"
    dev=$(losetup -f --show "$back/disk.img")
    mkfs.ext4 -q -F -E nodiscard "$dev"
    mount "$dev" "$mnt"
    echo "$mnt: ext4 on $dev, ${gib} GiB of RAM"
elif [[ $cmd == down ]]; then
    mnt=${2:-/tmp/ramdisk}
    back="$mnt.backing"
    dev=$(findmnt -n -o SOURCE "$mnt")
    umount "$mnt"
    losetup -d "$dev"
    umount "$back"
    rmdir "$mnt" "$back"
else
    echo "usage: $0 up [GiB] [MOUNT] | down [MOUNT]" >&2
    exit 2
fi
