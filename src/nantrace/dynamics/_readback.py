"""Reading device figures on the host without stalling the device.

A sampled statistic is reduced on the device into one small vector; :class:`DeferredRead`
starts its copy to the host at once (pinned memory, non-blocking, with an event) and hands
the values over at a later step, by which time the guard's own per-step synchronisation
has long made sure the copy is done. So a sampled statistic costs no host sync of its own.
On the CPU every value is ready at once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch

__all__ = ["DeferredRead", "host_value", "reading_host_memory", "stack_on"]

_HOST_SIDE = threading.local()


@contextlib.contextmanager
def _host_side() -> Iterator[None]:
    depth = getattr(_HOST_SIDE, "depth", 0)
    _HOST_SIDE.depth = depth + 1
    try:
        yield
    finally:
        _HOST_SIDE.depth = depth


def reading_host_memory() -> bool:
    """True while nantrace reads a tensor that lives in host memory by design (a finished
    asynchronous copy, an optimizer's CPU step counter): such a read never waits for a device.
    :class:`nantrace.testing.host_reads.HostReadCounter` does not count it."""
    return getattr(_HOST_SIDE, "depth", 0) > 0


def host_value(t: torch.Tensor) -> float:
    """The value of a one-element tensor that lives on the CPU by design, e.g. Adam's
    ``state["step"]`` (torch keeps it there so that reading it costs no device sync)."""
    if t.device.type != "cpu":
        raise ValueError(f"host_value reads CPU tensors only; this one is on {t.device} (reading it would synchronise)")
    with _host_side():
        return float(t)


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
        if self._source is not None:
            return self._host.cpu().tolist()  # a real device read (the copy starts here)
        with _host_side():  # host memory the copy has filled (on the CPU: the values themselves)
            return self._host.tolist()


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
