"""The origin rule: follow the failing value back through the ops that produced it.

From the op where the failure was observed, follow NaN back to the op that created it
(its inputs held no NaN). If that op's inputs carried an infinity, follow the infinity
back to where it was created: an overflow there is the origin; an explicit constant (a
``-inf`` mask) is intentional, and the NaN-creating op (e.g. a softmax over a fully
masked row) is the origin.
"""

from __future__ import annotations

import dataclasses

from .tracer import InputRef, OpRecord

_TRIVIAL = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "clone", "detach", "alias",
    "_to_copy", "contiguous", "slice", "select", "unsqueeze", "squeeze", "as_strided", "split", "split_with_sizes",
    "lift_fresh", "lift_fresh_copy", "copy_", "unbind", "chunk", "flatten", "_reshape_alias", "narrow",
}


@dataclasses.dataclass
class Origin:
    """Where a failure began, and the path it took to where it was seen."""

    record: OpRecord | None
    chain: list[OpRecord]
    nan_creator: OpRecord | None = None
    inf_creator: OpRecord | None = None
    external: InputRef | None = None
    """Set when the bad values entered from outside the replayed ops (a parameter, a model input)."""
    intentional_inf: bool = False
    """The infinity on the path came from an explicit constant (a mask), not an overflow."""


def _first(refs: list[InputRef], *, nan: bool) -> InputRef | None:
    for ref in refs:
        if (ref.nan if nan else ref.inf):
            return ref
    return None


def trace_back(start: OpRecord) -> Origin:
    """Apply the origin rule from ``start`` (the op where the failure was observed)."""
    path = [start]
    cur = start
    nan_creator = None
    external = None
    while cur.out_nan and cur.in_nan:
        ref = _first(cur.inputs, nan=True)
        assert ref is not None
        if ref.producer is None:
            external = ref
            break
        cur = ref.producer
        path.append(cur)
    if external is not None:
        return Origin(record=cur, chain=path[::-1], external=external)
    if cur.out_nan:
        nan_creator = cur
    intentional = False
    while cur.in_inf:
        ref = _first(cur.inputs, nan=False)
        assert ref is not None
        if ref.producer is None:
            if ref.external and (ref.external.startswith("param:") or ref.external == "input"):
                return Origin(record=cur, chain=path[::-1], nan_creator=nan_creator, external=ref)
            intentional = True  # an inf tensor made outside the traced ops: a constant or mask buffer
            break
        cur = ref.producer
        path.append(cur)
    inf_creator = cur if (cur.out_inf and cur.creates_nonfinite) else None
    if inf_creator is not None and inf_creator.is_constant:
        intentional = True
    if inf_creator is not None and not intentional:
        origin = inf_creator
    elif nan_creator is not None:
        origin = nan_creator
    else:
        origin = cur
    chain = path[::-1]
    return Origin(record=origin, chain=chain, nan_creator=nan_creator, inf_creator=inf_creator, intentional_inf=intentional)


def chain_summary(origin: Origin, limit: int = 8) -> list[dict[str, object]]:
    """The chain from the origin to the observation, without pure data-movement ops."""
    recs = origin.chain
    if origin.record is not None and origin.record in recs:
        recs = recs[recs.index(origin.record):] if not origin.intentional_inf else recs
    out = []
    for i, r in enumerate(recs):
        short = r.op.split(".")[1] if r.op.count(".") >= 2 else r.op
        if short in _TRIVIAL and 0 < i < len(recs) - 1:
            continue
        item = r.describe()
        item["origin"] = r is origin.record
        out.append(item)
    if len(out) > limit:
        out = out[: limit - 2] + [{"op": f"... {len(out) - limit + 1} more ops ...", "phase": None, "module": None}] + out[-1:]
    return out
