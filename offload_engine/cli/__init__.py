"""The ``offload-engine`` command (also ``python -m offload_engine``).

Subcommands: ``info`` (runtimes on this machine), ``demo`` (a serving loop in
miniature), ``bench`` (transfer benchmarks, a JSON report and figures) and
``serve-store`` (a long-lived Mooncake client that holds a memory segment).

Exit status: 0 success; 1 the run failed (a failed job, corrupt bytes, a file
that could not be written, sizes that do not fit in memory, threads the system
would not start); 2 usage error (argparse prints the usage; also a ``bench --dir``
that is not a directory, or a ``-o`` under a file); 3 the requested
device or backend is unavailable (for example ``--device cuda`` without CUDA,
``--tier remote`` without its client library); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from offload_engine.bench.rigs import DEVICES
from offload_engine.errors import (
    ConfigError,
    InsufficientMemoryError,
    JobFailedError,
    RuntimeUnavailableError,
    TierUnavailableError,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C

# --workers, --queue-depth: well above any setting the benchmarks use, so that a typo
# is refused up front instead of asking the system for 100,000 threads
MAX_THREADS = 256

_EPILOG = (
    "exit status: 0 success, 1 the run failed (failed job, corrupt bytes, unwritable file, "
    "sizes that do not fit in memory, threads the system would not start), 2 usage error, "
    "3 the requested device or backend is unavailable, 130 interrupted (Ctrl-C)"
)

# bench options that only one --tier reads: given with another tier, they are refused
_TIER_OPTIONS = {
    "--dir": "disk",
    "--queue-depth": "disk",
    "--chunk-kib": "disk",
    "--volume-mib": "disk",
    "--chunk-mib": "disk",
    "--backend": "remote",
}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def thread_count(text: str) -> int:
    """A positive number of threads, at most :data:`MAX_THREADS`."""
    value = positive_int(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"{value} threads is too many (at most {MAX_THREADS})")
    return value


class _Given(argparse.Action):
    """Stores the value and records the option in ``given_options``: options with a
    default cannot otherwise be told apart from options not given."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        given: frozenset[str] = getattr(namespace, "given_options", frozenset())
        namespace.given_options = given | {self.option_strings[-1]}


def _mib_list(text: str) -> list[int]:
    """``0.25,2,8`` -> chunk sizes in bytes (whole KiB, at least one)."""
    sizes: list[int] = []
    for part in text.split(","):
        try:
            kib = float(part) * 1024
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a size in MiB") from None
        if kib < 1 or kib != int(kib):
            raise argparse.ArgumentTypeError(f"{part} MiB is not a positive whole number of KiB")
        sizes.append(int(kib) * 1024)
    return sizes


def _add_device(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--device", choices=DEVICES, default="auto", help=help)


def build_parser() -> argparse.ArgumentParser:
    from offload_engine import __version__
    from offload_engine.cli import _bench, _demo, _info, _serve_store

    parser = argparse.ArgumentParser(
        prog="offload-engine",
        description="Move KV-cache blocks between memory tiers.",
        epilog=_EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    # not required=True: main() reports unknown options before a missing command
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    info = sub.add_parser(
        "info",
        help="show the runtimes on this machine (CUDA, NPU, CPU) and their copy strategies",
        description="Show the runtimes on this machine, their devices and copy strategies, "
        "and why any is unavailable.",
        epilog=_EPILOG,
    )
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.set_defaults(func=_info.cmd_info, parser=info)

    demo = sub.add_parser(
        "demo",
        help="run a serving loop in miniature through the engine and check every load",
        description="Simulate a serving loop: each scheduling step stores new KV blocks and "
        "loads a prefix hit through the engine. Every load, when it completes, is compared "
        "byte for byte with the KV-cache blocks it was stored from. Ends with GB/s per "
        "direction, CPU time per step and job latency.",
        epilog=_EPILOG,
    )
    _add_device(
        demo,
        "where the KV cache lives: auto (default: the GPU if usable, else host memory), "
        "cuda (the GPU, or exit 3), cpu (host memory)",
    )
    demo.add_argument(
        "--steps",
        type=positive_int,
        help=f"scheduling steps (default {_demo.STEPS}, {_demo.QUICK_STEPS} with --quick)",
    )
    demo.add_argument("--quick", action="store_true", help="a short run (CI-sized)")
    demo.add_argument(
        "--blocks-per-job",
        type=positive_int,
        default=8,
        help=f"blocks per store and per load (default 8, at most {_demo.MAX_BLOCKS_PER_JOB})",
    )
    demo.add_argument("--layers", type=positive_int, default=8, help="KV layers (default 8)")
    demo.add_argument(
        "--workers",
        type=thread_count,
        default=2,
        help=f"host copy threads (default 2, at most {MAX_THREADS})",
    )
    demo.add_argument(
        "--max-outstanding",
        type=positive_int,
        default=16,
        help="jobs in flight before a step waits for the oldest (default 16); a step also "
        "waits for the oldest when in-flight jobs hold the tier or cache blocks it needs",
    )
    demo.set_defaults(func=_demo.cmd_demo, parser=demo)

    bench = sub.add_parser(
        "bench",
        help="benchmark transfers on the hardware present; write a JSON report and PNG plots",
        description="Benchmark transfers: host memory always (GB/s against blocks per job, "
        "job latency, engine overhead), the GPU when CUDA is usable. Writes report.json, "
        "throughput.png and latency.png into the output directory.",
        epilog=_EPILOG,
    )
    _add_device(
        bench,
        "which cases run besides the host ones: auto (default: GPU cases if usable), "
        "cuda (GPU cases, or exit 3), cpu (host cases only)",
    )
    bench.add_argument(
        "-o",
        "--output-dir",
        default="bench-out",
        metavar="DIR",
        help="where to write the report and figures (default ./bench-out)",
    )
    bench.add_argument(
        "--quick", action="store_true", help="small sizes and few jobs (CI-sized, seconds)"
    )
    bench.add_argument(
        "--workers",
        type=thread_count,
        default=2,
        help=f"host copy threads (default 2, at most {MAX_THREADS})",
    )
    bench.add_argument(
        "--machine-label",
        metavar="TEXT",
        help="how the figures name the machine (default: CPU, cores, memory, GPUs, torch)",
    )
    bench.add_argument(
        "--tier",
        choices=("host", "disk", "remote"),
        default="host",
        help="host (default): host-memory and GPU cases; disk: the disk tier against fio and "
        "vLLM's fs tier in --dir; remote: a remote store against its raw client, on a server "
        "started on 127.0.0.1 (--backend)",
    )
    bench.add_argument(
        "--backend",
        choices=("redis", "mooncake", "both"),
        default="redis",
        action=_Given,
        help="--tier remote: the store (default redis)",
    )
    bench.add_argument(
        "--dir",
        default=".",
        action=_Given,
        metavar="DIR",
        help="--tier disk: an existing directory on the drive to measure (default .)",
    )
    bench.add_argument(
        "--queue-depth",
        type=thread_count,
        default=None,
        action=_Given,
        help="--tier disk: I/O threads per direction, and fio's numjobs (default: the disk "
        f"tier's own default for --dir, derived from its block device; at most {MAX_THREADS})",
    )
    bench.add_argument(
        "--chunk-kib",
        type=positive_int,
        default=None,
        action=_Given,
        help="--tier disk: bytes per chunk (one object), in KiB (default 2048, 1024 with --quick)",
    )
    bench.add_argument(
        "--volume-mib",
        type=positive_int,
        default=None,
        action=_Given,
        help="--tier disk: bytes each system writes and reads per chunk size, in MiB "
        "(default 512, 32 chunks with --quick; more gives steadier figures on a noisy drive)",
    )
    bench.add_argument(
        "--chunk-mib",
        type=_mib_list,
        default=None,
        action=_Given,
        metavar="SIZES",
        help="--tier disk: chunk sizes in MiB, comma-separated (e.g. 0.25,2,8), one run each, "
        "ratios per size (overrides --chunk-kib)",
    )
    bench.add_argument(
        "--ttft-stores",
        action="store_true",
        help="with the GPU cases: also the store pass, a prefill's new blocks stored after the "
        "forward pass or layer by layer during it (offload_engine.bench.ttft_stores)",
    )
    bench.set_defaults(func=_bench.cmd_bench, parser=bench, given_options=frozenset())
    _serve_store.add_parser(sub, _EPILOG)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (bad usage exits 2 via argparse)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.error("the following arguments are required: COMMAND")
    command: argparse.ArgumentParser = args.parser  # the subcommand's, for its usage line
    if extra:
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    _check_combinations(args, command)
    where = command.prog
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        failure = _failure(exc, args)
        if failure is None:
            raise
        status, why = failure
        print(f"{where}: error: {why}", file=sys.stderr)
        return status


def _failure(exc: Exception, args: argparse.Namespace) -> tuple[int, str] | None:
    """The exit status and one-line reason for an error the command reports itself;
    None for any other (a bug: its traceback is wanted)."""
    device = f"--device {args.device}: " if getattr(args, "device", "auto") != "auto" else ""
    layers = f"--layers {args.layers}: " if args.command == "demo" else ""
    found: tuple[int, str] | None = None
    if isinstance(exc, RuntimeUnavailableError):
        found = EXIT_UNAVAILABLE, f"{device}{exc}"
    elif isinstance(exc, ConfigError | TierUnavailableError):  # a backend or store, unusable
        found = EXIT_UNAVAILABLE, f"{_tier_flags(args)}{exc}"
    elif isinstance(exc, InsufficientMemoryError):
        found = EXIT_FAILED, f"{layers}{exc}"
    elif isinstance(exc, JobFailedError):
        found = EXIT_FAILED, f"a transfer failed: {exc}"
    elif isinstance(exc, OSError):
        found = EXIT_FAILED, str(exc)
    elif isinstance(exc, RuntimeError) and _thread_start_failed(exc):
        found = (
            EXIT_FAILED,
            (
                f"{_thread_flags(args)}the system would not start another thread ({exc}); "
                "ask for fewer threads or raise the process limit (ulimit -u)"
            ),
        )
    return found


def _check_combinations(args: argparse.Namespace, command: argparse.ArgumentParser) -> None:
    """Refuse (exit 2) option values that parse but the command could not honour."""
    if args.command == "demo":
        from offload_engine.cli._demo import MAX_BLOCKS_PER_JOB

        if args.blocks_per_job > MAX_BLOCKS_PER_JOB:
            command.error(
                f"--blocks-per-job {args.blocks_per_job} is too large "
                f"(at most {MAX_BLOCKS_PER_JOB})"
            )
    if args.command == "bench":
        for option in sorted(args.given_options):
            tier = _TIER_OPTIONS[option]
            if args.tier != tier:
                command.error(f"{option} is for --tier {tier}, not --tier {args.tier}")
        if args.ttft_stores and (args.tier != "host" or args.device == "cpu"):
            command.error(
                "--ttft-stores is a GPU pass: not with --tier disk/remote or --device cpu"
            )
        if args.tier == "disk" and not Path(args.dir).is_dir():
            command.error(f"--dir {args.dir} is not a directory")
        out = Path(args.output_dir)
        blocked = _not_a_directory(out)
        if blocked is not None:
            where = "" if blocked == out else f": {blocked}"
            command.error(f"-o {args.output_dir}{where} is not a directory")


def _not_a_directory(path: Path) -> Path | None:
    """The part of ``path`` (itself, or a folder above it) that exists but is not a
    directory, so that ``path`` cannot be a directory to write into; None if there is none."""
    for where in (path, *path.parents):
        if where.exists():
            return None if where.is_dir() else where
    return None


def _tier_flags(args: argparse.Namespace) -> str:
    tier = getattr(args, "tier", "host")
    if tier == "remote":
        return f"--tier remote --backend {args.backend}: "
    if tier == "disk":
        return f"--tier disk --dir {args.dir}: "
    return ""


def _thread_flags(args: argparse.Namespace) -> str:
    if getattr(args, "tier", "host") == "disk":
        return f"--queue-depth {args.queue_depth or 'derived'}: "
    return f"--workers {args.workers}: " if hasattr(args, "workers") else ""


def _thread_start_failed(exc: RuntimeError) -> bool:
    # threading.Thread.start raises RuntimeError("can't start new thread") when the
    # system refuses one (the process or user thread limit, or memory for its stack)
    return "can't start new thread" in str(exc)


if __name__ == "__main__":
    sys.exit(main())
