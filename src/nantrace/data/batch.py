"""Batch validation: NaN/Inf, label range, schema drift and degenerate normalisation.

`validate_batch` walks a batch (a tensor, a mapping, a tuple/list, or any nesting of
those), computes every flag of a tensor on its device and transfers the result to the
host once per tensor, then turns what it saw into `DataIssue` objects. A `BatchSchema`
passed as `reference` carries what earlier batches looked like (structure, dtypes,
per-sample shapes, running distribution of each floating input).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..taxonomy import DATA_INCIDENT_CAUSES
from .issues import DataIssue, IssueReport

__all__ = [
    "DEFAULT_LABEL_KEYS",
    "PER_SAMPLE_CAUSES",
    "BatchReport",
    "BatchSchema",
    "validate_batch",
]

#: Mapping keys whose tensors are treated as labels.
DEFAULT_LABEL_KEYS: tuple[str, ...] = ("labels", "label", "targets", "target", "y")

#: Causes that concern individual samples (they can be repaired by dropping those samples).
PER_SAMPLE_CAUSES: frozenset[str] = frozenset(DATA_INCIDENT_CAUSES)

_MAX_LISTED = 8  # sample indices spelled out in a summary


# --------------------------------------------------------------------------- traversal


def _child_path(parent: str, key: Any) -> str:
    if isinstance(key, str):
        return f"{parent}[{json.dumps(key, ensure_ascii=False)}]"
    return f"{parent}[{key!r}]"


@dataclass(frozen=True)
class _Leaf:
    path: str
    tensor: torch.Tensor
    is_label: bool
    name: str  # innermost mapping key ("" when none)


def _as_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        # sparse, nested and meta tensors carry no dense values to inspect
        if value.layout != torch.strided or value.is_nested or value.is_meta:
            return None
        return value
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return torch.from_numpy(np.ascontiguousarray(value))
    return None


def _leaves(
    obj: Any, path: str, label_keys: frozenset[str], is_label: bool, name: str, top: bool
) -> Iterator[_Leaf]:
    tensor = _as_tensor(obj)
    if tensor is not None:
        yield _Leaf(path, tensor, is_label, name)
        return
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            label = is_label or (isinstance(key, str) and key in label_keys)
            key_name = key if isinstance(key, str) else name
            yield from _leaves(value, _child_path(path, key), label_keys, label, key_name, False)
        return
    if isinstance(obj, (list, tuple)) and not isinstance(obj, (str, bytes)):
        n = len(obj)
        for i, value in enumerate(obj):
            # (inputs, target) convention: the last element of a top-level pair/tuple
            # is a label when it holds integers.
            label = is_label
            if top and n >= 2 and i == n - 1:
                t = _as_tensor(value)
                label = label or (t is not None and _is_int(t))
            yield from _leaves(value, _child_path(path, i), label_keys, label, name, False)


def _is_int(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def _fmt_indices(indices: list[int]) -> str:
    if len(indices) <= _MAX_LISTED:
        return "[" + ", ".join(str(i) for i in indices) + "]"
    head = ", ".join(str(i) for i in indices[:_MAX_LISTED])
    return f"[{head}, ... ({len(indices)} in all)]"


def _g(x: float) -> str:
    """Compact number for a sentence."""
    if isinstance(x, float) and not math.isfinite(x):
        return {math.inf: "+Inf", -math.inf: "-Inf"}.get(x, "NaN")
    return f"{x:.4g}"


# --------------------------------------------------------------------------- schema


@dataclass
class _Welford:
    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, value: float) -> None:
        self.n += 1
        delta = value - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (value - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else 0.0


class BatchSchema:
    """What earlier batches looked like; pass it as ``validate_batch(..., reference=schema)``.

    The first batch it sees fixes the structure: the set of tensor paths, each tensor's
    dtype and per-sample shape (every dim but dim 0). Later batches are compared with it
    (`shape_mismatch`, `dtype_mismatch`). Dims listed in `variable_dims` may change
    (e.g. ``variable_dims=(1,)`` for text padded to the longest sequence of each batch;
    or a mapping ``{'batch["input_ids"]': (1,)}`` per path).

    It also keeps, per floating input, a running mean/std (Welford) of the per-batch mean
    and of the per-batch std. After `warmup` batches, a batch whose mean or std lies more
    than `shift_sigma` running standard deviations away is a `distribution_shift`. The
    spread used is at least `shift_floor` times the typical data std, so a run of nearly
    identical batches does not make the detector hair-triggered. Flagged batches do not
    update the running figures (one bad shard cannot drag the reference).
    """

    def __init__(
        self,
        *,
        variable_dims: Iterable[int] | Mapping[str, Iterable[int]] = (),
        shift_sigma: float = 6.0,
        warmup: int = 20,
        shift_floor: float = 0.01,
    ) -> None:
        if not (isinstance(shift_sigma, (int, float)) and shift_sigma > 0):
            raise ValueError(f"shift_sigma must be a number > 0; got {shift_sigma!r}")
        if not (isinstance(warmup, int) and warmup >= 2):
            raise ValueError(f"warmup must be an int >= 2 (batches before shifts are judged); got {warmup!r}")
        if not (isinstance(shift_floor, (int, float)) and shift_floor >= 0):
            raise ValueError(f"shift_floor must be a number >= 0; got {shift_floor!r}")
        if isinstance(variable_dims, Mapping):
            self._variable: dict[str, frozenset[int]] = {
                str(k): frozenset(int(d) for d in v) for k, v in variable_dims.items()
            }
            self._variable_all: frozenset[int] = frozenset()
        else:
            self._variable = {}
            self._variable_all = frozenset(int(d) for d in variable_dims)
        self.shift_sigma = float(shift_sigma)
        self.warmup = warmup
        self.shift_floor = float(shift_floor)
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.batches_seen = 0
        self._running: dict[str, tuple[_Welford, _Welford]] = {}

    @property
    def learned(self) -> bool:
        """True once the first batch fixed the structure."""
        return self.batches_seen > 0

    def describe(self) -> dict[str, Any]:
        """The learned structure and running statistics as plain data."""
        return {
            "batches_seen": self.batches_seen,
            "entries": {p: {"dtype": str(d), "sample_shape": list(s)} for p, (d, s) in self.entries.items()},
            "running": {
                p: {"mean_of_means": m.mean, "std_of_means": m.std, "mean_of_stds": s.mean,
                    "std_of_stds": s.std, "batches": m.n}
                for p, (m, s) in self._running.items()
            },
        }

    def _variable_dims(self, path: str, ndim: int) -> set[int]:
        dims = set(self._variable_all) | set(self._variable.get(path, ()))
        return {d % ndim for d in dims if -ndim <= d < ndim}

    # structure -----------------------------------------------------------------------

    def _check_structure(self, leaves: list[_Leaf]) -> list[DataIssue]:
        current = {leaf.path: (leaf.tensor.dtype, tuple(leaf.tensor.shape[1:])) for leaf in leaves}
        ndims = {leaf.path: leaf.tensor.ndim for leaf in leaves}
        if not self.learned:
            self.entries = current
            return []
        issues: list[DataIssue] = []
        for path, (dtype, shape) in self.entries.items():
            if path not in current:
                issues.append(DataIssue(
                    "shape_mismatch", path, [],
                    f"{path} is missing from this batch; the first batch had it "
                    f"({_dtype_name(dtype)}, per-sample shape {shape}).",
                    "Make every sample return the same keys/fields (a code path in the "
                    "dataset or collate_fn drops this entry for some records).",
                    {"expected": {"dtype": str(dtype), "sample_shape": list(shape)}, "got": None},
                ))
        for path, (dtype, shape) in current.items():
            if path not in self.entries:
                issues.append(DataIssue(
                    "shape_mismatch", path, [],
                    f"{path} appears in this batch ({_dtype_name(dtype)}, per-sample shape {shape}) "
                    "but not in the first batch.",
                    "Make every sample return the same keys/fields.",
                    {"expected": None, "got": {"dtype": str(dtype), "sample_shape": list(shape)}},
                ))
                continue
            want_dtype, want_shape = self.entries[path]
            if dtype != want_dtype:
                issues.append(DataIssue(
                    "dtype_mismatch", path, [],
                    f"{path} is {_dtype_name(dtype)} in this batch but {_dtype_name(want_dtype)} "
                    f"in the first batch.",
                    _dtype_fix(want_dtype, dtype),
                    {"expected": str(want_dtype), "got": str(dtype)},
                ))
            if not self._same_shape(path, ndims[path], want_shape, shape):
                issues.append(DataIssue(
                    "shape_mismatch", path, [],
                    f"{path} has per-sample shape {shape} in this batch but {want_shape} in the "
                    f"first batch.",
                    "Make every sample the same shape (e.g. convert grayscale images to RGB, "
                    "fix the resize/crop); if this dimension legitimately varies (dynamic "
                    "padding), declare it with BatchSchema(variable_dims=...).",
                    {"expected": list(want_shape), "got": list(shape)},
                ))
        return issues

    def _same_shape(self, path: str, ndim: int, want: tuple[int, ...], got: tuple[int, ...]) -> bool:
        if len(want) != len(got):
            return False
        free = self._variable_dims(path, ndim)
        return all(w == g or (i + 1) in free for i, (w, g) in enumerate(zip(want, got)))

    # distribution ----------------------------------------------------------------------

    def _check_distribution(self, path: str, mean: float, std: float) -> DataIssue | None:
        m_run, s_run = self._running.setdefault(path, (_Welford(), _Welford()))
        issue = None
        if m_run.n >= self.warmup:
            floor = self.shift_floor * max(s_run.mean, 1e-12)
            sd_m = max(m_run.std, floor)
            sd_s = max(s_run.std, floor)
            z_mean = abs(mean - m_run.mean) / sd_m
            z_std = abs(std - s_run.mean) / sd_s
            if z_mean > self.shift_sigma or z_std > self.shift_sigma:
                which = "mean" if z_mean >= z_std else "std"
                value, ref, sd, z = (
                    (mean, m_run.mean, sd_m, z_mean) if which == "mean" else (std, s_run.mean, sd_s, z_std)
                )
                issue = DataIssue(
                    "distribution_shift", path, [],
                    f"{path} has batch {which} {_g(value)}, {z:.1f} sigma away from the running "
                    f"{which} {_g(ref)} ± {_g(sd)} of the previous {m_run.n} batches "
                    f"(batch mean {_g(mean)}, std {_g(std)}).",
                    "Check where this batch came from: a shard or file that skipped "
                    "normalisation, a changed scale (0-255 vs 0-1), or corrupted records; "
                    "normalise every source the same way.",
                    {"batch_mean": mean, "batch_std": std, "running_mean": m_run.mean,
                     "running_mean_std": sd_m, "running_std": s_run.mean, "running_std_std": sd_s,
                     "z_mean": z_mean, "z_std": z_std, "batches": m_run.n,
                     "shift_sigma": self.shift_sigma},
                    severity="warning",
                )
        if issue is None:
            m_run.add(mean)
            s_run.add(std)
        return issue


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype)


def _dtype_fix(want: torch.dtype, got: torch.dtype) -> str:
    if got == torch.float64 and want.is_floating_point:
        return ("Cast in the dataset: numpy arrays default to float64 (use "
                f"array.astype(np.float32) or tensor.to({want})).")
    return f"Return {want} from every sample (cast in the dataset or the collate_fn)."


# --------------------------------------------------------------------------- report


@dataclass
class BatchReport(IssueReport):
    """Result of `validate_batch`: `ok`, `issues`, and the tensor paths that were checked."""

    checked: list[str] = field(default_factory=list)

    @property
    def bad_sample_indices(self) -> list[int]:
        """Samples named by a per-sample issue (NaN/Inf input, out-of-range label)."""
        bad: set[int] = set()
        for issue in self.issues:
            if issue.cause in PER_SAMPLE_CAUSES:
                bad.update(issue.sample_indices)
        return sorted(bad)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["checked"] = list(self.checked)
        return out


# --------------------------------------------------------------------------- checks


def _row_extremes(xr: torch.Tensor, rows: np.ndarray, acc: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Per-row min and max of the chosen rows of ``xr`` (NaN propagates), on the host."""
    sub = xr[torch.as_tensor(rows, dtype=torch.long, device=xr.device)]
    both = torch.stack([sub.amin(dim=1).to(acc), sub.amax(dim=1).to(acc)]).cpu().numpy().astype(np.float64)
    return both[0], both[1]


def _extremes_needed(n: float, mean: float, std: float, row_sumsq: np.ndarray, *, max_range: float,
                     spread_rtol: float) -> bool:
    """Could the range or the spread check fire? If not, the batch's min/max pass is skipped.

    Range: ``max - min <= 2 max|x| <= 2 sqrt(max over rows of the sum of squares)``.
    Spread: values within a relative band ``spread_rtol`` of their magnitude have
    ``std <= spread_rtol |mean|``; a std well above that (by a margin far larger than the
    rounding of float32 sums) rules the check out. Either test failing means: look exactly.
    """
    if n <= 1 or not (math.isfinite(mean) and math.isfinite(std)) or row_sumsq.size == 0 or spread_rtol >= 0.5:
        return True
    bound = 2.0 * math.sqrt(float(row_sumsq.max())) * 1.001
    if not math.isfinite(bound) or bound > max_range:
        return True
    return not std > max(0.3, 2.0 * spread_rtol) * abs(mean)


def _check_float(
    leaf: _Leaf, *, want_stats: bool, max_range: float, spread_rtol: float, reference: BatchSchema | None
) -> list[DataIssue]:
    t = leaf.tensor.detach()
    if t.numel() == 0:
        return []
    xr = t.reshape(t.shape[0], -1) if t.ndim else t.reshape(1, 1)
    rows = xr.shape[0]
    # Memory-bound passes, computed on the tensor's device and moved to the host in one go:
    # the per-row sum (a NaN or Inf makes it non-finite: which rows are bad) and, with
    # statistics, the per-row sum of squares. Extremes cost a pass of their own and are only
    # computed when a check needs them (see _extremes_needed), per row only for the rows
    # that need them.
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    parts = [xr.sum(dim=1, dtype=acc)]
    if want_stats:
        parts.append(torch.linalg.vector_norm(xr, 2, dim=1, dtype=acc).square())
    host = torch.cat(parts).cpu().numpy().astype(np.float64)
    row_sum = host[:rows]
    per_row = xr.shape[1]
    issues: list[DataIssue] = []

    bad = np.zeros(rows, dtype=bool)
    rmin_h = np.full(rows, np.nan)
    rmax_h = np.full(rows, np.nan)
    suspect = np.flatnonzero(~np.isfinite(row_sum))
    if suspect.size:  # non-finite values, or a sum that overflowed: the row's extremes decide
        lo_hi = _row_extremes(xr, suspect, acc)
        rmin_h[suspect], rmax_h[suspect] = lo_hi
        bad[suspect] = ~(np.isfinite(lo_hi[0]) & np.isfinite(lo_hi[1]))
    if bad.any():
        bad_rows = np.flatnonzero(bad).tolist()
        kinds = {}
        for r in bad_rows:
            lo, hi = rmin_h[r], rmax_h[r]
            if np.isnan(lo) or np.isnan(hi):
                kinds[r] = "NaN"
            elif hi == np.inf and lo == -np.inf:
                kinds[r] = "+Inf and -Inf"
            else:
                kinds[r] = "+Inf" if hi == np.inf else "-Inf"
        sample_list = bad_rows if t.ndim else []
        if t.ndim:
            groups = {k: [r for r in bad_rows if kinds[r] == k] for k in sorted(set(kinds.values()))}
            where = ", ".join(f"{k} in sample{'s' if len(v) > 1 else ''} {_fmt_indices(v)}" for k, v in groups.items())
            text = f"{leaf.path} contains {where} ({len(bad_rows)} of {xr.shape[0]} samples)."
        else:
            text = f"{leaf.path} is {kinds[0]}."
        issues.append(DataIssue(
            "nonfinite_input", leaf.path, sample_list,
            text,
            "Find these records in the dataset (a failed decode, a division by a zero "
            "count, log of 0 in feature engineering, an overflow when casting to fp16) "
            "and fix or filter them; ValidatingCollate(policy='skip') drops them meanwhile.",
            {"values": {str(r): kinds[r] for r in bad_rows}, "batch_size": int(xr.shape[0])},
        ))

    if not want_stats:
        return issues
    good = ~bad
    if not good.any():
        return issues
    n = float(good.sum()) * per_row
    mean = float(row_sum[good].sum() / n)
    var = float(host[rows:2 * rows][good].sum() / n) - mean * mean
    std = math.sqrt(max(var, 0.0) * n / (n - 1)) if n > 1 else 0.0
    if not _extremes_needed(n, mean, std, host[rows:2 * rows][good], max_range=max_range, spread_rtol=spread_rtol):
        if reference is not None and math.isfinite(std):
            shift = reference._check_distribution(leaf.path, mean, std)
            if shift is not None:
                issues.append(shift)
        return issues
    if bad.any():  # only over the good rows
        lo_g, hi_g = _row_extremes(xr, np.flatnonzero(good), acc)
        lo, hi = float(lo_g.min()), float(hi_g.max())
    else:
        lo, hi = (float(v) for v in torch.stack(torch.aminmax(xr)).to(acc).cpu().tolist())
    stats = {"mean": mean, "std": std, "min": lo, "max": hi, "numel": int(n)}

    # "std ~ 0 relative to the magnitude", judged on the exact spread (std <= spread / 2)
    # rather than on a sum-of-squares std, which cancellation blurs when |mean| >> std.
    if n > 1 and hi - lo <= spread_rtol * max(abs(lo), abs(hi)):
        what = (f"is constant (every value {_g(lo)})" if hi == lo else
                f"varies only within [{_g(lo)}, {_g(hi)}], negligible next to its magnitude")
        issues.append(DataIssue(
            "degenerate_normalisation", leaf.path, [],
            f"{leaf.path} {what} across the batch.",
            "Check the preprocessing: a normalisation that divided by a zero/huge std, "
            "an image pipeline that produced blank images, or a feature that carries no "
            "information; normalise with per-feature statistics computed on the data.",
            dict(stats, kind="constant" if hi == lo else "tiny_spread"),
            severity="warning",
        ))
    if not math.isfinite(mean) or not math.isfinite(std):  # sums overflowed: figures unusable
        std = math.inf
    if hi - lo > max_range:
        rmin_h, rmax_h = _row_extremes(xr, np.arange(rows), acc)
        rows_range = (rmax_h - rmin_h) > max_range
        wide = np.flatnonzero(good & rows_range).tolist()
        if not wide:  # the spread is between samples: name the extreme ones
            wide = sorted({int(np.nanargmin(np.where(good, rmin_h, np.inf))),
                           int(np.nanargmax(np.where(good, rmax_h, -np.inf)))})
        issues.append(DataIssue(
            "degenerate_normalisation", leaf.path, wide if t.ndim else [],
            f"{leaf.path} spans [{_g(lo)}, {_g(hi)}] (range {_g(hi - lo)} > {_g(max_range)}), "
            f"mean {_g(mean)}, std {_g(std)}: the input looks unnormalised.",
            "Normalise the input (e.g. (x - mean) / std per feature, or scale raw pixels to "
            "[0, 1]); large raw values overflow fp16 and make the first layers' gradients explode.",
            dict(stats, kind="large_range", max_range=max_range),
            severity="warning",
        ))
    if reference is not None and math.isfinite(std):
        shift = reference._check_distribution(leaf.path, mean, std)
        if shift is not None:
            issues.append(shift)
    return issues


def _check_labels(leaf: _Leaf, *, num_classes: int | None, ignore_index: int | None) -> list[DataIssue]:
    y = leaf.tensor.detach()
    if y.numel() == 0:
        return []
    yr = y.reshape(y.shape[0], -1) if y.ndim else y.reshape(1, 1)
    ign = (yr == ignore_index) if ignore_index is not None else torch.zeros_like(yr, dtype=torch.bool)
    out = yr < 0
    if num_classes is not None:
        out = out | (yr >= num_classes)
    out = out & ~ign
    info = torch.iinfo(yr.dtype)
    vmin = torch.where(ign, info.max, yr).amin()
    vmax = torch.where(ign, info.min, yr).amax()
    # One row reduction for two figures: (#out-of-range) * (T + 1) + (#supervised).
    width = yr.shape[1] + 1
    code = (out.to(torch.int64) * width + (~ign).to(torch.int64)).sum(dim=1)
    packed = torch.cat([code, vmin.reshape(1).to(torch.int64), vmax.reshape(1).to(torch.int64)]).cpu().tolist()
    b = yr.shape[0]
    row_bad = [c // width for c in packed[:b]]
    row_valid = [c % width for c in packed[:b]]
    lo, hi = packed[b], packed[b + 1]
    issues: list[DataIssue] = []
    rows = [i for i, flag in enumerate(row_bad) if flag]
    valid_range = f"[0, {num_classes})" if num_classes is not None else "[0, num_classes)"
    ign_note = f"; ignore_index {ignore_index} is allowed" if ignore_index is not None else ""
    if rows:
        indices = rows if y.ndim else []
        issues.append(DataIssue(
            "label_out_of_range", leaf.path, indices,
            f"{leaf.path} holds class indices outside {valid_range} in "
            f"{'samples ' + _fmt_indices(rows) if y.ndim else 'the batch'} "
            f"(labels seen span {lo}..{hi}{ign_note}).",
            (f"Map labels to 0..{num_classes - 1} (check for 1-based class ids, an extra "
             f"background class, or a num_classes that is too small)"
             if num_classes is not None else
             "Negative labels other than ignore_index crash cross-entropy (or index out of "
             "bounds on the GPU); map them to valid classes or to ignore_index")
            + (f"; use {ignore_index} (ignore_index) for positions without a label." if ignore_index is not None else "."),
            {"min": lo, "max": hi, "num_classes": num_classes, "ignore_index": ignore_index,
             "kind": "out_of_range"},
        ))
    if ignore_index is not None and sum(row_valid) == 0:
        all_rows = list(range(b)) if y.ndim else []
        issues.append(DataIssue(
            "label_out_of_range", leaf.path, all_rows,
            f"every label in {leaf.path} equals ignore_index {ignore_index}: a mean "
            f"cross-entropy over this batch is 0/0 = NaN.",
            "Drop samples that have no supervised position (e.g. prompts truncated before "
            "the answer), or use reduction='sum' divided by max(count, 1).",
            {"ignore_index": ignore_index, "kind": "all_ignored", "batch_size": b},
        ))
    return issues


def _check_args(num_classes: Any, ignore_index: Any, max_range: Any, spread_rtol: Any) -> None:
    if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes <= 0):
        raise ValueError(f"num_classes must be a positive int or None; got {num_classes!r}")
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise TypeError(f"ignore_index must be an int or None; got {ignore_index!r}")
    if not (isinstance(max_range, (int, float)) and max_range > 0):
        raise ValueError(f"max_range must be a number > 0; got {max_range!r}")
    if not (isinstance(spread_rtol, (int, float)) and spread_rtol >= 0):
        raise ValueError(f"spread_rtol must be a number >= 0; got {spread_rtol!r}")


def validate_batch(
    batch: Any,
    *,
    num_classes: int | None = None,
    ignore_index: int | None = -100,
    label_keys: Iterable[str] = DEFAULT_LABEL_KEYS,
    reference: BatchSchema | None = None,
    max_range: float = 1e4,
    spread_rtol: float = 1e-6,
    skip_stats_keys: Iterable[str] = ("mask",),
    stats: bool = True,
) -> BatchReport:
    """Check one batch and report every problem with its path and sample indices.

    Labels are the tensors under a mapping key in `label_keys`, and the last element of
    a top-level tuple/list when it holds integers. Integer labels must lie in
    ``[0, num_classes)`` or equal `ignore_index`; a batch whose labels are all
    `ignore_index` is reported too (mean cross-entropy would be 0/0). Floating tensors
    are checked for NaN/Inf and, unless they are labels or their key contains one of
    `skip_stats_keys` (float attention masks are legitimately constant), for degenerate
    normalisation (constant or max - min <= `spread_rtol` * magnitude, i.e. std ~ 0;
    range > `max_range`). With a
    `reference` schema, structure changes and distribution shifts are reported as well.
    One host transfer per tensor; ``stats=False`` keeps only the NaN/Inf, label and
    structure checks (two passes over a floating tensor instead of four).
    """
    _check_args(num_classes, ignore_index, max_range, spread_rtol)
    if reference is not None and not isinstance(reference, BatchSchema):
        raise TypeError(f"reference must be a nantrace.data.BatchSchema or None; got {type(reference).__name__}")
    labels = frozenset(label_keys)
    skip = tuple(s.lower() for s in skip_stats_keys)
    leaves = list(_leaves(batch, "batch", labels, False, "", True))
    issues: list[DataIssue] = []
    if reference is not None:
        issues += reference._check_structure(leaves)
    for leaf in leaves:
        t = leaf.tensor
        if t.is_floating_point():
            want_stats = stats and not leaf.is_label and not any(s in leaf.name.lower() for s in skip)
            issues += _check_float(leaf, want_stats=want_stats, max_range=max_range,
                                   spread_rtol=spread_rtol, reference=reference)
        elif leaf.is_label and _is_int(t):
            issues += _check_labels(leaf, num_classes=num_classes, ignore_index=ignore_index)
    if reference is not None:
        reference.batches_seen += 1
    return BatchReport(issues=issues, checked=[leaf.path for leaf in leaves])
