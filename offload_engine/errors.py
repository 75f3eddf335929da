"""Exceptions, named for their cause.

Two families:

* errors **raised at a call** (bad input, wrong state): they derive from
  :class:`OffloadError` and, where it fits, from the matching builtin
  (``ValueError``, ``TypeError``, ``LookupError``) so generic handlers work;
* errors **carried in a failed** :class:`~offload_engine.TransferResult`
  (``result.error``): they derive from :class:`JobFailedError`.

"Closed by you" (:class:`EngineClosedError`) is a different error from "broken
underneath you" (:class:`EngineBrokenError`).
"""

from __future__ import annotations


class OffloadError(Exception):
    """Base class of every error this package raises on purpose."""


# --------------------------------------------------------------------------- state


class EngineNotRunningError(OffloadError, RuntimeError):
    """The engine cannot take this call in its current state."""


class EngineNotStartedError(EngineNotRunningError):
    """The manager was used before ``async with`` entered it."""


class EngineClosedError(EngineNotRunningError):
    """The engine was closed by its owner; no further calls are accepted."""


class EngineBrokenError(EngineNotRunningError):
    """The engine stopped underneath the caller (its loop or thread died)."""


class WrongThreadError(OffloadError, RuntimeError):
    """A blocking call was made from the engine's own event-loop thread, where it
    would deadlock, or a loop-only call was made from another thread."""


class QueueFullError(OffloadError):
    """The handler's queue is at its cap of queued + in-flight jobs: ``submit_nowait``
    found it full, or ``submit_blocking`` waited ``wait_timeout`` seconds for room in vain."""


# --------------------------------------------------------------------------- bad input


class InvalidTransferError(OffloadError, ValueError):
    """A transfer request is malformed; raised at submit, before anything is queued."""


class InvalidBlockIdsError(InvalidTransferError):
    """Block ids are not a 1-D array of non-negative integers, lie outside a pool, or
    name one destination twice within a job."""


class InvalidKeyError(InvalidTransferError):
    """Keys of a keyed tier are not a sequence of distinct, non-empty ``bytes`` of at
    most ``MAX_KEY_BYTES`` bytes."""


class BlockCountMismatchError(InvalidTransferError):
    """Source and destination block counts disagree once the block factor is applied."""


class NoHandlerError(InvalidTransferError, LookupError):
    """No handler is registered for the job's (source, destination) medium pair."""


class DuplicateJobIdError(OffloadError, ValueError):
    """The job id belongs to a job whose result has not been collected yet."""


class UnknownJobError(OffloadError, LookupError):
    """The job id is not live: never submitted, or its result was already collected."""


class HandlerRegistrationError(OffloadError, ValueError):
    """A handler is invalid, or a second one was registered for the same medium pair."""


class ConfigError(OffloadError, ValueError):
    """A configuration value is missing or invalid; the message names the key."""


class LayoutMismatchError(ConfigError):
    """A keyed tier's directory or namespace was written under another layout digest
    (model, dtype, block size, parallel rank, page bytes or format); it is never read."""


class TierUnavailableError(OffloadError, RuntimeError):
    """A keyed tier's backing store cannot be used (a missing or read-only directory,
    a server that does not answer); raised at construction, the message says why."""


class TrailerError(OffloadError, ValueError):
    """An object's bytes fail verification against its trailer (truncated, foreign
    key, other format, length or checksum mismatch). ``reason`` names which check.
    A keyed tier turns it into a miss; it never loads such bytes."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class LayoutError(OffloadError, ValueError):
    """A KV-cache layout cannot be handled (shapes, strides, dtypes or devices disagree)."""


class RuntimeUnavailableError(OffloadError, RuntimeError):
    """A device runtime (CUDA, NPU) is not usable on this machine; the message says why."""


class LedgerUnavailableError(OffloadError, RuntimeError):
    """The per-host ledger of busy device links cannot be used (no ``/dev/shm``, a file
    of another user or format, every slot taken); raised at open, the message says
    why."""


class InsufficientMemoryError(OffloadError, MemoryError):
    """The memory a requested size needs is more than the machine has available; raised
    before anything is allocated, and the message says how much of which memory."""


# --------------------------------------------------------------------------- job outcomes


class JobFailedError(OffloadError):
    """Base class of the errors carried by failed results."""


class TransferError(JobFailedError):
    """The handler failed to move the bytes. ``__cause__`` holds the low-level error."""


class JobTimeoutError(JobFailedError, TimeoutError):
    """The job did not finish within its timeout."""


class JobCancelledError(JobFailedError):
    """The job was cancelled while queued, or abandoned at close."""


class KeyMissError(TransferError):
    """A load found some keys absent or unverifiable (a miss). ``missing`` names
    them, ``loaded`` names the keys whose bytes were verified and delivered; the
    slots of missing keys hold no data a caller may use."""

    def __init__(
        self, message: str, *, missing: tuple[bytes, ...], loaded: tuple[bytes, ...]
    ) -> None:
        super().__init__(message)
        self.missing = missing
        self.loaded = loaded


class TierFullError(TransferError):
    """A store did not fit: the tier's byte cap could not be met by eviction, or the
    device ran out of space (ENOSPC, chained as ``__cause__``)."""


# --------------------------------------------------------------------------- remote stores


class StoreError(OffloadError):
    """A remote store (Redis/Valkey, Mooncake Store) refused or failed a call."""


class StoreUnavailableError(StoreError, TierUnavailableError, ConnectionError):
    """The store's server cannot be reached (down, wrong address, killed mid-call)."""


class StoreAuthError(StoreError, PermissionError):
    """The store's server refused the credentials (wrong password or ACL user)."""
