"""Which rank writes the full bundle of an incident step under data parallelism, and which ranks
only a pointer to it (``Config.outputs.bundle_ranks``).

Every rank of a DDP job reaches the same decision at the same step, so every rank records the
incident. A full bundle holds the model and optimizer state and the batch (about the size of a
checkpoint); on a rank that only received the non-finite values through the gradient all-reduce,
or that followed a peer, the batch explains nothing, and the pre-step state is the replicas'
common state, which the origin's bundle holds too. So at scale only the origin rank(s) write a
full bundle and the others a small pointer (:mod:`nantrace.storage.pointer`):

- ``incident.details["origin_ranks"]`` names ranks → they hold the bundle;
- it names none (a gradient explosion or overflow of the shared, averaged gradients, a GradScaler
  collapse) → rank 0 holds it;
- an exception raised in one rank's step is that rank's own: always a full bundle.

Usage::

    holders = bundle_holders(incident, rank=1, world_size=16, setting="auto")
    # None: this rank writes its full bundle; [1, 3]: write a pointer to ranks 1 and 3
"""

from __future__ import annotations

from ..incident import Incident

__all__ = ["ALL_RANKS_UP_TO", "bundle_holders", "resolve_bundle_ranks"]

ALL_RANKS_UP_TO = 8
"""With ``bundle_ranks="auto"``, every rank writes its own full bundle up to this many ranks (one
node's worth: at most 8 copies of the state, each rank's bundle self-contained); above it, only
the origin rank(s)."""

RANK_LOCAL_KINDS = frozenset({"exception"})
"""Incident kinds that are one rank's own (not agreed across ranks): always a full bundle."""


def resolve_bundle_ranks(setting: str, world_size: int) -> str:
    """``"origin"`` or ``"all"``: what ``Config.outputs.bundle_ranks`` means for this world size."""
    if setting == "auto":
        return "all" if world_size <= ALL_RANKS_UP_TO else "origin"
    if setting not in ("origin", "all"):
        raise ValueError(f"bundle_ranks must be 'auto', 'origin' or 'all', got {setting!r}")
    return setting


def bundle_holders(incident: Incident, *, rank: int, world_size: int, setting: str) -> list[int] | None:
    """The ranks whose full bundle this rank's pointer should name, or ``None`` when this rank writes
    its own full bundle (one process, ``"all"``, a rank-local incident, or this rank holds it)."""
    if world_size <= 1 or incident.kind in RANK_LOCAL_KINDS or resolve_bundle_ranks(setting, world_size) == "all":
        return None
    origins = incident.details.get("origin_ranks")
    holders = sorted({int(r) for r in origins}) if isinstance(origins, list) and origins else [0]
    return None if rank in holders else holders
