"""Distributed sampler audit: do the ranks see disjoint shards that cover the data set?

Give `audit_sampler` one `DistributedSampler` (the other ranks' samplers are derived
from it), one sampler per rank, or any per-rank index lists. It reports duplicated
indices (with the ranks holding them), missing indices, uneven shard lengths (a DDP
hang at the end of the epoch) and sampler settings that disagree between ranks, and
tells DistributedSampler's own padding / tail dropping apart from a real bug.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import DistributedSampler

from ..taxonomy import SAMPLER_CAUSES
from .issues import DataIssue, IssueReport

__all__ = ["SAMPLER_CAUSES", "SamplerReport", "audit_sampler"]


_KEEP = 1000  # duplicated indices kept in the report
_LISTED = 10


@dataclass
class SamplerReport(IssueReport):
    """Result of `audit_sampler`.

    `duplicates` maps a dataset index to the ranks that received it (unexpected ones
    only; at most 1000 entries), `gaps` lists indices no rank received, and
    `expected_padding` / `expected_dropped` the indices DistributedSampler repeats
    (``drop_last=False``) or leaves out (``drop_last=True``) by design. `notes` explain
    expected behaviour in words. Issues' `sample_indices` are dataset indices.
    """

    world_size: int = 0
    dataset_len: int | None = None
    per_rank_counts: list[int] = field(default_factory=list)
    duplicates: dict[int, list[int]] = field(default_factory=dict)
    gaps: list[int] = field(default_factory=list)
    expected_padding: list[int] = field(default_factory=list)
    expected_dropped: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.update(
            world_size=self.world_size, dataset_len=self.dataset_len, per_rank_counts=list(self.per_rank_counts),
            duplicates={str(k): v for k, v in self.duplicates.items()}, gaps=list(self.gaps),
            expected_padding=list(self.expected_padding), expected_dropped=list(self.expected_dropped),
            notes=list(self.notes),
        )
        return out


def _is_per_rank(obj: Any) -> bool:
    if isinstance(obj, (list, tuple)) and obj:
        return all(not isinstance(x, (int, np.integer)) and isinstance(x, Iterable) for x in obj)
    return False


def _dataset_len(samplers: Sequence[Any]) -> int | None:
    for s in samplers:
        for attr in ("dataset", "data_source"):
            data = getattr(s, attr, None)
            if data is not None:
                try:
                    return len(data)
                except TypeError:
                    pass
    return None


def _config_issues(samplers: Sequence[Any], world_size: int) -> tuple[list[DataIssue], list[str]]:
    """Settings that must agree (or differ, for `rank`) across DistributedSamplers."""
    issues: list[DataIssue] = []
    hints: list[str] = []
    ds = [s for s in samplers if isinstance(s, DistributedSampler)]
    if len(ds) != len(samplers) or not ds:
        return issues, hints
    ranks = [s.rank for s in ds]
    if sorted(ranks) != list(range(world_size)):
        hints.append(f"the samplers were built with ranks {ranks}; rank r's sampler needs rank=r "
                     f"(e.g. rank=torch.distributed.get_rank())")
    for attr, why in (("num_replicas", "every rank needs num_replicas=world_size"),
                      ("seed", "DistributedSampler needs the same seed on every rank, or the shards overlap"),
                      ("epoch", "call sampler.set_epoch(epoch) with the same epoch on every rank"),
                      ("shuffle", "use the same shuffle setting on every rank"),
                      ("drop_last", "use the same drop_last on every rank")):
        values = [getattr(s, attr, None) for s in ds]
        if len(set(values)) > 1:
            hints.append(f"{attr} differs between ranks ({values}): {why}")
    replicas = {s.num_replicas for s in ds}
    if len(replicas) == 1 and next(iter(replicas)) != world_size:
        hints.append(f"the samplers were built for num_replicas={next(iter(replicas))} but {world_size} ranks were audited")
    if hints:
        issues.append(DataIssue(
            "sampler_config", "sampler", [],
            "sampler settings are inconsistent across ranks: " + "; ".join(hints) + ".",
            "Build every rank's sampler as DistributedSampler(dataset, num_replicas=world_size, "
            "rank=rank, shuffle=..., seed=<same on all ranks>) and call set_epoch(epoch) each epoch.",
            {"ranks": ranks, "seeds": [s.seed for s in ds], "epochs": [s.epoch for s in ds],
             "num_replicas": [s.num_replicas for s in ds]},
        ))
    return issues, hints


def audit_sampler(
    sampler_or_indices_per_rank: Any,
    *,
    dataset_len: int | None = None,
    world_size: int | None = None,
) -> SamplerReport:
    """Check that the ranks' shards are disjoint, cover ``range(dataset_len)`` and are even.

    * one `DistributedSampler`: the samplers of ranks ``0..num_replicas-1`` are copies
      of it with `rank` changed (no process group needed);
    * a list with one sampler / index iterable per rank: audited as given;
    * one ordinary sampler or index list with ``world_size=N``: what happens when every
      rank iterates that same, unsharded sampler.

    `dataset_len` defaults to ``len(sampler.dataset)`` / ``len(sampler.data_source)``;
    without either, the largest index + 1 is assumed (noted in the report).
    """
    obj = sampler_or_indices_per_rank
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"world_size must be a positive int or None; got {world_size!r}")
    if dataset_len is not None and (isinstance(dataset_len, bool) or not isinstance(dataset_len, int) or dataset_len < 0):
        raise ValueError(f"dataset_len must be an int >= 0 or None; got {dataset_len!r}")

    notes: list[str] = []
    if isinstance(obj, DistributedSampler):
        samplers: list[Any] = []
        for r in range(obj.num_replicas):
            s = copy.copy(obj)
            s.rank = r
            samplers.append(s)
        if world_size is not None and world_size != obj.num_replicas:
            notes.append(f"world_size={world_size} was given but the sampler has num_replicas={obj.num_replicas}")
    elif _is_per_rank(obj):
        samplers = list(obj)
        if world_size is not None and world_size != len(samplers):
            raise ValueError(f"world_size={world_size} but {len(samplers)} per-rank samplers/index lists were given")
    elif isinstance(obj, Iterable):
        samplers = [obj] * (world_size or 1)
    else:
        raise TypeError(
            "sampler_or_indices_per_rank must be a DistributedSampler, a sampler / index iterable, "
            f"or a list with one of those per rank; got {type(obj).__name__}"
        )
    ws = len(samplers)
    per_rank = [np.asarray([int(i) for i in s], dtype=np.int64) for s in samplers]
    counts = [int(a.size) for a in per_rank]

    n = dataset_len if dataset_len is not None else _dataset_len(samplers)
    everything = np.concatenate(per_rank) if per_rank else np.zeros(0, dtype=np.int64)
    if n is None:
        n = int(everything.max()) + 1 if everything.size else 0
        notes.append(f"dataset length unknown: assumed {n} (largest index + 1); pass dataset_len= to check the tail")
    rank_of = np.concatenate([np.full(a.size, r, dtype=np.int64) for r, a in enumerate(per_rank)]) if per_rank else everything

    issues, _ = _config_issues(samplers, ws)
    report = SamplerReport(world_size=ws, dataset_len=n, per_rank_counts=counts, notes=notes)

    outside = (everything < 0) | (everything >= n)
    if outside.any():
        bad = np.unique(everything[outside]).tolist()
        ranks = sorted(set(rank_of[outside].tolist()))
        issues.append(DataIssue(
            "sampler_out_of_range", "sampler", bad[:_KEEP],
            f"ranks {ranks} receive {len(bad)} index(es) outside [0, {n}), e.g. {bad[:_LISTED]}.",
            "The sampler was built for a different (larger) data set; rebuild it from the dataset "
            "the DataLoader uses.",
            {"ranks": ranks},
        ))
    inside = everything[~outside]
    inside_rank = rank_of[~outside]
    occurrences = np.bincount(inside, minlength=n) if n else np.zeros(0, dtype=np.int64)
    gaps = np.flatnonzero(occurrences == 0)
    dup_idx = np.flatnonzero(occurrences > 1)
    extra = int((occurrences[dup_idx] - 1).sum()) if dup_idx.size else 0

    # DistributedSampler by design: drop_last=False pads to ceil(n/ws) per rank with
    # repeats; drop_last=True trims to floor(n/ws) per rank.
    even = len(set(counts)) == 1
    padded = (even and not outside.any() and gaps.size == 0 and ws > 1 and n % ws != 0
              and counts[0] == math.ceil(n / ws) and extra == ws * counts[0] - n)
    trimmed = (even and not outside.any() and dup_idx.size == 0 and ws > 1 and n % ws != 0
               and counts[0] == n // ws and gaps.size == n - ws * counts[0])

    if padded:
        report.expected_padding = dup_idx.tolist()
        notes.append(
            f"{n} samples do not split evenly over {ws} ranks: {extra} index(es) {dup_idx.tolist()[:_LISTED]} "
            f"are repeated so that every rank gets {counts[0]} (DistributedSampler with drop_last=False). "
            "This is expected; set drop_last=True to drop the tail instead."
        )
    elif dup_idx.size:
        ranks_per: dict[int, list[int]] = {}
        order = np.argsort(inside, kind="stable")
        sorted_idx, sorted_rank = inside[order], inside_rank[order]
        starts = np.searchsorted(sorted_idx, dup_idx[:_KEEP], side="left")
        ends = np.searchsorted(sorted_idx, dup_idx[:_KEEP], side="right")
        for i, a, b in zip(dup_idx[:_KEEP].tolist(), starts.tolist(), ends.tolist()):
            ranks_per[i] = sorted_rank[a:b].tolist()
        report.duplicates = ranks_per
        same = [(a, b) for a in range(ws) for b in range(a + 1, ws)
                if per_rank[a].size and np.array_equal(per_rank[a], per_rank[b])]
        shared_all = dup_idx.size == n and all(len(set(ranks_per[i])) == ws for i in list(ranks_per)[:_LISTED])
        hint = ""
        if same:
            hint = (f" Ranks {sorted({r for pair in same for r in pair})} received identical shards: "
                    "every rank was given the same rank number, or an unsharded sampler.")
        elif shared_all:
            hint = " Every index goes to every rank: the sampler is not sharded (use DistributedSampler)."
        first = int(dup_idx[0])
        issues.append(DataIssue(
            "sampler_duplicate", "sampler", dup_idx[:_KEEP].tolist(),
            f"{dup_idx.size} index(es) are drawn more than once across ranks ({extra} extra draws), "
            f"e.g. index {first} on ranks {ranks_per[first]}.{hint}",
            "Give every rank a DistributedSampler(dataset, num_replicas=world_size, rank=rank, "
            "seed=<same on all ranks>), call set_epoch(epoch) on all ranks, and pass it to the "
            "DataLoader as sampler= (not shuffle=True).",
            {"duplicate_count": int(dup_idx.size), "extra_draws": extra, "identical_shards": [list(p) for p in same]},
        ))

    if trimmed:
        report.expected_dropped = gaps.tolist()
        notes.append(
            f"{gaps.size} index(es) {gaps.tolist()[:_LISTED]} are left out so that every rank gets "
            f"{counts[0]} (DistributedSampler with drop_last=True). This is expected; with shuffling "
            "a different tail is dropped each epoch once set_epoch is called."
        )
    elif gaps.size:
        report.gaps = gaps.tolist()
        issues.append(DataIssue(
            "sampler_gap", "sampler", gaps.tolist()[:_KEEP],
            f"{gaps.size} of {n} index(es) are never drawn by any rank, e.g. {gaps.tolist()[:_LISTED]}.",
            "Make the shards cover the data set: the same seed and epoch on all ranks, "
            "num_replicas equal to the world size, and rank r on rank r.",
            {"gap_count": int(gaps.size)},
        ))

    if not even:
        issues.append(DataIssue(
            "sampler_imbalance", "sampler", [],
            f"ranks receive different numbers of samples {counts}: under DDP the ranks with fewer "
            "batches leave the epoch early and the others wait forever in the next all-reduce.",
            "Use DistributedSampler (it evens out the shards), drop the tail (drop_last=True), "
            "or wrap the loop in torch.distributed.algorithms.Join.",
            {"per_rank_counts": counts},
        ))
    report.issues = issues
    return report
