"""Reading device figures on the host without stalling the device.

A sampled statistic is reduced on the device into one small vector; :class:`DeferredRead`
starts its copy to the host at once (pinned memory, non-blocking, with an event) and hands
the values over at a later step, by which time the guard's own per-step synchronisation
has long made sure the copy is done. So a sampled statistic costs no host sync of its own.
On the CPU every value is ready at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["DeferredRead", "stack_on"]


class DeferredRead:
    """A 1-D device vector on its way to the host.

    Usage::

        pending = DeferredRead(torch.stack(norms))   # at step s: enqueue the copy, no sync
        ...
        values = pending.get()                       # at step s+1: a list of floats
    """

    __slots__ = ("_host", "_event", "_source")

    def __init__(self, values: torch.Tensor) -> None:
        values = values.detach().reshape(-1)
        self._event = None
        self._source: torch.Tensor | None = None
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(values.device))
        elif values.device.type == "cpu":
            self._host = values
        else:  # other accelerators: copy when read (that read synchronises)
            self._host = values
            self._source = values

    def ready(self) -> bool:
        """True when :meth:`get` will not wait for the device."""
        return self._event is None or bool(self._event.query())

    def get(self) -> list[float]:
        """The values as Python floats (waits for the copy only if it is still in flight)."""
        if self._event is not None:
            self._event.synchronize()
        host = self._host.cpu() if self._source is not None else self._host
        return host.tolist()


def stack_on(values: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """0-dim or 1-D tensors (possibly on several devices) as one ``dtype`` vector on ``device``."""
    if not values:
        return torch.zeros(0, device=device, dtype=dtype)
    return torch.cat([v.detach().reshape(-1).to(device, dtype) for v in values])


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """The dtype nantrace's statistics accumulate in: float64 (a float32 tensor of finite values up to
    ~1e30 has a sum of squares of ~1e60, beyond float32), float32 on devices without float64 (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def safe_norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-tensor L2 norms that cannot overflow where the tensors are finite (accumulated in
    :func:`accumulation_dtype`), as 0-dim tensors on each tensor's device; no synchronisation."""
    if not tensors:
        return []
    dtype = accumulation_dtype(tensors[0].device)
    try:
        return list(torch._foreach_norm(list(tensors), 2, dtype=dtype))
    except (RuntimeError, TypeError):
        return [torch.linalg.vector_norm(t, dtype=accumulation_dtype(t.device)) for t in tensors]
