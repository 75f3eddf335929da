"""Fetch a few source files of a vLLM release from its wheel, without installing it.

    python tools/fetch_vllm_source.py 0.33.0 .vllm-src/0.33.0
    python tools/fetch_vllm_source.py 0.33.0 .vllm-src/0.33.0 --wheel vllm-0.33.0-...whl

From PyPI it reads the wheel's zip directory and only the members it needs
through HTTP range requests (a few MB of a ~340 MB wheel); with ``--wheel`` it
reads a wheel already downloaded (``pip download --no-deps vllm==0.33.0``).
Every file is checked against the sha256 the wheel's ``RECORD`` lists. The
adapter's compatibility tests (``tests/vllm/test_vllm_source.py``) read what
lands in the destination; CI runs this once before the tests.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import sys
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

#: The parts of vLLM the adapter depends on (prefixes of paths in the wheel).
PREFIXES = (
    "vllm/v1/kv_offload/",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py",
    # when the model runner calls the connector's worker side in a step, and which
    # steps replay a full CUDA graph
    "vllm/v1/worker/gpu_model_runner.py",
    "vllm/v1/worker/kv_connector_model_runner_mixin.py",
    "vllm/v1/worker/gpu/kv_connector.py",
    "vllm/v1/worker/gpu/model_runner.py",
    "vllm/v1/cudagraph_dispatcher.py",
)

_BLOCK = 1 << 18  # bytes per range request


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over HTTP range requests, with a small block cache."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size, self.pos = url, size, 0
        self.cache: dict[int, bytes] = {}
        self.requests = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def _block(self, index: int) -> bytes:
        if index not in self.cache:
            start = index * _BLOCK
            end = min(start + _BLOCK, self.size) - 1
            req = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end}"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                data = resp.read()
            if len(data) != end - start + 1:
                raise OSError(f"range {start}-{end} of {self.url}: got {len(data)} bytes")
            self.requests += 1
            self.cache[index] = data
        return self.cache[index]

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(len(view), self.size - self.pos)
        done = 0
        while done < want:
            index, skip = divmod(self.pos, _BLOCK)
            chunk = self._block(index)[skip : skip + want - done]
            view[done : done + len(chunk)] = chunk
            done += len(chunk)
            self.pos += len(chunk)
        return done


def wheel_on_pypi(version: str) -> tuple[str, int, str]:
    """URL, size and sha256 of the release's x86-64 Linux wheel (PyPI's JSON simple API)."""
    req = urllib.request.Request(
        "https://pypi.org/simple/vllm/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        index = json.load(r)
    for f in index["files"]:
        name = f["filename"]
        if name.startswith(f"vllm-{version}-") and name.endswith("x86_64.whl"):
            return f["url"], int(f["size"]), f["hashes"]["sha256"]
    raise SystemExit(f"vllm {version} has no x86-64 Linux wheel on PyPI")


def extract(archive: zipfile.ZipFile, version: str, dest: Path) -> list[str]:
    record_name = f"vllm-{version}.dist-info/RECORD"
    record = {
        row[0]: row[1]
        for row in csv.reader(io.StringIO(archive.read(record_name).decode()))
        if row and row[1]
    }
    wanted = [n for n in archive.namelist() if n.startswith(PREFIXES) and n.endswith(".py")]
    if not wanted:
        raise SystemExit(f"the wheel holds none of {PREFIXES}")
    for name in wanted:
        data = archive.read(name)
        algo, _, digest = record[name].partition("=")
        got = base64.urlsafe_b64encode(hashlib.new(algo, data).digest()).rstrip(b"=").decode()
        if got != digest:
            raise SystemExit(f"{name}: {algo} {got} does not match the wheel's RECORD ({digest})")
        out = dest / name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
    return wanted


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("version")
    p.add_argument("dest", type=Path)
    p.add_argument("--wheel", type=Path, help="a downloaded wheel, instead of PyPI")
    args = p.parse_args(argv)
    source: dict[str, Any] = {"version": args.version}
    if args.wheel is not None:
        archive = zipfile.ZipFile(args.wheel)
        source["wheel"] = str(args.wheel)
        reader = None
    else:
        url, size, sha256 = wheel_on_pypi(args.version)
        reader = RangeFile(url, size)
        archive = zipfile.ZipFile(io.BufferedReader(reader, buffer_size=_BLOCK))
        source.update(wheel=url, wheel_sha256=sha256)
    with archive:
        files = extract(archive, args.version, args.dest)
    source["files"] = files
    (args.dest / "SOURCE.json").write_text(json.dumps(source, indent=1))
    fetched = f", {reader.requests} range requests" if reader is not None else ""
    print(f"vllm {args.version}: {len(files)} files in {args.dest}{fetched}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
