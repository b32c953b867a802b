"""Data-parallel awareness: which rank a failure came from, and one decision for all ranks.

NaNs cross ranks only through collectives. A DDP communication hook checks each bucket of
*local* gradients before the all-reduce (no host sync: the flag joins the step's fused
read), so the incident names the rank whose data produced the failure. One small
all-reduce per step then makes every rank take the same decision (skip / raise / pause),
so no rank steps while another skips: replicas neither deadlock nor diverge.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING

import torch

from .capture import finite_flag
from .incident import KINDS

if TYPE_CHECKING:
    from .guard import Guard


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) when torch.distributed is not initialised."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def install_local_grad_check(guard: "Guard") -> bool:
    """Register a DDP comm hook that records local-gradient finiteness, then all-reduces as DDP does.

    Returns False when the model is not DDP or already has a comm hook of its own (DDP allows
    one). A DDP hook cannot be unregistered: after ``guard.close()`` it only all-reduces, and
    a later guard on the same DDP model takes the hook over instead of losing the check.
    """
    model = guard.model
    if type(model).__name__ != "DistributedDataParallel" or not hasattr(model, "register_comm_hook"):
        return False
    target = getattr(model, _HOOK_TARGET, None)
    if target is not None:  # our hook, left by an earlier guard
        target[0] = weakref.ref(guard)
        return True
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    target = [weakref.ref(guard)]

    def check_then_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # DDP inspects real annotations
        g = target[0]()
        if g is not None and not g.closed and not g._replaying:
            g._capture.and_local_grads(finite_flag(bucket.buffer()))
        return default_hooks.allreduce_hook(state, bucket)

    try:
        model.register_comm_hook(state=None, hook=check_then_allreduce)
    except RuntimeError:
        return False
    setattr(model, _HOOK_TARGET, target)
    return True


_HOOK_TARGET = "_nantrace_grad_check_target"
"""Attribute of a DDP model holding the guard its nantrace comm hook reports to."""


@dataclasses.dataclass
class Agreement:
    """What all ranks agreed on for one step."""

    origin_ranks: list[int]
    """Ranks whose own data/loss/gradients were non-finite (before any collective)."""
    block: bool
    """Some rank blocks this update: every rank must."""
    peer_kind: str | None
    """The kind reported by the lowest rank that blocks (for ranks that saw nothing themselves)."""
    peer_rank: int | None


def agree(*, rank: int, world_size: int, local_origin: bool, local_kind: str | None, device: torch.device) -> Agreement:
    """One all-reduce of 2 × world_size numbers: who saw a local failure, who wants to block."""
    vec = torch.zeros(2 * world_size, dtype=torch.float32, device=device)
    vec[rank] = float(local_origin)
    if local_kind is not None:
        vec[world_size + rank] = float(KINDS.index(local_kind) + 1)
    torch.distributed.all_reduce(vec)
    host = vec.tolist()
    origins = [r for r in range(world_size) if host[r] > 0]
    blockers = [r for r in range(world_size) if host[world_size + r] > 0]
    peer = blockers[0] if blockers else None
    return Agreement(
        origin_ranks=origins,
        block=bool(blockers),
        peer_kind=KINDS[int(host[world_size + peer]) - 1] if peer is not None else None,
        peer_rank=peer,
    )
