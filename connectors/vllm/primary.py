"""The primary tier's memory as a host tier that a secondary tier can hand back.

vLLM's tiering manager gives each secondary tier a ``(num_chunks, row_bytes)``
memoryview over its shared offload region (an ``mmap``), and at shutdown, after
every secondary tier's ``shutdown``, releases that view and closes the mmap. An
mmap refuses to close while any buffer exported from it is alive (``BufferError:
cannot close exported pointers exist``, logged by vLLM as ``Failed to close
mmap_obj``), and every numpy array, memoryview or torch tensor made from the view
keeps such an export alive until it is freed.

So a tier takes the view only through :class:`PrimaryRows`: one memoryview of its
own (``cast`` of vLLM's), one torch tensor over it, and a :class:`HostTier` over
that tensor. ``torch.frombuffer`` keeps a reference to the memoryview, not a
buffer export, so :meth:`PrimaryRows.release` (after the tier's engine is closed:
no thread touches the rows any more) drops the host tier's tensors and releases
the memoryview, which ends every hold of ours on vLLM's view even if a tensor
object were still referenced somewhere. ``memoryview.release`` raises
``BufferError`` only while a buffer made directly from the memoryview is alive;
the release then collects reference cycles once and warns if that is not enough.

This module does not import vLLM.
"""

from __future__ import annotations

import gc
import logging

import torch

from offload_engine import ConfigError, HostTier

log = logging.getLogger("offload_engine.vllm")


class PrimaryRows:
    """vLLM's primary-tier rows as a :class:`HostTier` (no copy): host block ``b`` is
    chunk row ``b``. :meth:`release` gives every view back; call it after the
    engine that moves bytes through :attr:`tier` is closed and dropped."""

    def __init__(self, view: memoryview, owner: str = "vLLM's primary tier") -> None:
        if view.ndim != 2 or not view.c_contiguous or view.itemsize != 1:
            raise ConfigError(
                f"{owner} must be a C-contiguous (chunks, bytes) buffer of bytes, got shape "
                f"{view.shape}, strides {view.strides}, format {view.format!r}"
            )
        rows, row_bytes = (int(n) for n in view.shape)  # type: ignore[union-attr]
        self.rows = rows
        self.row_bytes = row_bytes
        self._view: memoryview | None = view.cast("B")
        self.tier: HostTier = HostTier.over(
            torch.frombuffer(self._view, dtype=torch.uint8),
            num_blocks=rows,
            slot_bytes=row_bytes,
            owner=owner,
        )

    @property
    def released(self) -> bool:
        return self._view is None

    def release(self) -> bool:
        """Drop the host tier's tensors and release this object's memoryview.
        Idempotent. Returns whether the memoryview was released: ``False`` (with a
        warning) means a buffer made from it is still alive, so vLLM will fail to
        close its region."""
        view, self._view = self._view, None
        if view is None:
            return True
        self.tier.release()
        try:
            view.release()
        except BufferError:
            # a view made from it may be held only by a reference cycle (a finished
            # thread's frame, an exception's traceback): collect those first
            gc.collect()
            try:
                view.release()
            except BufferError as exc:
                log.warning(
                    "a view of vLLM's primary tier outlives the secondary tier's shutdown "
                    "(%s); vLLM will fail to close its shared offload region",
                    exc,
                )
                return False
        return True

    def __repr__(self) -> str:
        state = "released" if self._view is None else "held"
        return f"<PrimaryRows {state} rows={self.rows} row_bytes={self.row_bytes}>"


__all__ = ["PrimaryRows"]
