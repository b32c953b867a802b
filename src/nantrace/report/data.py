"""Load a run store and reduce it to what the report draws (no plotting here).

Everything is read with plain SQL on a read-only connection and turned into numpy arrays:
the steps table (one row per optimizer step) is small enough to read whole; the per-layer
tables can hold tens of millions of rows, so they are aggregated inside SQLite into at
most ``max_columns`` step buckets per layer, in a few threads (SQLite releases the GIL).

Non-finite values are never dropped: a curve keeps them as separate marks (NaN, +Inf,
-Inf), exact per step when there are few, counted per bucket when there are many; a
heatmap cell keeps NaN / Inf whenever any value in its bucket was non-finite.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from ..incident import Incident
from ..storage.runlife import RunStatus
from ..storage.runstore import DB_NAME, RunStore

MAX_CURVE_BUCKETS = 2000
"""Curves with more steps than this are reduced to min / max / last per bucket."""
MAX_EXACT_MARKS = 2000
"""Up to this many non-finite (or skipped) steps are marked one by one; beyond, per bucket."""
MAX_HEATMAP_COLUMNS = 1000
"""Step columns of a layers × steps heatmap at most."""
MAX_EXACT_LAYER_ROWS = 8_000_000
"""A per-layer table with more rows than this is read at every k-th recorded step (k chosen to
stay under it) plus, in full, every step with an incident, a skipped update or a non-finite
loss / gradient norm / parameter norm; below it every row is aggregated."""
MAX_WORKERS = 8
"""Threads (each with its own read-only connection) aggregating the per-layer tables."""


# ----------------------------------------------------------------------------- records
@dataclasses.dataclass
class Marks:
    """Steps at which something happened (a NaN, a skipped update), possibly bucketed.

    ``start[i]``..``end[i]`` is the step range of mark ``i`` and ``count[i]`` how many steps
    in it carry the event; when ``exact`` every mark is one step (``start == end``).
    """

    start: np.ndarray
    end: np.ndarray
    count: np.ndarray
    exact: bool
    labels: list[str] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return int(self.count.sum()) if len(self.count) else 0

    def __len__(self) -> int:
        return len(self.start)


@dataclasses.dataclass
class Curve:
    """One health figure over steps, ready to draw.

    ``x``/``y`` is the line (``y`` NaN = a gap in it: a missing or non-finite value);
    ``nan``, ``posinf``, ``neginf`` mark the non-finite values and ``nonpositive`` the
    values a log axis cannot show (zero or negative), so nothing disappears silently.
    """

    key: str
    label: str
    x: np.ndarray
    y: np.ndarray
    nan: Marks
    posinf: Marks
    neginf: Marks
    nonpositive: Marks
    log: bool
    measured: int

    @property
    def nonfinite(self) -> int:
        return self.nan.total + self.posinf.total + self.neginf.total


@dataclasses.dataclass
class Heatmap:
    """A layers × step-buckets grid of one per-layer figure (max over each bucket).

    ``values[layer, column]`` is the largest finite value of the bucket, NaN if any value
    in the bucket was NaN, +Inf if any was infinite (and none NaN); ``present`` is False
    where the layer has no value in that bucket. ``stride`` > 1: only every ``stride``-th
    recorded step (and every special step) was read, ``rows_read`` of ``rows_total``.
    """

    key: str
    title: str
    label: str
    layers: list[str]
    start: np.ndarray
    end: np.ndarray
    values: np.ndarray
    present: np.ndarray
    bucket_width: int
    stride: int = 1
    rows_total: int = 0
    rows_read: int = 0

    @property
    def nonfinite_cells(self) -> int:
        return int((self.present & ~np.isfinite(self.values)).sum())


@dataclasses.dataclass
class ReportData:
    """Everything the report shows about one run directory."""

    run_dir: Path
    meta: dict[str, Any]
    steps: np.ndarray
    first_step: int | None
    last_step: int | None
    duration_s: float | None
    curves: list[Curve]
    skipped: Marks
    scaler_skips: Marks
    incidents: list[Incident]
    incident_rows: dict[int, dict[str, Any]]
    heatmaps: list[Heatmap]
    layer_rows: int
    downsampled: bool
    status: RunStatus | None = None
    """How the run stands or ended (``finished``, ``interrupted``...; see ``docs/run_store.md``)."""

    @property
    def n_steps(self) -> int:
        return int(len(self.steps))


# ----------------------------------------------------------------------------- loading
def resolve_run_dir(run_dir: str | os.PathLike[str]) -> Path:
    """The run directory for ``run_dir`` (a path to its ``nantrace.db`` is accepted too)."""
    path = Path(run_dir)
    if path.name == DB_NAME and path.is_file():
        return path.parent
    if path.exists() and not path.is_dir():
        raise ValueError(f"{str(path)!r} is a file, not a run directory; expected the directory given to "
                         f"nantrace.watch(run_dir=...), which holds {DB_NAME}")
    return path


def load_report_data(
    run_dir: str | os.PathLike[str],
    *,
    max_curve_buckets: int = MAX_CURVE_BUCKETS,
    max_heatmap_columns: int = MAX_HEATMAP_COLUMNS,
    max_exact_marks: int = MAX_EXACT_MARKS,
    max_exact_layer_rows: int = MAX_EXACT_LAYER_ROWS,
    workers: int | None = None,
) -> ReportData:
    """Read ``run_dir``'s run store and reduce it for drawing.

    ``workers`` threads aggregate the per-layer tables (default: one per CPU, at most
    ``MAX_WORKERS``). Raises ``ValueError`` when ``run_dir`` is missing or holds no readable
    ``nantrace.db``.
    """
    path = resolve_run_dir(run_dir)
    if workers is None:
        workers = min(MAX_WORKERS, os.cpu_count() or 1)
    with RunStore(path, readonly=True) as store:  # validates the directory and the database
        meta = store.meta()
        incidents = store.incidents()
        status = store.status()
        raw = store.raw_steps()
        layer_span = store.step_span("layer_stats")
        act_span = store.step_span("activation_stats")
    steps = np.fromiter((r[0] for r in raw), dtype=np.int64, count=len(raw))
    times = [r[1] for r in raw if isinstance(r[1], (int, float))]
    incident_steps = np.array(sorted({i.step for i in incidents}), dtype=np.int64)
    buckets = _Buckets.for_steps(steps, max_curve_buckets)
    keep = np.flatnonzero(np.isin(steps, incident_steps)) if len(steps) else np.zeros(0, dtype=np.int64)

    curves: list[Curve] = []
    for key, col, label, log in (
        ("loss", 2, "loss", None),
        ("grad_norm", 3, "global grad norm", True),
        ("param_norm", 4, "param norm", True),
    ):
        values, kinds = _column([r[col] for r in raw])
        if log is None:  # a log axis for the loss only when it is positive and spans decades
            finite = values[kinds == _KIND_FINITE]
            log = bool(len(finite) and finite.min() > 0 and finite.max() / finite.min() > 1e3)
        curves.append(_curve(key, label, steps, values, kinds, buckets, keep, log, max_exact_marks))
    for g, lr_values in enumerate(_lr_groups([r[5] for r in raw])):
        values, kinds = _column(lr_values)
        curves.append(_curve(f"lr{g}", f"lr (group {g})", steps, values, kinds, buckets, keep, False, max_exact_marks))
    values, kinds = _column([r[6] for r in raw])
    if (kinds != _KIND_MISSING).any():
        curves.append(_curve("scale", "loss scale", steps, values, kinds, buckets, keep, True, max_exact_marks))

    skipped_flags = np.array([bool(r[7]) for r in raw], dtype=bool)
    scaler_flags = np.array([r[8] == "scaler_skip" for r in raw], dtype=bool)
    skipped = _marks(steps, skipped_flags & ~scaler_flags, buckets, max_exact_marks,
                     labels=[str(r[8] or "skipped") for r in raw])
    scaler_skips = _marks(steps, skipped_flags & scaler_flags, buckets, max_exact_marks)

    incident_rows: dict[int, dict[str, Any]] = {}
    if len(incident_steps):
        for i in np.flatnonzero(np.isin(steps, incident_steps)).tolist():
            r = raw[i]
            incident_rows[int(r[0])] = {
                "step": int(r[0]), "loss": _value(r[2]), "grad_norm": _value(r[3]), "param_norm": _value(r[4]),
                "scale": _value(r[6]), "skipped": bool(r[7]), "action": r[8],
            }

    heatmaps: list[Heatmap] = []
    special = np.union1d(incident_steps, steps[skipped_flags]) if len(steps) else incident_steps
    for curve in curves[:3]:  # a non-finite layer value shows in the global loss / norms of its step
        for marks in (curve.nan, curve.posinf, curve.neginf):
            if marks.exact:
                special = np.union1d(special, marks.start)
            else:  # too many to list: take every step of the steps table whose value was non-finite
                special = np.union1d(special, _nonfinite_steps(raw, curve.key))
    layer_rows = 0
    for table, columns, span, names_key, count_col in (
        ("layer_stats", ("grad_norm", "update_ratio"), layer_span, "layer_names", None),
        ("activation_stats", ("absmax",), act_span, "activation_names", "nonfinite"),
    ):
        if not span or span[0] is None:
            continue
        rows, step_stride, dense = _sampling(path, table, int(span[0]), int(span[1]), max_exact_layer_rows)
        grid = _aggregate(path, table, columns, int(span[0]), int(span[1]), max_heatmap_columns,
                          nonfinite_count=count_col, workers=workers, stride=step_stride, special_steps=special,
                          dense=dense)
        layers = _layer_labels(_names(meta.get(names_key)), grid.values[0].shape[0])
        common = dict(layers=layers, start=grid.start, end=grid.end, bucket_width=grid.width, stride=grid.stride,
                      rows_total=rows, rows_read=grid.rows_read)
        if table == "layer_stats":
            layer_rows = rows
            heatmaps.append(Heatmap("layer_grad_norm", "Per-layer gradient norm", "grad norm",
                                    values=grid.values[0], present=grid.present[0], **common))
            heatmaps.append(Heatmap("layer_update_ratio", "Per-layer update / parameter ratio", "update/param",
                                    values=grid.values[1], present=grid.present[1], **common))
        else:
            heatmaps.append(Heatmap("activation_absmax", "Per-module activation abs-max", "abs-max",
                                    values=grid.values[0], present=grid.present[0], **common))

    return ReportData(
        run_dir=path,
        meta=meta,
        steps=steps,
        first_step=int(steps[0]) if len(steps) else None,
        last_step=int(steps[-1]) if len(steps) else None,
        duration_s=(max(times) - min(times)) if len(times) > 1 else None,
        curves=curves,
        skipped=skipped,
        scaler_skips=scaler_skips,
        incidents=incidents,
        incident_rows=incident_rows,
        heatmaps=heatmaps,
        layer_rows=layer_rows,
        downsampled=buckets.reduced,
        status=status,
    )


def _value(raw: Any) -> float | None:
    """A stored figure as a float: NULL → None, the text 'nan' (and any other text) → NaN."""
    if raw is None:
        return None
    if isinstance(raw, (int, float)):
        return float(raw)
    try:
        return float(raw)
    except (TypeError, ValueError):
        return math.nan


_KIND_MISSING, _KIND_FINITE, _KIND_NAN, _KIND_POSINF, _KIND_NEGINF = 0, 1, 2, 3, 4


def _column(raw: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """(values, kinds): values as float64 (NaN where missing), kinds one of the _KIND_* codes."""
    values = np.array([_value(v) if v is not None else math.nan for v in raw], dtype=np.float64)
    missing = np.fromiter((v is None for v in raw), dtype=bool, count=len(raw))
    kinds = np.full(len(raw), _KIND_FINITE, dtype=np.int8)
    kinds[np.isnan(values)] = _KIND_NAN
    kinds[np.isposinf(values)] = _KIND_POSINF
    kinds[np.isneginf(values)] = _KIND_NEGINF
    kinds[missing] = _KIND_MISSING
    return values, kinds


def _lr_groups(raw: Sequence[Any]) -> list[list[float | None]]:
    """Per param group, the learning rate of every step (None where that group is absent)."""
    cache: dict[str, list[Any]] = {}
    parsed: list[list[Any]] = []
    for text in raw:
        if not text:
            parsed.append([])
            continue
        value = cache.get(text)
        if value is None:
            value = _parse_lr(text)
            if len(cache) < 10_000:
                cache[text] = value
        parsed.append(value)
    groups = max((len(p) for p in parsed), default=0)
    return [[(p[g] if g < len(p) else None) for p in parsed] for g in range(groups)]


def _parse_lr(text: Any) -> list[Any]:
    """A stored learning-rate list (JSON; ``json.dumps`` writes NaN / Infinity for non-finite rates)."""
    if isinstance(text, str) and text.startswith("[") and text.endswith("]") and "{" not in text:
        try:  # fast path for a flat list of numbers
            return [float(v) for v in text[1:-1].split(",")] if text[1:-1].strip() else []
        except ValueError:
            pass
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return []
    return value if isinstance(value, list) else [value]


def _names(value: Any) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else []


ROOT_LABEL = "(model)"
"""Row label of the watched model itself (its module path is the empty string)."""


def _layer_labels(names: list[str], count: int) -> list[str]:
    labels = [(names[i] or ROOT_LABEL) if i < len(names) else f"layer {i}" for i in range(count)]
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):  # plotly merges equal category names: keep them apart
        if label in seen:
            labels[i] = f"{label} #{i}"
        seen[label] = i
    return labels


def _sampling(run_dir: Path, table: str, first: int, last: int, max_rows: int) -> tuple[int, int, bool]:
    """(rows in ``table``, step stride keeping the rows read under ``max_rows``, whether every
    step from ``first`` to ``last`` has as many rows as ``first``: then no step needs looking up)."""
    with RunStore(run_dir, readonly=True) as store:
        rows, per_step = store.row_counts(table, first)
    return rows, max(1, -(-rows // max(1, max_rows))), rows == per_step * (last - first + 1)


def _nonfinite_steps(raw: Sequence[Sequence[Any]], key: str) -> np.ndarray:
    col = {"loss": 2, "grad_norm": 3, "param_norm": 4}[key]
    out = []
    for r in raw:
        v = _value(r[col])
        if v is not None and not math.isfinite(v):
            out.append(r[0])
    return np.array(out, dtype=np.int64)


# ----------------------------------------------------------------------------- curves
@dataclasses.dataclass
class _Buckets:
    """Index-based buckets over the sorted steps: bucket ``b`` holds ``steps[starts[b]:ends[b]]``."""

    of: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    reduced: bool

    @classmethod
    def for_steps(cls, steps: np.ndarray, max_buckets: int) -> "_Buckets":
        n = len(steps)
        count = min(n, max(1, max_buckets))
        of = (np.arange(n, dtype=np.int64) * count) // max(n, 1)
        starts = np.flatnonzero(np.diff(of, prepend=-1)) if n else np.zeros(0, dtype=np.int64)
        ends = np.append(starts[1:], n) if n else np.zeros(0, dtype=np.int64)
        return cls(of=of, starts=starts, ends=ends, reduced=count < n)


def _curve(key: str, label: str, steps: np.ndarray, values: np.ndarray, kinds: np.ndarray, buckets: _Buckets,
           keep: np.ndarray, log: bool, max_exact: int) -> Curve:
    finite = kinds == _KIND_FINITE
    nonpositive = finite & (values <= 0) if log else np.zeros(len(values), dtype=bool)
    finite = finite & ~nonpositive  # a log axis cannot draw them: they get marks of their own
    present = kinds != _KIND_MISSING  # a step that did not measure it (the parameter norm between full reads) is no gap
    if not buckets.reduced:
        x, y = steps[present], np.where(finite, values, np.nan)[present]
    else:
        idx = _decimate(values, finite, buckets, keep)
        idx = idx[present[idx]]
        x, y = steps[idx], np.where(finite[idx], values[idx], np.nan)
        empty = np.flatnonzero((np.add.reduceat(finite.astype(np.int64), buckets.starts) == 0)
                               & (np.add.reduceat(present.astype(np.int64), buckets.starts) > 0)) if len(steps) else []
        if len(empty):  # a bucket with values but none finite breaks the line there
            gap_idx = buckets.starts[empty]
            order = np.argsort(np.concatenate([idx, gap_idx]), kind="stable")
            x = np.concatenate([x, steps[gap_idx]])[order]
            y = np.concatenate([y, np.full(len(gap_idx), np.nan)])[order]
    return Curve(
        key=key, label=label, x=x, y=y,
        nan=_marks(steps, kinds == _KIND_NAN, buckets, max_exact),
        posinf=_marks(steps, kinds == _KIND_POSINF, buckets, max_exact),
        neginf=_marks(steps, kinds == _KIND_NEGINF, buckets, max_exact),
        nonpositive=_marks(steps, nonpositive, buckets, max_exact),
        log=log,
        measured=int((kinds != _KIND_MISSING).sum()),
    )


def _decimate(values: np.ndarray, finite: np.ndarray, buckets: _Buckets, keep: np.ndarray) -> np.ndarray:
    """Indices to draw: per bucket the minimum, the maximum and the last finite value, plus ``keep``."""
    of = buckets.of
    low = np.where(finite, values, np.inf)
    high = np.where(finite, -values, np.inf)
    imin = np.lexsort((low, of))[buckets.starts]
    imax = np.lexsort((high, of))[buckets.starts]
    positions = np.where(finite, np.arange(len(values)), -1)
    ilast = np.maximum.reduceat(positions, buckets.starts)
    chosen = np.concatenate([imin[finite[imin]], imax[finite[imax]], ilast[ilast >= 0], keep])
    return np.unique(chosen)


def _marks(steps: np.ndarray, flags: np.ndarray, buckets: _Buckets, max_exact: int,
           labels: Sequence[str] | None = None) -> Marks:
    where = np.flatnonzero(flags)
    if len(where) <= max_exact or not buckets.reduced:
        return Marks(start=steps[where], end=steps[where], count=np.ones(len(where), dtype=np.int64), exact=True,
                     labels=[labels[i] for i in where.tolist()] if labels is not None else [])
    per_bucket = np.bincount(buckets.of[where], minlength=len(buckets.starts))
    hit = np.flatnonzero(per_bucket)
    return Marks(start=steps[buckets.starts[hit]], end=steps[buckets.ends[hit] - 1], count=per_bucket[hit], exact=False)


# ----------------------------------------------------------------------------- heatmaps
@dataclasses.dataclass
class _Grid:
    start: np.ndarray
    end: np.ndarray
    width: int
    values: list[np.ndarray]
    present: list[np.ndarray]
    rows_read: int
    stride: int


def _aggregate(
    run_dir: Path,
    table: str,
    columns: Sequence[str],
    first: int,
    last: int,
    max_columns: int,
    *,
    nonfinite_count: str | None = None,
    workers: int = 1,
    stride: int = 1,
    special_steps: np.ndarray | None = None,
    dense: bool = False,
) -> _Grid:
    """Max of each column per (step bucket, layer), computed inside SQLite.

    SQLite's ``max()`` orders text above numbers, so a bucket holding the stored text 'nan'
    yields 'nan' (kept as NaN) and one holding +Inf yields +Inf: a non-finite value in a
    bucket always reaches its cell. With ``stride`` > 1 only every ``stride``-th recorded
    step of a bucket is read, plus every step in ``special_steps`` (sorted), in full;
    ``dense`` says every step of the range is recorded (no need to look the steps up).
    """
    width = max(1, -(-(last - first + 1) // max(1, max_columns)))
    ranges = [(lo, min(lo + width, last + 1)) for lo in range(first, last + 1, width)]
    specials = special_steps if special_steps is not None else np.zeros(0, dtype=np.int64)
    names = tuple(columns)

    def one(store: RunStore, lo: int, hi: int) -> tuple[int, int, list[Any]]:
        if stride <= 1:
            first_step, last_step, rows = store.layer_maxima(table, names, lo=lo, hi=hi, nonfinite_count=nonfinite_count)
            return (lo, hi, []) if first_step is None else (first_step, last_step, rows)
        recorded = list(range(lo, hi)) if dense else store.recorded_steps(table, lo, hi)
        if not recorded:
            return lo, hi, []
        extra = specials[np.searchsorted(specials, lo):np.searchsorted(specials, hi)].tolist()
        chosen = sorted(set(recorded[::stride]) | set(extra))
        _, _, rows = store.layer_maxima(table, names, lo=lo, hi=hi, steps=chosen, nonfinite_count=nonfinite_count)
        return recorded[0], recorded[-1], rows

    def work(chunk: Iterable[tuple[int, int, int]]) -> list[tuple[int, tuple[int, int, list[Any]]]]:
        with RunStore(run_dir, readonly=True) as store:  # one connection per worker thread
            return [(b, one(store, lo, hi)) for b, lo, hi in chunk]

    jobs = [(b, lo, hi) for b, (lo, hi) in enumerate(ranges)]
    workers = max(1, min(workers, len(jobs)))
    if workers == 1:
        results = work(jobs)
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="nantrace-report") as pool:
            results = [item for part in pool.map(work, [jobs[i::workers] for i in range(workers)]) for item in part]
    results.sort(key=lambda item: item[0])
    kept = [res for _, res in results if res[2]]
    n_layers = 1 + max((row[0] for _, _, rows in kept for row in rows if isinstance(row[0], int)), default=-1)
    n_cols = len(kept)
    values = [np.full((n_layers, n_cols), np.nan) for _ in columns]
    present = [np.zeros((n_layers, n_cols), dtype=bool) for _ in columns]
    start = np.array([k[0] for k in kept], dtype=np.int64)
    end = np.array([k[1] for k in kept], dtype=np.int64)
    total = 0
    for col, (_, _, rows) in enumerate(kept):
        for r in rows:
            layer = r[0]
            if not isinstance(layer, int) or layer < 0:
                continue
            total += r[1]
            for k in range(len(columns)):
                v = _value(r[2 + k])
                if v is not None:  # all NULL in the bucket: not measured, left out (not NaN)
                    values[k][layer, col] = v
                    present[k][layer, col] = True
            if nonfinite_count and r[2 + len(columns)]:
                # the module's output held non-finite values: the cell is non-finite whatever its abs-max
                values[0][layer, col] = math.nan
                present[0][layer, col] = True
    return _Grid(start=start, end=end, width=width, values=values, present=present, rows_read=total, stride=stride)


# ----------------------------------------------------------------------------- source code
@dataclasses.dataclass
class CodeSnippet:
    """Lines ``(number, text)`` of a source file around ``line``."""

    path: str
    line: int
    lines: list[tuple[int, str]]


def read_snippet(source: str | None, run_dir: Path, meta: dict[str, Any] | None = None,
                 context: int = 3) -> CodeSnippet | None:
    """The lines around ``source`` (``"path:LINE"``), or None when the file cannot be found.

    A relative path is looked up against the run's working directory (meta ``cwd``, when
    the store has it), the current directory, and the run directory and its parents.
    """
    if not source or ":" not in source:
        return None
    name, _, number = source.rpartition(":")
    try:
        line = int(number)
    except ValueError:
        return None
    path = _find_source(Path(name), run_dir, meta or {})
    if path is None or line < 1:
        return None
    first, last = max(1, line - context), line + context
    lines: list[tuple[int, str]] = []
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for n, text in enumerate(fh, start=1):
                if n > last:
                    break
                if n >= first:
                    lines.append((n, text.rstrip("\r\n")))
    except OSError:
        return None
    if not any(n == line for n, _ in lines):
        return None
    return CodeSnippet(path=shown_path(str(path), meta or {}), line=line, lines=lines)


def shown_path(path: str, meta: dict[str, Any]) -> str:
    """``path`` (or ``path:LINE``) as the report shows it: relative to the run's working
    directory (meta ``cwd``) when it lies under it, else to the current one, else as is."""
    from ..console import display_path

    cwd = meta.get("cwd")
    if isinstance(cwd, str):
        shown = display_path(path, cwd)
        if shown != path:
            return shown
    return display_path(path)


def _find_source(name: Path, run_dir: Path, meta: dict[str, Any]) -> Path | None:
    if name.is_absolute():
        return name if name.is_file() else None
    bases: list[Path] = []
    if isinstance(meta.get("cwd"), str):
        bases.append(Path(meta["cwd"]))
    bases.append(Path.cwd())
    resolved = run_dir.resolve()
    bases.extend([resolved, *list(resolved.parents)[:4]])
    for base in bases:
        candidate = base / name
        if candidate.is_file():
            return candidate
    return None
