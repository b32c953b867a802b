"""The origin rule: follow the failing value back through the ops that produced it.

From the op where the failure was observed, follow NaN back to the op that created it
(its inputs held no NaN). If that op's inputs carried an infinity, follow the infinity
back to where it was created: an overflow there is the origin; an explicit constant (a
``-inf`` mask) is intentional, and the NaN-creating op (e.g. a softmax over a fully
masked row) is the origin.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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


def _earliest(refs: list[InputRef], births: dict[Any, int]) -> InputRef:
    """Of several bad operands, the one whose non-finite values were made first: values from outside
    the traced ops (parameters, inputs) before any op, then by the execution order of the op that
    created them (not of the op that last touched them: a matmul's view of its left operand runs
    before that of its right one), so that when two ops each broke and their results met, the first
    one that broke is named."""
    return min(refs, key=lambda r: _birth(r, births))


def _birth(ref: InputRef, births: dict[Any, int]) -> int:
    """The index of the op that created ``ref``'s NaN (-1: from outside the traced ops): its NaN
    followed back to the op that made it from NaN-free inputs, or to the overflow that made an
    infinity it was made from (an infinity filled in on purpose, a mask, does not count). Memoised
    in ``births``."""
    if ref.producer is None:
        return -1
    return _first_index(ref.producer, births, _through_nan, lambda r: _overflow_births(r, births) if not r.in_nan else [])


def _through_nan(rec: OpRecord) -> list[InputRef]:
    return [i for i in rec.inputs if i.nan] if rec.in_nan else []


def _overflow_births(rec: OpRecord, memo: dict[Any, int]) -> list[int]:
    """Where the infinities reaching ``rec`` overflowed (ops that made them from finite values, not
    constants), as indices."""
    out = []
    for ref in rec.inputs:
        if ref.inf and ref.producer is not None:
            first = _first_index(ref.producer, memo, _through_inf, None, counts=_overflowed)
            if first < _NONE:
                out.append(first)
    return out


_NONE = 1 << 62


def _through_inf(rec: OpRecord) -> list[InputRef]:
    return [i for i in rec.inputs if i.inf] if rec.in_inf else []


def _overflowed(rec: OpRecord) -> bool:
    return rec.out_inf and rec.creates_nonfinite and not rec.is_constant


def _first_index(root: OpRecord, memo: dict[Any, int], follow: Any, extra: Any = None, counts: Any = None) -> int:
    """min(index) over ``root`` and the records reached back through ``follow(record)``'s inputs, of the
    records ``counts`` accepts (all by default; none found: a huge number), plus ``extra(record)``'s
    indices; iterative, memoised in ``memo`` by (record, ``follow``)."""
    stack = [root]
    while stack:
        rec = stack[-1]
        if (id(rec), follow) in memo:
            stack.pop()
            continue
        refs = follow(rec)
        todo = [i.producer for i in refs if i.producer is not None and (id(i.producer), follow) not in memo]
        if todo and len(stack) < 10_000:
            stack.extend(todo)
            continue
        found = [rec.index if counts is None or counts(rec) else _NONE]
        found += [(-1 if counts is None else _NONE) if i.producer is None else memo.get((id(i.producer), follow), _NONE)
                  for i in refs]
        if extra is not None:
            found.extend(extra(rec))
        memo[(id(rec), follow)] = min(found)
        stack.pop()
    return memo[(id(root), follow)]


def _inf_sources(op: OpRecord) -> list[tuple[OpRecord | InputRef, list[OpRecord]]]:
    """Every place an infinity reaching ``op`` was created: an op with finite inputs (an
    overflow, or an explicit constant such as a ``-inf`` fill), or an operand from outside
    the traced ops. Each with the ops from ``op`` back to it."""
    found: list[tuple[OpRecord | InputRef, list[OpRecord]]] = []
    seen: set[int] = set()
    stack: list[tuple[OpRecord, list[OpRecord]]] = [(op, [])]
    while stack and len(seen) < 10_000:
        cur, trail = stack.pop()
        for ref in cur.inputs:
            if not ref.inf:
                continue
            if ref.producer is None:
                found.append((ref, trail))
                continue
            prod = ref.producer
            if id(prod) in seen:
                continue
            seen.add(id(prod))
            if prod.in_inf and not prod.in_nan:
                stack.append((prod, trail + [prod]))
            elif prod.out_inf:
                found.append((prod, trail + [prod]))
    return found


def applied_as_mask(ref: InputRef, consumer: OpRecord) -> bool:
    """Whether ``ref``, an operand of ``consumer`` that the tracer took for a ``-inf`` mask (a tensor from outside
    whose only non-finite values are ``-inf``, read by a masking op), was applied as one: its ``-inf`` stays ``-inf``
    there. The subtracted operand of a subtraction is negated (``x - t``: ``-inf`` becomes ``+inf``), so it is a
    value the code used, not a mask it applied (a log-probability of 0 subtracted in an importance ratio)."""
    if not ref.mask:
        return False
    name = consumer.op.split(".")[1] if consumer.op.count(".") >= 2 else consumer.op
    return not (name == "sub" and ref.position in ("arg1", "other"))


_BACKWARD_STARTS = 48
"""How many live backward ops reading a forward op's non-finite value :func:`backward_start` traces back from, in
backward order."""


def backward_start(records: list[OpRecord]) -> OpRecord | None:
    """Where to start the origin rule for a failure seen in the gradients: the first backward op
    whose non-finite output reached what was observed. A value that went no further (masked by an
    op with a finite result, as a norm's derivative masks its own 0/0, and read by no later record)
    is no origin. The values left non-finite at the end (the gradients returned, and what read them)
    are the sinks; every record they were made from, through non-finite inputs, is live. Without a
    live backward op, the first backward op with a non-finite output.

    Backward runs the model's last block first, so the first live backward op may lead to a forward
    op of a later block while an identical one of an earlier block broke first and its values reached
    the gradients too. When the live backward ops lead back to forward ops, the origin rule is applied
    from the first of them and from each that reads a non-finite value a forward op made (where a forward
    value enters the backward; the first :data:`_BACKWARD_STARTS`), and the one whose forward origin ran
    first is returned: the first bad value of the step, in forward time. When none does (the non-finite
    gradient was born in the backward: a singularity whose forward is finite), the first live backward
    op is kept."""
    consumed = {id(ref.producer) for r in records for ref in r.inputs if ref.producer is not None}
    live: set[int] = set()
    stack = [r for r in records if not r.absorbed and id(r) not in consumed]
    while stack:
        r = stack.pop()
        if id(r) in live:
            continue
        live.add(id(r))
        stack.extend(ref.producer for ref in r.inputs if ref.producer is not None and id(ref.producer) not in live)
    starts = [r for r in records if r.phase == "backward" and id(r) in live]
    if not starts:
        return next((r for r in records if r.phase == "backward"), None)
    # a forward value reaches the backward where a backward op reads a non-finite tensor a forward op made (a
    # saved input or output): only there can a trace lead to another forward origin than its successors' do
    entries = [r for r in starts if any((ref.nan or ref.inf) and ref.producer is not None
                                        and ref.producer.phase != "backward" for ref in r.inputs)]
    best, best_index = starts[0], None
    for start in [starts[0]] + entries[:_BACKWARD_STARTS]:
        found = trace_back(start).record
        if found is None or found.phase != "forward":
            continue
        if best_index is None or found.index < best_index:
            best, best_index = start, found.index
    return best


def trace_back(start: OpRecord) -> Origin:
    """Apply the origin rule from ``start`` (the op where the failure was observed)."""
    path = [start]
    cur = start
    births: dict[Any, int] = {}
    while cur.out_nan and cur.in_nan:
        ref = _earliest([i for i in cur.inputs if i.nan], births)
        if ref.producer is None:
            return Origin(record=cur, chain=path[::-1], external=ref)
        cur = ref.producer
        path.append(cur)
    nan_creator = cur if cur.out_nan else None
    if not cur.in_inf:
        if cur.out_inf and cur.creates_nonfinite and cur.is_constant:
            return Origin(record=nan_creator or cur, chain=path[::-1], nan_creator=nan_creator, inf_creator=cur,
                          intentional_inf=True)
        return Origin(record=cur, chain=path[::-1], nan_creator=nan_creator,
                      inf_creator=cur if cur.out_inf and cur.creates_nonfinite else None)
    sources = _inf_sources(cur)
    for src, trail in sources:  # an infinite parameter or batch value is the origin (a -inf mask input is not)
        if isinstance(src, InputRef) and src.external and (src.external.startswith("param:") or (
                src.external == "input" and not applied_as_mask(src, trail[-1] if trail else cur))):
            return Origin(record=trail[-1] if trail else cur, chain=(path + trail)[::-1], nan_creator=nan_creator, external=src)
    overflows = [(src, trail) for src, trail in sources if isinstance(src, OpRecord) and src.creates_nonfinite
                 and not src.is_constant]
    if overflows:
        src, trail = min(overflows, key=lambda item: item[0].index)
        assert isinstance(src, OpRecord)
        return Origin(record=src, chain=(path + trail)[::-1], nan_creator=nan_creator, inf_creator=src)
    # every infinity came from an explicit constant (a mask): intentional; the NaN-creating op is the origin
    const = next((src for src, _ in sources if isinstance(src, OpRecord)), None)
    trail = next((t for src, t in sources if src is const), [])
    return Origin(record=nan_creator or cur, chain=(path + trail)[::-1], nan_creator=nan_creator, inf_creator=const,
                  intentional_inf=True)


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
