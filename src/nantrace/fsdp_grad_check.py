"""FSDP2 (``fully_shard``): check each rank's own gradients before the reduce-scatter.

FSDP2 reduce-scatters every parameter group's unsharded gradients at the end of its backward;
a NaN born in one rank's backward then reaches every rank's shard before any check sees it.
Each parameter group hands its flattened local gradients to a ``ReduceScatter`` comm object
(the one ``FSDPModule.set_custom_reduce_scatter`` replaces). :func:`watch_fsdp_local_grads`
wraps the comm object of every group: the wrapper takes one min/max pass over the input
buffer (``capture.finite_flag``, no host sync; the flag joins the step's one read as
``LOCAL_GRADS_BAD``) and then calls the comm it wrapped with the same arguments, so the
reduction and its numerics are unchanged. ``remove()`` (called by ``guard.close()``) puts the
wrapped comm back where the wrapper is still on top, and otherwise leaves a pass-through.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .capture import finite_flag

if TYPE_CHECKING:
    from .guard import Guard

__all__ = ["FsdpGradCheck", "watch_fsdp_local_grads"]


def _param_groups(module: nn.Module) -> list[Any]:
    """The FSDP2 parameter groups one ``fully_shard``-ed module owns (empty for any other module)."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    state = get_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch versions with one group per module
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return [g for g in groups if hasattr(g, "_reduce_scatter_comm")]


class _CheckedReduceScatter:
    """A ``ReduceScatter`` comm that flags non-finite local gradients, then runs the comm it wraps."""

    def __init__(self, inner: Any, guard: "Guard") -> None:
        self.inner = inner
        self.guard: weakref.ref[Guard] | None = weakref.ref(guard)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        guard = self.guard() if self.guard is not None else None
        if guard is not None and not guard.closed and not guard.state.replaying and input_tensor.numel():
            guard.recorder.capture.and_local_grads(finite_flag(input_tensor))
        return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
                          async_op=async_op)


class FsdpGradCheck:
    """The installed wrappers of one guard; ``remove()`` takes them out."""

    def __init__(self, installed: list[tuple[Any, _CheckedReduceScatter]]) -> None:
        self.installed = installed

    def remove(self) -> None:
        for group, wrapper in self.installed:
            wrapper.guard = None  # a pass-through from now on, wherever it still sits
            if group._reduce_scatter_comm is wrapper:
                group._reduce_scatter_comm = wrapper.inner
        self.installed = []


def watch_fsdp_local_grads(guard: "Guard") -> FsdpGradCheck | None:
    """Wrap the reduce-scatter comm of every FSDP2 parameter group of the guard's model.

    Returns ``None`` when the model has no FSDP2 parameter group this torch version exposes
    (then the incident cannot tell which rank's backward was at fault; every rank still agrees).
    """
    installed = []
    for module in guard.model.modules():
        for group in _param_groups(module):
            wrapper = _CheckedReduceScatter(group._reduce_scatter_comm, guard)  # stacks on another guard's
            group._reduce_scatter_comm = wrapper
            installed.append((group, wrapper))
    return FsdpGradCheck(installed) if installed else None
