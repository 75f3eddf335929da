"""A device job's launch issued by native code: one foreign call per job, without the GIL.

A CUDA job's launch is a few dozen driver calls (event waits and records,
batched copies, kernel launches, the id upload). Made one by one through
``ctypes`` each pays Python's and ctypes' overhead and holds the GIL, and
while the engine's other threads are busy each costs about twice as much (the
launching thread waits to win the GIL back between calls). With
``native_launch`` the handler's launch code runs unchanged against a
:class:`LaunchProgram` instead of the runtime: each call appends an op to a
flat int64 program (descriptors go to one uint64 array), and
:meth:`LaunchProgram.run` hands the whole program to ``_native_launch.c``,
which makes the same driver calls in the same order, through ``ctypes.CDLL``
(the GIL is released for the call). A short program (:data:`HOLD_GIL_OPS`) is
run holding the GIL instead, as the Python path does for microsecond calls:
handing the GIL over costs more than such a call.

A staged job's pieces are planned by the library too, and only there
(``oe_staged_build``, through :class:`StagedPlanner`): planning them in Python
costs more CPU than the native launch of the whole job. The planner writes the
pieces as program ops; a :class:`LaunchProgram` issues them, and a runtime that
launches from Python has :mod:`offload_engine.device.staged` make their calls. A
``dma`` job's descriptors are made by the library for a :class:`LaunchProgram`
(``oe_chunk_descriptors``), the same ones numpy makes on the Python path.

The C file ships in the package and is compiled on first use with the system
C compiler (``$CC`` or ``cc``) into a per-user cache
(``$OFFLOAD_ENGINE_CACHE_DIR`` or ``$XDG_CACHE_HOME/offload-engine``, else
``~/.cache/offload-engine``), named by the source's hash and published with an
atomic rename, so concurrent first uses are safe and an edited source is
rebuilt. Where no compiler exists or the build fails, :func:`native_library`
says why and the handler keeps the Python path (``native_launch="auto"``) or
refuses (``native_launch=True``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from offload_engine.errors import TransferError
from offload_engine.vocabulary import Direction

if TYPE_CHECKING:
    from offload_engine.host import RegionTables

SOURCE = Path(__file__).with_name("_native_launch.c")

OP_WAIT, OP_RECORD, OP_BATCH, OP_LAUNCH, OP_HTOD, OP_COPY2D = 1, 2, 3, 4, 5, 6
#: the driver entry points a program calls, in the order of the table handed to C
ENTRY_NAMES = (
    "cuEventRecord",
    "cuStreamWaitEvent",
    "cuMemcpyBatchAsync",
    "cuMemcpyAsync",
    "cuLaunchKernel",
    "cuMemcpyHtoDAsync",
    "cuMemcpy2DAsync",
)
#: what each opcode calls, for the error text (a batch of variant 0 is cuMemcpyAsync)
CALL_NAMES = {
    OP_WAIT: "cuStreamWaitEvent",
    OP_RECORD: "cuEventRecord",
    OP_BATCH: "cuMemcpyBatchAsync",
    OP_LAUNCH: "cuLaunchKernel",
    OP_HTOD: "cuMemcpyHtoDAsync",
    OP_COPY2D: "cuMemcpy2DAsync",
}
#: the words of a batch op that the staged planner sets per piece (the same names in
#: ``_native_launch.c``): OP_BATCH, stream, the dst, src and sizes columns' word
#: offsets in the descriptor array, count, descriptors per call, attributes, variant
BATCH_STREAM, BATCH_DST, BATCH_SRC, BATCH_SIZES, BATCH_COUNT = 1, 2, 3, 4, 5
BATCH_WORDS = 9
#: a 2D copy op: OP_COPY2D, stream, dst, src, width, height, dst pitch, src pitch, and
#: 1 for device to host (0: host to device)
COPY2D_WORDS = 9
#: a launch op: OP_LAUNCH, function, grid x y z, block x y z, shared bytes, stream,
#: parameter count, then one word per parameter; the staged planner sets the grid's x
#: (the piece's blocks) and two parameters of the block-copy kernel
#: (``DriverBlockCopy.launch_args``): the cache ids' address and the slot base
LAUNCH_GRID_X, LAUNCH_STREAM, LAUNCH_NPARAMS, LAUNCH_PARAMS = 2, 9, 10, 11
LAUNCH_IDS, LAUNCH_SLOT_BASE = LAUNCH_PARAMS + 4, LAUNCH_PARAMS + 6
#: a program of at most this many ops and :data:`HOLD_GIL_DESCRIPTORS` descriptors
#: runs holding the GIL (it returns in microseconds; see the module doc)
HOLD_GIL_OPS = 12
#: the most descriptors a driver call made holding the GIL carries, here and in
#: ``CudaRuntime.memcpy_batch``: below it the batched copy returns in a few
#: microseconds, less than handing the GIL to another thread and winning it back
HOLD_GIL_DESCRIPTORS = 64


class StagedHeader(ctypes.Structure):
    """What ``oe_staged_build`` plans a staged job from: ``struct oe_staged_header``
    in ``_native_launch.c``, field for field (the library checks the size when it
    loads). Addresses are plain integers. The first fields hold a stream set's
    facts, whatever the job; the rest are the job's. ``tail`` points at
    ``buffers`` words (each staging buffer's last event, 0: none), then per group
    three (its blocks, its bytes per block, the address of its launch op
    template), then two events per piece (its first half done, its second)."""

    _fields_ = (
        ("store", ctypes.c_int64),  # 1: store (gather, then DMA), 0: load
        ("sm_stream", ctypes.c_int64),
        ("dma_streams", ctypes.c_int64 * 2),  # a piece's DMA stream, by its parity
        ("buffers", ctypes.c_int64),  # staging buffers
        ("rows", ctypes.c_int64),  # rows per staging buffer
        ("row_bytes", ctypes.c_int64),  # a staging row's bytes (a tier slot's)
        ("batch_template", ctypes.c_void_p),  # a batch op's words (BATCH_WORDS)
        ("buffer_addresses", ctypes.c_void_p),  # ``buffers`` int64 addresses
        ("tier_base", ctypes.c_uint64),
        ("slot_bytes", ctypes.c_uint64),
        ("factor", ctypes.c_uint64),  # tier slots per tier block
        # slot s is at (s / factor) * block_stride + (s % factor) * slot_bytes
        ("block_stride", ctypes.c_uint64),
        # a run of at least this many rows one stride apart moves as one 2D copy (a
        # group that moves part of each slot); 0: never
        ("copy2d_rows", ctypes.c_int64),
        ("words", ctypes.c_void_p),  # where the program's words go
        ("descriptors", ctypes.c_void_p),  # the descriptor array
        ("first_descriptor", ctypes.c_int64),  # its first free word
        # the groups' tier slots (int64, group after group), replaced by their tier
        # addresses, sorted; and the groups' cache ids in the id buffer's host memory,
        # sorted with them
        ("slots", ctypes.c_void_p),
        ("host_ids", ctypes.c_void_p),
        ("device_ids", ctypes.c_int64),  # those ids' device address
        ("next_buffer", ctypes.c_int64),  # the staging buffer the first piece takes
        ("pieces_before", ctypes.c_int64),  # pieces staged before this job (parity)
        ("groups", ctypes.c_int64),
        ("tail", ctypes.c_void_p),
    )


_LIB: dict[str, tuple[Any, ...] | str] = {}  # "lib": the loaded library or why not
_LIB_LOCK = threading.Lock()


def cache_dir() -> Path:
    """Where the compiled library is kept (see the module doc)."""
    explicit = os.environ.get("OFFLOAD_ENGINE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "offload-engine"


def build_library(source: Path = SOURCE, directory: Path | None = None) -> Path:
    """The shared library built from ``source``: compiled once per source hash and
    machine into ``directory`` (default :func:`cache_dir`), then reused (a library
    built elsewhere for the same machine may be placed there under its name).

    Raises ``OSError`` (no compiler, unwritable cache) or
    ``subprocess.CalledProcessError`` (the compiler failed)."""
    text = source.read_bytes()
    key = hashlib.sha256(text + f"\0{platform.machine()}".encode()).hexdigest()[:20]
    directory = cache_dir() if directory is None else directory
    target = directory / f"native_launch-{key}.so"
    if target.exists():
        return target
    cc = os.environ.get("CC") or "cc"
    compiler = shutil.which(cc)
    if compiler is None:
        raise FileNotFoundError(f"no C compiler ({cc!r} is not on PATH)")
    directory.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, "-O2", "-shared", "-fPIC", "-o", partial, str(source)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(partial, target)  # atomic: a concurrent build publishes the same bytes
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def native_library() -> tuple[Any, ...] | str:
    """``(released, held, build, check, chunks)``: the library's launch entry point
    called without and with the GIL, its staged planner (``oe_staged_build``), a
    submit's checks of the common job (``oe_check_pairs``, see :class:`PairCheck`)
    and a dma job's descriptors (``oe_chunk_descriptors``), built and loaded once
    per process; or why it is unavailable."""
    with _LIB_LOCK:
        found = _LIB.get("lib")
        if found is None:
            found = _LIB["lib"] = _load()
        return found


def _load() -> tuple[Any, ...] | str:
    if sys.byteorder != "little":
        return "the native launch passes kernel parameters as little-endian words"
    try:
        path = build_library()
    except subprocess.CalledProcessError as exc:
        stderr = exc.stderr.decode(errors="replace").strip() if exc.stderr else ""
        return f"compiling {SOURCE.name} failed: {stderr[-500:] or exc}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot build {SOURCE.name}: {exc}"
    try:
        entry = []
        for loader in (ctypes.CDLL, ctypes.PyDLL):
            fn = loader(str(path)).oe_launch_run
            fn.argtypes = (
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
            )
            fn.restype = ctypes.c_int64
            entry.append(fn)
        # the staged planner returns in microseconds: called holding the GIL
        build = ctypes.PyDLL(str(path)).oe_staged_build
        build.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
        build.restype = ctypes.c_int64
        check = ctypes.PyDLL(str(path)).oe_check_pairs
        check.argtypes = (ctypes.c_void_p, ctypes.c_void_p) + (ctypes.c_int64,) * 4
        check.restype = ctypes.c_int64
        chunks = ctypes.PyDLL(str(path)).oe_chunk_descriptors
        chunks.argtypes = (
            (ctypes.c_void_p, ctypes.c_int64) * 2
            + (ctypes.c_uint64,) * 4
            + (ctypes.c_int64, ctypes.c_void_p)
        )
        chunks.restype = ctypes.c_int64
        header_size = ctypes.PyDLL(str(path)).oe_staged_header_size
        header_size.restype = ctypes.c_int64
    except (OSError, AttributeError) as exc:
        return f"cannot load {path}: {exc}"
    if header_size() != ctypes.sizeof(StagedHeader):
        return (
            f"{SOURCE.name}'s struct oe_staged_header has {header_size()} bytes, "
            f"StagedHeader {ctypes.sizeof(StagedHeader)}"
        )
    return entry[0], entry[1], build, check, chunks


def reset_library() -> None:
    """Forget the loaded library, so the next :func:`native_library` builds again
    (tests of the build and its fallback)."""
    with _LIB_LOCK:
        _LIB.clear()


class PairCheck:
    """A submit's checks of the common job (one KV group, one slot per tier block) in
    one foreign call (``oe_check_pairs``): every id in range, destinations distinct.
    At a few hundred ids this replaces five numpy calls, each of which costs tens of
    microseconds in a thread that has been idle (its code and data have left the
    CPU's caches)."""

    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def __call__(
        self,
        cache_ids: Any,
        tier_ids: Any,
        num_cache: int,
        num_tier: int,
        dst_tier: bool,
    ) -> bool:
        """Whether the job passes; ``False`` also when the library could not tell
        (the caller's general path then decides, and names what is wrong)."""
        n = cache_ids.shape[0]
        array = ctypes.c_int64 * n  # a copy of the ids: no pointer into numpy's memory
        found: int = self._fn(
            array.from_buffer_copy(cache_ids),
            array.from_buffer_copy(tier_ids),
            n,
            num_cache,
            num_tier,
            dst_tier,
        )
        return found == 0


class StagedPlanner:
    """The staged strategy's planner (``oe_staged_build``) and the program it writes
    into: flat int64 words (ops) and one uint64 descriptor array.

    It is the one planner of a staged job's pieces. A :class:`LaunchProgram` (the
    native launch) issues the words it writes as driver calls; a runtime that
    launches from Python has :mod:`offload_engine.device.staged` read them back
    and make the same calls on the runtime. One handler's launches never overlap,
    so a planner serves one handler.
    """

    def __init__(self, library: tuple[Any, ...] | None = None) -> None:
        found = native_library() if library is None else library
        if isinstance(found, str):
            raise OSError(found)
        self._released, self._held, self._build, check, self._chunks = found
        self.check_pairs = PairCheck(check)
        self._words: list[int] = []  # ops recorded since the last flush to the buffer
        self._n = 0  # words in the buffer
        self._ops = 0
        self._ndesc = 0
        self._buffer = np.empty(256, dtype=np.int64)
        self._buffer_at = self._buffer.ctypes.data
        self._desc = np.empty(1024, dtype=np.uint64)
        self._desc_at = self._desc.ctypes.data
        self._rows2d = 0  # rows moved by 2D copies (each weighs as a descriptor for the GIL)
        self._out = (ctypes.c_int64 * 4)()  # oe_staged_build's counts
        self._out_at = ctypes.addressof(self._out)
        self._tail: Any = (ctypes.c_int64 * 64)()  # a staged job's StagedHeader.tail
        self._tail_at = ctypes.addressof(self._tail)

    @property
    def words(self) -> Any:
        """The program's words so far (an int64 view, valid until the next append)."""
        self._reserve(0)
        return self._buffer[: self._n]

    @property
    def descriptor_array(self) -> Any:
        """The descriptor array (uint64; valid until the next append)."""
        return self._desc

    def begin(self) -> None:
        """Start a new job's program (dropping whatever a failed launch left)."""
        self._words.clear()
        self._n = 0
        self._ops = 0
        self._ndesc = 0
        self._rows2d = 0

    def op(self, *words: int) -> None:
        """Append one op: its code and operands."""
        self._words.extend(words)
        self._ops += 1

    def _reserve(self, words: int) -> None:
        """Room for ``words`` more words in the buffer (the recorded ops flushed first)."""
        pending = self._words
        need = self._n + len(pending) + words
        if need > self._buffer.shape[0]:
            grown = np.empty(max(need, 2 * self._buffer.shape[0]), dtype=np.int64)
            grown[: self._n] = self._buffer[: self._n]
            self._buffer = grown
            self._buffer_at = grown.ctypes.data
        if pending:
            n = self._n
            self._buffer[n : n + len(pending)] = pending
            self._n = n + len(pending)
            pending.clear()

    def _reserve_descriptors(self, words: int) -> None:
        need = self._ndesc + words
        if need > self._desc.shape[0]:
            grown = np.empty(max(need, 2 * self._desc.shape[0]), dtype=np.uint64)
            grown[: self._ndesc] = self._desc[: self._ndesc]
            self._desc = grown
            self._desc_at = grown.ctypes.data

    def build_staged(
        self, header: StagedHeader, tail: list[int], words: int, descriptors: int
    ) -> None:
        """Append a staged job's pieces, planned by ``oe_staged_build``: ``header``
        with every field but the program's own (``words``, ``descriptors``,
        ``first_descriptor``, ``tail``, filled in here), ``tail`` its variable part.
        At most ``words`` words and ``descriptors`` descriptor words are written."""
        self._reserve(words)
        self._reserve_descriptors(descriptors)
        header.words = self._buffer_at + 8 * self._n
        header.descriptors = self._desc_at
        header.first_descriptor = self._ndesc
        if len(tail) > len(self._tail):
            self._tail = (ctypes.c_int64 * (2 * len(tail)))()
            self._tail_at = ctypes.addressof(self._tail)
        self._tail[: len(tail)] = tail
        header.tail = self._tail_at
        if self._build(ctypes.addressof(header), self._out_at):
            raise MemoryError("the staged launch's planner could not allocate memory")
        out = self._out
        self._n += out[0]
        self._ops += out[1]
        self._rows2d += out[3]
        self._ndesc = out[2]


class LaunchProgram(StagedPlanner):
    """One job's driver calls, recorded as a program and issued by one native call.

    A runtime subclass supplies the same enqueueing methods the handler calls on
    the runtime (``record``, ``wait_event``, ``memcpy_batch``, ``copy_blocks``,
    ``upload_ids``), each appending its op with :meth:`op` and its descriptors
    with :meth:`descriptors`; a staged job's pieces are planned and appended by
    the C library itself (:meth:`build_staged`). The handler calls :meth:`begin`,
    its launch code, then :meth:`run`.
    """

    def __init__(
        self,
        entries: tuple[int, ...],
        error_name: Any,
        library: tuple[Any, ...] | None = None,
    ) -> None:
        if len(entries) != len(ENTRY_NAMES):
            raise ValueError(f"a program needs the {len(ENTRY_NAMES)} entry points {ENTRY_NAMES}")
        super().__init__(library)
        self._entries = (ctypes.c_void_p * len(entries))(*entries)
        self._entries_at = ctypes.addressof(self._entries)
        self._error_name = error_name
        self._fail = (ctypes.c_int64 * 4)()
        self._fail_at = ctypes.addressof(self._fail)
        # chunk_descriptors' inputs: per region table (by id, with the table kept to
        # tell a reused id apart) its four columns in one array, and the ids' scratch
        self._region_words: dict[int, tuple[RegionTables, Any, int, int]] = {}
        self._ids = np.empty(1024, dtype=np.int64)
        self._ids_at = self._ids.ctypes.data

    def descriptors(self, dst: Any, src: Any, sizes: Any) -> tuple[int, int, int]:
        """Append one batch's descriptors; their columns' offsets (in words) in the
        descriptor array."""
        n = int(sizes.shape[0])
        at = self._ndesc
        self._reserve_descriptors(3 * n)
        desc = self._desc
        desc[at : at + n] = dst
        desc[at + n : at + 2 * n] = src
        desc[at + 2 * n : at + 3 * n] = sizes
        self._ndesc = at + 3 * n
        return at, at + n, at + 2 * n

    def chunk_descriptors(
        self,
        tables: RegionTables,
        cache_ids: Any,
        slots: Any,
        geometry: tuple[int, int, int, int],
        store: bool,
    ) -> tuple[int, int, int, int]:
        """Append one KV group's dma descriptors, made by the library exactly as
        :func:`~offload_engine.host.layout.chunk_descriptors` makes them (block by
        block, merged); ``geometry`` is the tier's base address, slot bytes, slots
        per block and block stride. Their columns' offsets (in words) in the
        descriptor array, and their count."""
        n = int(cache_ids.shape[0])
        found = self._region_words.get(id(tables))
        if found is None or found[0] is not tables:
            words = np.concatenate((tables.base, tables.stride, tables.size, tables.slot_offset))
            found = (tables, words, words.ctypes.data, int(tables.size.shape[0]))
            self._region_words[id(tables)] = found
        _, _, tables_at, nreg = found
        if 2 * n > self._ids.shape[0]:
            self._ids = np.empty(4 * n, dtype=np.int64)
            self._ids_at = self._ids.ctypes.data
        self._ids[:n] = cache_ids
        self._ids[n : 2 * n] = slots
        at = self._ndesc
        self._reserve_descriptors(3 * n * nreg)
        out = self._desc_at + 8 * at
        k: int = self._chunks(tables_at, nreg, self._ids_at, n, *geometry, store, out)
        self._ndesc = at + 3 * k
        return at, at + k, at + 2 * k, k

    def memcpy_chunks(
        self,
        stream: Any,
        tables: RegionTables,
        cache_ids: Any,
        slots: Any,
        geometry: tuple[int, int, int, int],
        kind: Direction,
    ) -> int:
        """The runtime's ``memcpy_batch`` of one KV group's dma descriptors
        (:meth:`chunk_descriptors`); the driver calls it will make."""
        d, s, z, n = self.chunk_descriptors(
            tables, cache_ids, slots, geometry, kind is Direction.STORE
        )
        return self.batch(stream, d, s, z, n, kind)

    def batch(self, stream: Any, d: int, s: int, z: int, n: int, kind: Direction) -> int:
        """Append a batched copy of the ``n`` descriptors whose columns start at word
        offsets ``d``, ``s`` and ``z``; the driver calls it will make (a runtime's
        program says how it batches)."""
        raise NotImplementedError

    def run(self) -> None:
        """Issue the recorded calls; raise :class:`TransferError` for the first that fails,
        named as the Python path names it."""
        self._reserve(0)
        n = self._n
        if n == 0:
            return
        # a 2D copy's driver CPU grows with its rows (about 30 us for 512): each row
        # counts as a descriptor
        held = self._ndesc + 3 * self._rows2d <= 3 * HOLD_GIL_DESCRIPTORS
        call = self._held if self._ops <= HOLD_GIL_OPS and held else self._released
        rc = call(self._buffer_at, n, self._desc_at, self._entries_at, self._fail_at)
        if rc == 0:
            return
        _, code, result, variant = self._fail
        if rc < 0:
            raise TransferError(f"the native launch program is malformed at word {self._fail[0]}")
        what = CALL_NAMES.get(int(code), f"op {code}")
        if code == OP_BATCH and variant == 0:
            what = "cuMemcpyAsync"
        raise TransferError(f"{what} failed: {self._error_name(int(result))}")
