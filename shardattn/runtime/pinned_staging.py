"""Host metadata onto the device through one reused pinned buffer: :class:`PinnedStaging`.

A decode step's host plan (int32 lengths and request indices) reaches the device in one
non-blocking copy from a pinned buffer that is allocated once and grown when too small: pinning
per step costs far more than the copy, and copying from pageable memory makes the driver wait for
the stream first.
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
