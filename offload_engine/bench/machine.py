"""What machine a figure was measured on: CPU, cores, memory, GPUs, versions."""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from offload_engine.errors import InsufficientMemoryError


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def available_memory_bytes() -> int | None:
    """Host memory available to a new allocation (Linux ``MemAvailable``), or None if unknown."""
    meminfo = Path("/proc/meminfo")
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def memory_size(nbytes: float) -> str:
    """A memory size for people, one decimal: ``0.2 GiB``, ``23.5 GiB``, ``3.1 TiB``, ``2.2 PiB``.

    GiB below 1,024 GiB (the unit of the machine's memory), then TiB, PiB, EiB.
    """
    value, unit = nbytes / 2**30, "GiB"
    for bigger in ("TiB", "PiB", "EiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def check_host_memory(need: int, what: str, *, available: int | None = None) -> None:
    """Raise :class:`~offload_engine.errors.InsufficientMemoryError` if ``need`` bytes
    do not fit in the host memory available (``available`` defaults to what the
    machine reports; nothing is checked when it reports nothing).
    ``what`` starts the message: ``"<what> need(s) 3.1 TiB of host memory"``."""
    have = available_memory_bytes() if available is None else available
    if have is not None and need > have:
        raise InsufficientMemoryError(
            f"{what} {memory_size(need)} of host memory, but only {memory_size(have)} is available"
        )


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Machine:
    """The machine a benchmark ran on."""

    cpu: str
    cores: int
    memory_bytes: int
    gpus: tuple[str, ...]
    hostname: str
    system: str
    python: str
    torch: str
    packages: dict[str, str | None]

    @classmethod
    def detect(cls, gpus: tuple[str, ...] = ()) -> Machine:
        import torch

        return cls(
            cpu=_cpu_model(),
            cores=os.cpu_count() or 0,
            memory_bytes=_memory_bytes(),
            gpus=gpus,
            hostname=platform.node(),
            system=f"{platform.system()} {platform.release()}",
            python=sys.version.split()[0],
            torch=torch.__version__,
            packages={p: _version(p) for p in ("numpy", "anyio", "trio")},
        )

    def label(self) -> str:
        """One line for a figure: CPU, cores, memory, GPUs and torch."""
        gpus = ", ".join(self.gpus) if self.gpus else "no GPU"
        mem = f"{self.memory_bytes / 2**30:.0f} GiB" if self.memory_bytes else "? GiB"
        return f"{self.cpu}, {self.cores} cores, {mem}, {gpus}; torch {self.torch}"

    def as_dict(self) -> dict[str, object]:
        return {**self.__dict__, "gpus": list(self.gpus), "label": self.label()}
