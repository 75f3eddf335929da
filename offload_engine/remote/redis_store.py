"""Redis/Valkey backend (RESP, through the ``redis`` client with ``hiredis``).

Batches are pipelined: one round trip per call, whatever the number of keys. A
put sends each object as one ``SET`` whose value goes to the socket straight
from the parts' memory (tier slot, then trailer; nothing is copied in Python,
and the client's packer, which would copy each value, is bypassed). On Redis
Cluster a put sends ``SET`` of the slot, then ``APPEND`` of the trailer, in one
pipeline: a reader that comes between the two sees an object of the wrong
size, which is a miss.
A get receives each value as ``bytes`` (the client offers no receive-into) and
copies it once into the parts.

Connections: ``redis://`` or ``rediss://`` (TLS) URLs, a password or an ACL
user, and Redis Cluster (``cluster=True``). A server that dies is reported as
:class:`~offload_engine.StoreUnavailableError` within ``socket_timeout``; the
client reconnects on the next call once the server is back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from offload_engine.errors import ConfigError, StoreAuthError, StoreError, StoreUnavailableError
from offload_engine.remote.store import Parts, RemoteStore, check_parts


@dataclass(frozen=True)
class RedisStoreConfig:
    """How to reach a Redis or Valkey server.

    ``url``: ``redis://[user[:password]@]host:port/db`` or ``rediss://...`` for TLS.
    ``username``/``password`` override the URL's (keep secrets out of URLs).
    ``ssl_*``: CA bundle, client certificate and key for TLS; ``ssl_cert_reqs``
    is ``"required"`` (default), ``"optional"`` or ``"none"``.
    ``cluster``: talk to a Redis Cluster (keys spread over its nodes).
    ``socket_timeout``/``connect_timeout``: seconds before a silent server fails a call.
    ``retries``: reconnect attempts per call after a connection error.
    """

    url: str
    username: str | None = None
    password: str | None = None
    cluster: bool = False
    socket_timeout: float = 5.0
    connect_timeout: float = 2.0
    retries: int = 1
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: str = "required"

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or urlsplit(self.url).scheme not in ("redis", "rediss"):
            raise ConfigError(f"redis url must start with redis:// or rediss://, got {self.url!r}")
        for key in ("socket_timeout", "connect_timeout"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"redis {key} must be a positive number, got {value!r}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"redis retries must be a non-negative int, got {self.retries!r}")
        if self.ssl_cert_reqs not in ("required", "optional", "none"):
            raise ConfigError(
                "redis ssl_cert_reqs must be required, optional or none, "
                f"got {self.ssl_cert_reqs!r}"
            )

    def __repr__(self) -> str:  # never print the password
        shown = urlsplit(self.url)
        host = shown.hostname or "?"
        return (
            f"RedisStoreConfig({shown.scheme}://{host}:{shown.port}, cluster={self.cluster}, "
            f"user={self.username or shown.username or 'default'})"
        )


def _url_without_credentials(url: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=host).geturl()


def _client_kwargs(config: RedisStoreConfig) -> dict[str, Any]:
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kwargs: dict[str, Any] = {
        "socket_timeout": config.socket_timeout,
        "socket_connect_timeout": config.connect_timeout,
        "retry": Retry(NoBackoff(), config.retries),
    }
    if config.username is not None:
        kwargs["username"] = config.username
    if config.password is not None:
        kwargs["password"] = config.password
    if urlsplit(config.url).scheme == "rediss":
        kwargs["ssl_cert_reqs"] = config.ssl_cert_reqs
        for key in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            if getattr(config, key) is not None:
                kwargs[key] = getattr(config, key)
    return kwargs


class RedisStore(RemoteStore):
    """A :class:`RemoteStore` on one Redis/Valkey server or cluster.

    Construction connects and authenticates (``PING``): a server that is down
    raises :class:`StoreUnavailableError`, refused credentials
    :class:`StoreAuthError`.
    """

    backend = "redis"

    def __init__(self, config: RedisStoreConfig) -> None:
        if not isinstance(config, RedisStoreConfig):
            raise TypeError(f"RedisStore takes a RedisStoreConfig, got {type(config).__name__}")
        super().__init__()
        try:
            import redis
        except ImportError as exc:
            raise ConfigError("the redis backend needs: pip install 'redis[hiredis]'") from exc
        self.config = config
        kwargs = _client_kwargs(config)
        # the client lets a URL's credentials win over arguments: drop them when overridden
        url = (
            _url_without_credentials(config.url)
            if config.username is not None or config.password is not None
            else config.url
        )
        self._client: Any
        if config.cluster:
            from redis.cluster import RedisCluster

            with self._errors("connect to"):
                self._client = RedisCluster.from_url(url, **kwargs)
        else:
            self._client = redis.Redis.from_url(url, **kwargs)
        with self._errors("connect to"):
            self._client.ping()

    def _errors(self, what: str) -> _RedisErrors:
        return _RedisErrors(self, what)

    def _pipeline(self) -> Any:
        return self._client.pipeline(transaction=False)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        if not keys:
            return []
        pipe = self._pipeline()
        for key in keys:
            pipe.exists(key)
        with self._errors("query"):
            return [bool(n) for n in pipe.execute()]

    def put(self, keys: Sequence[str], objects: Sequence[Parts]) -> None:
        self._check_open()
        check_parts(keys, objects)
        if not keys:
            return
        with self._errors("store into"):
            if self.config.cluster:
                replies = self._put_pipelined(keys, objects)
            else:
                replies = self._put_packed(keys, objects)
        failed = [r for r in replies if isinstance(r, Exception)]
        if failed:
            raise StoreError(
                f"{self!r}: {len(failed)} of {len(replies)} writes refused: {failed[0]}"
            ) from failed[0]

    def _put_pipelined(self, keys: Sequence[str], objects: Sequence[Parts]) -> list[Any]:
        """Cluster: ``SET`` of the first part then ``APPEND`` of the others, pipelined
        (the cluster client routes each command to its key's node)."""
        pipe = self._pipeline()
        for key, parts in zip(keys, objects, strict=True):
            views = [memoryview(p.numpy().data) for p in parts]
            pipe.set(key, views[0])
            for more in views[1:]:
                pipe.append(key, more)
        return list(pipe.execute(raise_on_error=False))

    def _put_packed(self, keys: Sequence[str], objects: Sequence[Parts]) -> list[Any]:
        views = [[memoryview(p.numpy().data) for p in parts] for parts in objects]
        return send_sets(self._client, keys, views, retries=self.config.retries)

    def get_into(self, keys: Sequence[str], objects: Sequence[Parts]) -> list[bool]:
        self._check_open()
        sizes = check_parts(keys, objects)
        if not keys:
            return []
        pipe = self._pipeline()
        for key in keys:
            pipe.get(key)
        with self._errors("load from"):
            values = pipe.execute()
        hits = []
        for value, parts, size in zip(values, objects, sizes, strict=True):
            if value is None or len(value) != size:
                hits.append(False)
                continue
            src = np.frombuffer(value, dtype=np.uint8)
            off = 0
            for p in parts:
                n = p.numel()
                p.numpy()[:] = src[off : off + n]
                off += n
            hits.append(True)
        return hits

    def remove(self, keys: Sequence[str]) -> None:
        self._check_open()
        if not keys:
            return
        pipe = self._pipeline()
        for key in keys:
            pipe.delete(key)
        with self._errors("remove from"):
            pipe.execute()

    @property
    def client(self) -> Any:
        return self._client

    def _close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<RedisStore {self.config!r} {state}>"


def send_sets(
    client: Any, keys: Sequence[str], values: Sequence[Sequence[memoryview]], *, retries: int
) -> list[Any]:
    """``SET`` each key to the concatenation of its buffers, in one pipelined round
    trip on one connection of ``client`` (a ``redis.Redis``); return each reply, a
    refused write as its ``ResponseError``.

    The client's own command packer (hiredis) copies every value into one new
    ``bytes`` before sending it; here the RESP framing is written by hand and the
    buffers go to the socket as they lie. A connection error retries the whole
    batch (``SET`` is idempotent) up to ``retries`` times on a fresh connection,
    then raises the client's error.
    """
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import ResponseError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    chunks: list[bytes | memoryview] = []
    for key, views in zip(keys, values, strict=True):
        name = key.encode()
        size = sum(v.nbytes for v in views)
        chunks.append(b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(name), name, size))
        chunks.extend(views)
        chunks.append(b"\r\n")
    pool = client.connection_pool
    attempt = 0
    while True:
        conn = pool.get_connection()
        try:
            conn.send_packed_command(chunks)
            replies: list[Any] = []
            for _ in keys:
                try:
                    replies.append(conn.read_response())
                except ResponseError as exc:  # one refused write (e.g. OOM)
                    replies.append(exc)
            return replies
        except (RedisConnectionError, RedisTimeoutError, OSError):
            conn.disconnect()
            attempt += 1
            if attempt > retries:
                raise
        except BaseException:
            conn.disconnect()  # replies may be left unread on it
            raise
        finally:
            pool.release(conn)


class _RedisErrors:
    """Translates the client's exceptions into the package's, chained."""

    def __init__(self, store: RedisStore, what: str) -> None:
        self.store = store
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            return
        from redis import exceptions as rexc

        where = repr(self.store.config)
        if isinstance(exc, rexc.AuthenticationError) or (
            isinstance(exc, rexc.ResponseError)
            and str(exc).startswith(("WRONGPASS", "NOAUTH", "NOPERM"))
        ):
            raise StoreAuthError(f"cannot {self.what} {where}: credentials refused: {exc}") from exc
        if isinstance(exc, (rexc.ConnectionError, rexc.TimeoutError, OSError)):
            raise StoreUnavailableError(f"cannot {self.what} {where}: {exc}") from exc
        if isinstance(exc, rexc.RedisError):
            raise StoreError(f"cannot {self.what} {where}: {exc}") from exc
