"""A tensor store over TCP that parks its tensors in the engine's host tier.

The engine runs inside the server's own event loop (asyncio or trio, through
anyio): one ``OffloadingQueueManager``, entered when the server starts and
closed when it stops. Each request moves blocks through it:

* ``PUT``: the payload is copied into free blocks of a staging buffer (the
  "KV cache" the engine reads from), one job stores them into tier blocks,
  and the staging blocks are freed once the job's result is in;
* ``GET``: one job loads the key's tier blocks into staging blocks, and the
  bytes are sent from there.

Protocol, one request after another on a connection (keys have no spaces)::

    PUT <key> <nbytes>\\n<nbytes bytes>  ->  OK <blocks>\\n
    GET <key>\\n                        ->  OK <nbytes>\\n<nbytes bytes>
    DEL <key>\\n                        ->  OK\\n
    any failure                        ->  ERR <reason>\\n

Run it::

    python examples/tensor_server.py --port 8765 [--backend trio]

``--backend trio`` needs trio: ``pip install -e '.[trio]'`` in the checkout.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
from collections import deque
from dataclasses import dataclass
from functools import partial
from types import TracebackType

import anyio
import anyio.abc
import numpy as np
import torch
from anyio.streams.buffered import BufferedByteReceiveStream

from offload_engine import (
    EngineStats,
    HostCopyHandler,
    HostTier,
    KVLayout,
    OffloadError,
    OffloadingQueueManager,
    TransferSpec,
    cpu_blocks,
    host_cache_blocks,
)

MAX_HEADER = 1024


class RequestError(Exception):
    """A request the store refuses; its message goes back to the client after ``ERR``."""


@dataclass
class _Entry:
    tier_ids: list[int]
    nbytes: int
    readers: int = 0  # GETs loading from these tier blocks right now
    dropped: bool = False  # deleted or overwritten: free the blocks once no GET reads them


class TensorStore:
    """Keys -> bytes, kept in a host tier and moved by the engine.

    Use inside a running loop: ``async with TensorStore() as store``. All
    bookkeeping runs on that loop's thread, so it needs no lock.
    """

    def __init__(
        self,
        *,
        block_bytes: int = 64 << 10,
        staging_blocks: int = 64,
        tier_blocks: int = 4096,
        workers: int = 2,
    ) -> None:
        self.block_bytes = block_bytes
        self.tier_blocks = tier_blocks
        self._staging = torch.zeros((staging_blocks, block_bytes), dtype=torch.uint8)
        layout = KVLayout.from_block_tensors([self._staging], name="staging")
        self._tier = HostTier.for_layout(layout, tier_blocks)
        self._engine = OffloadingQueueManager(
            [HostCopyHandler(layout, self._tier, workers=workers)]
        )
        self._staging_free: deque[int] = deque(range(staging_blocks))
        self._staging_freed: anyio.Event | None = None  # set when staging blocks are freed
        self._tier_free: deque[int] = deque(range(tier_blocks))
        self._index: dict[str, _Entry] = {}

    @property
    def max_payload(self) -> int:
        return self._staging.shape[0] * self.block_bytes

    def stats(self) -> EngineStats:
        """The engine's counters (also after it closed)."""
        return self._engine.stats()

    @property
    def tier_free(self) -> int:
        """Tier blocks holding no key."""
        return len(self._tier_free)

    async def __aenter__(self) -> TensorStore:
        await self._engine.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._engine.__aexit__(exc_type, exc, tb)
        finally:
            self._tier.release()

    # ------------------------------------------------------------ requests

    async def put(self, key: str, data: bytes) -> int:
        """Store ``data`` under ``key`` (replacing what was there); return the blocks used."""
        n = math.ceil(len(data) / self.block_bytes)
        if len(data) > self.max_payload:
            raise RequestError(f"payload of {len(data)} bytes exceeds {self.max_payload}")
        if n > len(self._tier_free):
            raise RequestError(f"tier full: {n} blocks needed, {len(self._tier_free)} free")
        tier_ids = [self._tier_free.popleft() for _ in range(n)]
        try:
            if n:
                ids = await self._take_staging(n)
                with anyio.CancelScope(shield=True):  # see _take_staging
                    try:
                        payload = torch.zeros((n, self.block_bytes), dtype=torch.uint8)
                        payload.view(-1).numpy()[: len(data)] = np.frombuffer(data, np.uint8)
                        self._staging.index_copy_(0, torch.tensor(ids), payload)
                        await self._transfer(
                            TransferSpec(host_cache_blocks(ids), cpu_blocks(tier_ids))
                        )
                    finally:
                        self._free_staging(ids)
        except BaseException:
            self._tier_free.extend(tier_ids)
            raise
        old = self._index.get(key)
        self._index[key] = _Entry(tier_ids, len(data))
        if old is not None:
            self._drop(old)
        return n

    async def get(self, key: str) -> bytes:
        """The bytes stored under ``key``."""
        entry = self._index.get(key)
        if entry is None:
            raise RequestError(f"no such key: {key}")
        n = len(entry.tier_ids)
        if not n:
            return b""
        entry.readers += 1
        try:
            ids = await self._take_staging(n)
            with anyio.CancelScope(shield=True):  # see _take_staging
                try:
                    await self._transfer(
                        TransferSpec(cpu_blocks(entry.tier_ids), host_cache_blocks(ids))
                    )
                    rows = self._staging.index_select(0, torch.tensor(ids))
                finally:
                    self._free_staging(ids)
        finally:
            entry.readers -= 1
            if entry.dropped and not entry.readers:
                self._tier_free.extend(entry.tier_ids)
        return rows.view(-1)[: entry.nbytes].numpy().tobytes()

    def delete(self, key: str) -> None:
        entry = self._index.pop(key, None)
        if entry is None:
            raise RequestError(f"no such key: {key}")
        self._drop(entry)

    def _drop(self, entry: _Entry) -> None:
        entry.dropped = True
        if not entry.readers:
            self._tier_free.extend(entry.tier_ids)

    async def _take_staging(self, n: int) -> list[int]:
        """Wait for ``n`` free staging blocks and take them.

        Callers shield the section from taking the blocks to freeing them:
        the blocks are freed only after their job has a result, so no later
        request reuses blocks that a copy thread is still touching.
        """
        while len(self._staging_free) < n:
            if self._staging_freed is None:
                self._staging_freed = anyio.Event()
            await self._staging_freed.wait()
        return [self._staging_free.popleft() for _ in range(n)]

    def _free_staging(self, ids: list[int]) -> None:
        self._staging_free.extend(ids)
        freed, self._staging_freed = self._staging_freed, None
        if freed is not None:
            freed.set()

    async def _transfer(self, spec: TransferSpec) -> None:
        """One job through the engine; waits while its queue is full."""
        job = await self._engine.submit(spec)
        [result] = await self._engine.wait([job])
        if not result.success:
            raise RequestError(f"transfer failed: {result.error}")


# ---------------------------------------------------------------- the TCP server


async def _discard(reader: BufferedByteReceiveStream, nbytes: int) -> None:
    while nbytes:
        nbytes -= len(await reader.receive(min(nbytes, 1 << 16)))


async def handle_connection(store: TensorStore, stream: anyio.abc.ByteStream) -> None:
    """Serve one client until it disconnects or breaks the framing."""
    reader = BufferedByteReceiveStream(stream)
    async with stream:
        while True:
            try:
                header = (await reader.receive_until(b"\n", MAX_HEADER)).decode()
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                return
            except (anyio.DelimiterNotFound, UnicodeDecodeError):
                await stream.send(b"ERR bad header\n")
                return
            verb, *args = header.split(" ")
            try:
                if verb == "PUT" and len(args) == 2 and args[1].isdigit():
                    nbytes = int(args[1])
                    if nbytes > store.max_payload:
                        await _discard(reader, nbytes)  # keeps the connection in step
                        raise RequestError(f"payload of {nbytes} bytes exceeds {store.max_payload}")
                    data = await reader.receive_exactly(nbytes)
                    blocks = await store.put(args[0], data)
                    await stream.send(f"OK {blocks}\n".encode())
                elif verb == "GET" and len(args) == 1:
                    data = await store.get(args[0])
                    await stream.send(f"OK {len(data)}\n".encode() + data)
                elif verb == "DEL" and len(args) == 1:
                    store.delete(args[0])
                    await stream.send(b"OK\n")
                else:
                    await stream.send(b"ERR unknown request\n")
            except (RequestError, OffloadError) as exc:
                await stream.send(f"ERR {exc}\n".encode())
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                return


async def serve_tcp(
    store: TensorStore,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Accept clients until cancelled; reports the bound port through ``task_status``."""
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    async with listener:
        task_status.started(listener.extra(anyio.abc.SocketAttribute.local_port))
        await listener.serve(partial(handle_connection, store))


class Client:
    """A minimal client: one request at a time on one connection."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self._stream = stream
        self._reader = BufferedByteReceiveStream(stream)

    @classmethod
    async def connect(cls, host: str, port: int) -> Client:
        return cls(await anyio.connect_tcp(host, port))

    async def _reply(self) -> str:
        line = (await self._reader.receive_until(b"\n", MAX_HEADER)).decode()
        if line.startswith("ERR "):
            raise RequestError(line[4:])
        return line

    async def put(self, key: str, data: bytes) -> int:
        await self._stream.send(f"PUT {key} {len(data)}\n".encode() + data)
        return int((await self._reply()).split()[1])

    async def get(self, key: str) -> bytes:
        await self._stream.send(f"GET {key}\n".encode())
        nbytes = int((await self._reply()).split()[1])
        return await self._reader.receive_exactly(nbytes)

    async def delete(self, key: str) -> None:
        await self._stream.send(f"DEL {key}\n".encode())
        await self._reply()

    async def aclose(self) -> None:
        await self._stream.aclose()


async def main(host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM, then stop cleanly: the engine closes last."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with TensorStore() as store, anyio.create_task_group() as tg:
            bound = await tg.start(serve_tcp, store, host, port)
            print(f"tensor server on {host}:{bound} (Ctrl-C stops it)", flush=True)
            async for signum in signals:
                print(f"{signal.Signals(signum).name}: stopping", flush=True)
                tg.cancel_scope.cancel()
                break
        print(f"stopped; engine {store.stats().state}", flush=True)


def _os_errors(exc: BaseException) -> list[OSError]:
    """The OSErrors inside ``exc``, through nested exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return [e for sub in exc.exceptions for e in _os_errors(sub)]
    return [exc] if isinstance(exc, OSError) else []


def run(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status. Bad input is one line on stderr:
    2 for a bad argument, 1 when the server cannot listen (port in use, unknown host)
    or its backend is not installed (``--backend trio`` without trio)."""
    parser = argparse.ArgumentParser(description="A tensor store over TCP, on offload-engine.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    args = parser.parse_args(argv)
    prog = parser.prog
    if not 0 <= args.port <= 65535:
        print(f"{prog}: error: --port {args.port}: a TCP port is 0 to 65535", file=sys.stderr)
        return 2
    if args.backend == "trio":
        try:
            import trio  # noqa: F401
        except ImportError:
            print(
                f"{prog}: error: --backend trio: trio is not installed: from the "
                "offload-engine checkout, pip install -e '.[trio]'",
                file=sys.stderr,
            )
            return 1
    failed: list[OSError] = []
    try:
        anyio.run(main, args.host, args.port, backend=args.backend)
    except* OSError as group:  # from the listener: a task group wraps it
        failed = _os_errors(group)
    if failed:
        exc = failed[0]
        why = f"[Errno {exc.errno}] {exc.strerror}" if exc.strerror else str(exc)
        print(f"{prog}: error: cannot serve on {args.host}:{args.port}: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run())
