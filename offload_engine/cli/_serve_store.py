"""``offload-engine serve-store``: a long-lived Mooncake client that holds a segment.

Mooncake Store keeps every object in the memory segments its clients mount, not
on the master: when the client that mounted a segment exits, the objects in it
are gone. A pool that outlives serving instances therefore needs a client that
lives longer than they do and mounts the memory, while the instances (vLLM's
``EngineRemoteTier`` with ``segment_bytes: 0``) mount none and only read and
write through the master. This command is that client: it joins the master,
mounts ``--segment-gib`` of its own memory, prints one line saying where it
serves, and holds the segment until SIGINT or SIGTERM, when it closes the client
(which unmounts the segment) and exits 0.

Redis needs no such holder: ``redis-server`` itself keeps the bytes.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1

GIB = 1 << 30
MIB = 1 << 20


def _gib(text: str) -> int:
    """``4`` or ``0.25`` GiB -> bytes (a whole number of MiB, at least one)."""
    try:
        mib = float(text) * 1024
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in GiB") from None
    if not mib >= 1 or mib != int(mib):
        raise argparse.ArgumentTypeError(f"{text} GiB is not a positive whole number of MiB")
    return int(mib) * MIB


def _mib(text: str) -> int:
    try:
        mib = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of MiB") from None
    if mib < 1:
        raise argparse.ArgumentTypeError(f"{mib} MiB is not positive")
    return mib * MIB


def add_parser(sub: Any, epilog: str) -> argparse.ArgumentParser:
    """Register ``serve-store`` on the command's subparsers."""
    p: argparse.ArgumentParser = sub.add_parser(
        "serve-store",
        help="hold a Mooncake Store segment that outlives serving instances (until Ctrl-C)",
        description="Join a Mooncake master and hold a memory segment of --segment-gib in "
        "this process until SIGINT or SIGTERM, so objects stored by serving instances "
        "(which then mount no segment: segment_bytes 0) survive their restarts. Prints one "
        "line saying where it serves; a clean stop unmounts the segment and exits 0. "
        "Redis needs no holder: redis-server keeps the bytes.",
        epilog=epilog,
    )
    p.add_argument(
        "--backend",
        choices=("mooncake",),
        required=True,
        help="the store whose bytes live in its clients (mooncake)",
    )
    p.add_argument(
        "--master", required=True, metavar="HOST:PORT", help="the Mooncake master's RPC address"
    )
    p.add_argument(
        "--segment-gib",
        type=_gib,
        required=True,
        metavar="N",
        help="memory this process contributes to the store, in GiB (e.g. 64, or 0.25)",
    )
    p.add_argument(
        "--local-hostname",
        default="127.0.0.1",
        metavar="HOST",
        help="the address the master and peers reach this process on (default 127.0.0.1; "
        "on a cluster, this host's address on the transfer network)",
    )
    p.add_argument(
        "--protocol",
        choices=("tcp", "rdma"),
        default="tcp",
        help="the transfer protocol (default tcp)",
    )
    p.add_argument(
        "--rdma-devices",
        default="",
        metavar="NAMES",
        help="--protocol rdma: the devices, comma-separated (e.g. mlx5_0)",
    )
    p.add_argument(
        "--metadata-server",
        default="P2PHANDSHAKE",
        metavar="URL",
        help="Mooncake's metadata service (default P2PHANDSHAKE: none)",
    )
    p.add_argument(
        "--local-buffer-mib",
        type=_mib,
        default=16 * MIB,
        metavar="N",
        help="the client's own transfer buffer, in MiB (default 16)",
    )
    p.set_defaults(func=cmd_serve_store, parser=p)
    return p


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:g} GiB" if nbytes >= GIB else f"{nbytes // MIB} MiB"


def cmd_serve_store(args: argparse.Namespace) -> int:
    from offload_engine import MooncakeStore, MooncakeStoreConfig, OffloadError

    where = args.parser.prog
    stop = threading.Event()
    got: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        got.append(signum)
        stop.set()

    # installed before the client starts, so a signal during setup still ends cleanly
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            config = MooncakeStoreConfig(
                args.master,
                local_hostname=args.local_hostname,
                segment_bytes=args.segment_gib,
                local_buffer_bytes=args.local_buffer_mib,
                protocol=args.protocol,
                rdma_devices=args.rdma_devices,
                metadata_server=args.metadata_server,
            )
            store = MooncakeStore(config)
        except OffloadError as exc:
            print(f"{where}: error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        try:
            print(
                f"{where}: holding a {_size(args.segment_gib)} Mooncake segment at "
                f"{args.local_hostname} ({args.protocol}) for master {args.master}; "
                "SIGINT or SIGTERM stops it",
                flush=True,
            )
            while not stop.wait(1.0):
                pass
        finally:
            store.close()  # unmounts the segment: the master stops placing objects in it
        name = signal.Signals(got[0]).name if got else "a signal"
        print(f"{where}: stopped on {name}; segment unmounted", flush=True)
        return EXIT_OK
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
