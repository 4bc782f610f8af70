"""A reused pinned host buffer for the small host-to-device copy of each step's metadata.

Pinning memory per step costs far more than the copy (a page-locking system call); copying
from pageable memory makes the driver wait for the stream first. :class:`PinnedStaging` pins
once, grows when needed, and before overwriting the buffer waits (an event) for the previous
copy out of it, so the host can run ahead of the device by one step. Not for graph capture: a
captured copy re-reads its source at every replay (the step copies from the plan's own pinned
tensor then).
"""

from __future__ import annotations

import torch

__all__ = ["PinnedStaging"]


class PinnedStaging:
    """One pinned staging buffer (allocated on first use, grown when too small)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def upload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``host`` (a CPU tensor) on ``device``: one non-blocking copy through the pinned buffer.

        Args:
            host: CPU tensor (any dtype and shape). device: destination.
        Returns:
            a new tensor on ``device`` (``host`` itself for a CPU device).
        """
        if device.type != "cuda":
            return host if host.device == device else host.to(device)
        n = host.numel() * host.element_size()
        if self._buf is None or self._buf.numel() < n:
            self._buf = torch.empty(max(n, 1 << 14), dtype=torch.uint8, pin_memory=True)
            self._copied = torch.cuda.Event()
        elif self._copied is not None and self._copied.query() is False:
            self._copied.synchronize()  # the previous step's copy is still reading the buffer
        staged = self._buf[:n].view(host.dtype).view(host.shape)
        staged.copy_(host)
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        out.copy_(staged, non_blocking=True)
        assert self._copied is not None
        self._copied.record()
        return out
