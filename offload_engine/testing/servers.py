"""Real store servers on 127.0.0.1, started and stopped by tests and benchmarks.

:class:`RedisServer` runs Debian's ``redis-server`` (or ``valkey-server``) with
a password, no persistence and an optional ``maxmemory``; :class:`MooncakeMaster`
runs the ``mooncake_master`` binary that the Mooncake wheel ships. Both bind
127.0.0.1 on a free port, wait for the port itself (not a sleep), and can be
killed and restarted on the same port to script faults. Each is a context
manager; :meth:`stop` is idempotent and ``__del__`` only warns.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import typing
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from offload_engine.errors import ConfigError, StoreUnavailableError

_START_TIMEOUT = 20.0
_STOP_TIMEOUT = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    """Return once ``host:port`` accepts a connection; raise if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise StoreUnavailableError(
                f"{proc.args!r} exited with code {proc.returncode} "
                f"before listening on {host}:{port}"
            )
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise StoreUnavailableError(
                    f"nothing listens on {host}:{port} after {timeout}s"
                ) from None
            time.sleep(0.02)  # a port poll, not a test synchronising on time


class _ServerProcess:
    """One server process on a fixed port: start, kill (SIGKILL), stop (SIGTERM), restart."""

    host = "127.0.0.1"
    kind = "server"

    def __init__(self, port: int | None) -> None:
        self.port = free_port() if port is None else port
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: typing.IO[bytes] | None = None
        self._last_log = ""

    def _command(self) -> list[str]:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        if self.running:
            return
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed when the process ends
        self._proc = subprocess.Popen(
            self._command(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log
        )
        try:
            wait_for_port(self.host, self.port, _START_TIMEOUT, self._proc)
        except BaseException:
            self._terminate(signal.SIGKILL)
            raise

    def _terminate(self, sig: signal.Signals) -> None:
        proc, self._proc = self._proc, None
        try:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a paused server must see the signal
                proc.send_signal(sig)
                try:
                    proc.wait(_STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            log, self._log = self._log, None
            if log is not None:
                log.seek(0)
                self._last_log = log.read().decode(errors="replace")
                log.close()

    def kill(self) -> None:
        """SIGKILL: the server dies at once, mid-whatever, keeping nothing."""
        self._terminate(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections open but answers nothing."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM, then wait. Idempotent."""
        self._terminate(signal.SIGTERM)

    def restart(self) -> None:
        """Kill, then start again on the same port."""
        self.kill()
        self.start()

    def log(self) -> str:
        """What the running process (or the last one) printed."""
        if self._log is None:
            return self._last_log
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:
        if getattr(self, "_proc", None) is not None:
            warnings.warn(f"{type(self).__name__} was never stopped", ResourceWarning, stacklevel=2)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<{type(self).__name__} {self.host}:{self.port} {state}>"


@dataclass(frozen=True)
class TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1, for TLS tests."""

    ca_cert: Path
    server_cert: Path
    server_key: Path

    @classmethod
    def create(cls, directory: Path) -> TlsFiles:
        """Make them with the ``openssl`` command in ``directory`` (RSA 2048, 1 day)."""
        exe = shutil.which("openssl")
        if exe is None:
            raise ConfigError("TlsFiles needs the openssl command")
        d = Path(directory)
        ca_key, ca, key, csr, cert = (
            d / n for n in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt")
        )
        ext = d / "server.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1\n")

        def run(*args: str) -> None:
            subprocess.run([exe, *args], check=True, capture_output=True, timeout=60)

        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
            "/CN=offload-engine test CA", "-keyout", str(ca_key), "-out", str(ca))  # fmt: skip
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", str(key), "-out", str(csr))  # fmt: skip
        run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
            "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(cert))  # fmt: skip
        return cls(ca, cert, key)


class RedisServer(_ServerProcess):
    """``redis-server`` on 127.0.0.1 with ``password`` (``requirepass``), no persistence.

    ``maxmemory`` (bytes) with ``allkeys-lru`` makes the server evict keys, as a
    full production server would. ``acl_user=(name, password)`` adds an ACL user
    with every key and command. ``tls`` serves TLS only on the port (client
    certificates optional). ``cluster_dir`` makes it a Redis Cluster node keeping
    its node file there (see :class:`RedisClusterServers`).
    """

    kind = "redis"

    def __init__(
        self,
        *,
        password: str = "offload-engine-test",
        port: int | None = None,
        maxmemory: int | None = None,
        acl_user: tuple[str, str] | None = None,
        tls: TlsFiles | None = None,
        cluster_dir: Path | None = None,
        binary: str | None = None,
    ) -> None:
        found = binary or shutil.which("redis-server") or shutil.which("valkey-server")
        if found is None:
            raise ConfigError(
                "RedisServer needs redis-server or valkey-server on PATH "
                "(Debian: apt-get install redis-server)"
            )
        self.binary = found
        self.password = password
        self.maxmemory = maxmemory
        self.acl_user = acl_user
        self.tls = tls
        self.cluster_dir = cluster_dir
        super().__init__(port)

    def _command(self) -> list[str]:
        ports = ["--port", str(self.port)]
        if self.tls is not None:  # TLS only: the plain port is closed
            ports = [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                str(self.tls.server_cert),
                "--tls-key-file",
                str(self.tls.server_key),
                "--tls-ca-cert-file",
                str(self.tls.ca_cert),
                "--tls-auth-clients",
                "optional",
            ]
        cmd = [
            self.binary,
            "--bind",
            self.host,
            *ports,
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
            "--requirepass",
            self.password,
            "--dir",
            tempfile.gettempdir() if self.cluster_dir is None else str(self.cluster_dir),
        ]
        if self.cluster_dir is not None:
            cmd += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{self.port}.conf",
                "--masterauth",
                self.password,
            ]
        if self.maxmemory is not None:
            cmd += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", "allkeys-lru"]
        if self.acl_user is not None:
            name, pw = self.acl_user
            cmd += ["--user", name, "on", f">{pw}", "~*", "&*", "+@all"]
        return cmd

    @property
    def url(self) -> str:
        """``redis://:password@127.0.0.1:port/0`` (``rediss://`` with TLS)."""
        scheme = "redis" if self.tls is None else "rediss"
        return f"{scheme}://:{self.password}@{self.host}:{self.port}/0"


class RedisClusterServers:
    """A Redis Cluster of ``nodes`` masters on 127.0.0.1 (no replicas), for tests.

    Each node needs its port and that port + 10000 (the cluster bus) free.
    """

    def __init__(self, *, nodes: int = 3, password: str = "offload-engine-test") -> None:
        if shutil.which("redis-cli") is None:
            raise ConfigError("RedisClusterServers needs redis-cli (apt-get install redis-tools)")
        self._dir = tempfile.TemporaryDirectory(prefix="offload-engine-cluster-")
        self.password = password
        self.servers = [
            RedisServer(password=password, port=_cluster_port(), cluster_dir=Path(self._dir.name))
            for _ in range(nodes)
        ]

    def start(self) -> None:
        for s in self.servers:
            s.start()
        cli = shutil.which("redis-cli") or "redis-cli"
        addrs = [f"{s.host}:{s.port}" for s in self.servers]
        subprocess.run(
            [cli, "-a", self.password, "--no-auth-warning", "--cluster", "create", *addrs,
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        # the slots are assigned; wait until every node says the cluster is up
        deadline = time.monotonic() + _START_TIMEOUT
        for s in self.servers:
            while True:
                out = subprocess.run(
                    [cli, "-a", self.password, "--no-auth-warning", "-h", s.host, "-p",
                     str(s.port), "cluster", "info"],
                    capture_output=True, text=True, timeout=10, check=False,
                ).stdout  # fmt: skip
                if "cluster_state:ok" in out:
                    break
                if time.monotonic() > deadline:
                    raise StoreUnavailableError(f"cluster node {s.port} never reached state ok")
                time.sleep(0.05)  # polling the node's state, not synchronising a test on time

    @property
    def url(self) -> str:
        return self.servers[0].url

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        self._dir.cleanup()

    def __enter__(self) -> RedisClusterServers:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _cluster_port() -> int:
    """A free port whose cluster-bus port (+10000) is free too."""
    while True:
        port = free_port()
        if port + 10000 < 65536:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port


class MooncakeMaster(_ServerProcess):
    """``mooncake_master`` on 127.0.0.1 (RPC and metrics ports), without its HTTP
    metadata server: clients use ``P2PHANDSHAKE``.

    ``kv_lease_ttl_ms`` is the lease a get places on an object (the object cannot
    be removed or evicted under it). A read that outlives it fails (``-707``,
    lease expired): under load, 200 ms was too short for 16 concurrent 0.5 MiB
    reads on the 2-core test box, so the default is 5 s.
    """

    kind = "mooncake"

    def __init__(
        self,
        *,
        port: int | None = None,
        metrics_port: int | None = None,
        kv_lease_ttl_ms: int = 5000,
        binary: str | None = None,
    ) -> None:
        found = binary or shutil.which("mooncake_master") or _venv_binary("mooncake_master")
        if found is None:
            raise ConfigError(
                "MooncakeMaster needs the mooncake_master binary "
                "(pip install mooncake-transfer-engine-non-cuda)"
            )
        self.binary = found
        self.metrics_port = free_port() if metrics_port is None else metrics_port
        self.kv_lease_ttl_ms = kv_lease_ttl_ms
        super().__init__(port)

    def _command(self) -> list[str]:
        return [
            self.binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.kv_lease_ttl_ms}",
        ]

    @property
    def address(self) -> str:
        """``127.0.0.1:port``, the ``master`` a client connects to."""
        return f"{self.host}:{self.port}"


def _venv_binary(name: str) -> str | None:
    """A console script installed beside the running interpreter (a venv not on PATH)."""
    import sys

    path = Path(sys.executable).parent / name
    return str(path) if path.exists() and os.access(path, os.X_OK) else None
