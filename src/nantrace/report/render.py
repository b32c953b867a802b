"""Render a run directory as one self-contained HTML report.

Usage::

    from nantrace.report import render_report

    path = render_report("runs/nantrace")                  # -> runs/nantrace/report.html
    render_report("runs/nantrace", "/tmp/run-report.html")  # anywhere else

or from the shell: ``nantrace report runs/nantrace -o /tmp/run-report.html``.

The page embeds plotly.js once and needs no network access. It is written to a temporary
file next to the target and renamed over it, so a reader never sees half a report.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import plotly.io as pio
from plotly.offline import get_plotlyjs

from ..incident import Incident
from . import template as t
from .data import ReportData, load_report_data, read_snippet, resolve_run_dir, shown_path
from .figures import FigureSpec, curve_figures, heatmap_figure, margin_left, sparkline_svg, step_range

REPORT_NAME = "report.html"
MAX_CARDS = 200
"""Incident cards at most (the first ones by step); the incident table lists more."""
MAX_TABLE_ROWS = 2000
"""Rows of the incident table at most; the count of the rest is stated on the page."""


def render_report(run_dir: str | os.PathLike[str], output: str | os.PathLike[str] | None = None, *,
                  max_exact_layer_rows: int | None = None) -> Path:
    """Write the HTML report of ``run_dir`` to ``output`` (default ``RUN_DIR/report.html``); return its path.

    ``max_exact_layer_rows``: per-layer tables with more rows are read at every k-th step
    (default :data:`nantrace.report.data.MAX_EXACT_LAYER_ROWS`). Raises ``ValueError`` if
    ``run_dir`` does not exist or holds no readable ``nantrace.db``.
    """
    run_path = resolve_run_dir(run_dir)
    options = {} if max_exact_layer_rows is None else {"max_exact_layer_rows": max_exact_layer_rows}
    data = load_report_data(run_path, **options)
    target = Path(output) if output is not None else data.run_dir / REPORT_NAME
    if target.is_dir():
        target = target / REPORT_NAME
    page = build_html(data)
    _write_atomic(target, page)
    return target


def build_html(data: ReportData) -> str:
    """The report page of already loaded ``data``."""
    from .. import __version__
    from ..console import display_path

    data = dataclasses.replace(data, incidents=[_displayed(i, data.meta) for i in data.incidents])
    specs: list[FigureSpec] = curve_figures(data) if data.n_steps else []
    heat_specs = [heatmap_figure(h, data.incidents, step_range(data), margin_left(data))
                  for h in data.heatmaps if h.values.size and h.present.any()]
    cards, carded = _cards(data)
    curves_html = "".join(_plot_div(s) for s in specs) if specs else (
        '<p class="note">No steps were recorded in this run.</p>')
    heat_html = "".join(_plot_div(s) for s in heat_specs)
    if not data.heatmaps:
        heat_html = ('<p class="note">No per-layer statistics in this run store (tables <code>layer_stats</code> and '
                     "<code>activation_stats</code> are empty), so there is no layers × steps heatmap.</p>")
    else:
        heat_html = ('<p class="legend">Colour: log10 of the largest value in each cell · '
                     '<span style="color:#9e9e9e;font-weight:700">grey</span> exactly 0 (a dead layer) · '
                     '<span style="color:#ff7f0e;font-weight:700">orange</span> ±Inf · '
                     '<span class="nonfinite">red</span> NaN · blank: not measured · ▼ above the grid: incidents, ✕: columns holding a non-finite value.</p>'
                     + heat_html)
    figures_json = "[" + ",".join(
        '{"div":%s,"linked":%s,"figure":%s}' % (json.dumps(s.div_id), "true" if s.linked else "false",
                                                 pio.to_json(s.figure, validate=False))
        for s in [*specs, *heat_specs]
    ) + "]"
    model = data.meta.get("model_class") or "run"
    return t.page_html(
        version=__version__,
        title=f"nantrace report: {model} ({data.run_dir.name})",
        heading=t.esc(f"{model} · {data.n_steps:,} steps · {len(data.incidents)} incident(s)"),
        run_dir=display_path(str(data.run_dir)),
        rendered=_dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z"),
        n_incidents=len(data.incidents),
        facts=t.facts_html(_facts(data)),
        notes=t.notes_html(_notes(data, len(carded))),
        incident_table=t.incident_table_html(data.incidents, carded, MAX_TABLE_ROWS),
        curves=curves_html,
        heatmaps=heat_html,
        cards=cards or '<p class="ok">No incidents.</p>',
        figures_json=t.json_for_script(figures_json),
        plotlyjs=get_plotlyjs(),
    )


# ----------------------------------------------------------------------------- pieces
def _plot_div(spec: FigureSpec) -> str:
    return (f'<div class="plot"><h3 class="plot-title">{t.esc(spec.title)}</h3>'
            f'<div class="plotly-target" id="{t.esc(spec.div_id)}"></div></div>')


def _facts(data: ReportData) -> list[tuple[str, str]]:
    meta = data.meta
    loss = next(c for c in data.curves if c.key == "loss")
    params = meta.get("num_parameters")
    kinds = Counter(i.kind for i in data.incidents)
    status = data.status
    facts: list[tuple[str, str]] = [
        ("status", f'<span class="{"nonfinite" if status and status.state in ("interrupted", "failed") else ""}">'
                   f'{t.esc(status.state if status else "unknown")}</span>'),
        ("model", t.esc(meta.get("model_class"))),
        ("parameters", (f"{params:,} ({_short(params)})" if params >= 1000 else str(params))
         if isinstance(params, int) else t.esc(params)),
        ("optimizer", t.esc(meta.get("optimizer_class"))),
        ("policy (on_anomaly)", t.esc(meta.get("policy"))),
        ("GradScaler", "yes" if meta.get("scaler") else "no"),
        ("steps", f"{data.n_steps:,}" + (f" ({data.first_step}–{data.last_step})" if data.n_steps else "")),
        ("incidents", f'<span class="{"nonfinite" if data.incidents else ""}">{len(data.incidents)}</span>'
                      + (" · " + ", ".join(f"{t.esc(k)} {n}" for k, n in kinds.most_common()) if kinds else "")),
        ("skipped updates", f"{data.skipped.total:,}" + (f" (+{data.scaler_skips.total:,} GradScaler skips)"
                                                         if data.scaler_skips.total else "")),
        ("non-finite losses", f'<span class="{"nonfinite" if loss.nonfinite else ""}">{loss.nonfinite:,}</span>'),
        ("versions", f"nantrace {t.esc(meta.get('nantrace_version'))} · torch {t.esc(meta.get('torch_version'))}"),
    ]
    created = meta.get("created")
    if isinstance(created, (int, float)):
        facts.append(("started", t.esc(_dt.datetime.fromtimestamp(created).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z"))))
    if data.duration_s is not None:
        facts.append(("duration", t.esc(_duration(data.duration_s))))
    if meta.get("rank") not in (None, 0):
        facts.append(("rank", t.esc(meta.get("rank"))))
    layers = {h.key: h for h in data.heatmaps}
    if "layer_grad_norm" in layers:
        facts.append(("per-layer stats", f"{len(layers['layer_grad_norm'].layers):,} layers · {data.layer_rows:,} rows"))
    return facts


def _notes(data: ReportData, n_cards: int) -> list[str]:
    notes = []
    status = data.status
    if status is not None and status.state in ("interrupted", "failed", "running", "unknown") and status.reason:
        verdict = {"interrupted": "This run was interrupted", "failed": "This run failed",
                   "running": "This run is still running", "unknown": "How this run ended is unknown"}[status.state]
        notes.append(f"{verdict}: {status.reason}. The report shows every step recorded"
                     + (f", up to step {status.last_step}." if status.last_step is not None else "."))
    if data.downsampled:
        notes.append(
            f"This run has {data.n_steps:,} steps: the curves show the minimum, maximum and last value of each "
            "of ≈2,000 step buckets. Every incident step and every non-finite value is still marked "
            "(one by one when there are few, counted per bucket when there are many)."
        )
    wide = [h for h in data.heatmaps if h.bucket_width > 1]
    if wide:
        notes.append(f"Heatmaps show the largest value per layer in buckets of {wide[0].bucket_width:,} steps; "
                     "a bucket holding any NaN or Inf is coloured as such.")
    for h in data.heatmaps:
        if h.stride > 1 and h.key != "layer_update_ratio":
            notes.append(
                f"{h.title}: the store holds {h.rows_total:,} rows; to keep the report fast, every {t.ordinal(h.stride)} "
                f"recorded step was read ({h.rows_read:,} rows), plus, in full, every step with an incident, a "
                "skipped update or a non-finite loss, gradient norm or parameter norm. Non-finite values behind "
                "those show exactly; a finite one-step spike between read steps may not."
            )
    if len(data.incidents) > n_cards:
        notes.append(f"{len(data.incidents):,} incidents: cards are shown for the first {n_cards}; "
                     "the table lists the others.")
    return [t.esc(n) for n in notes]


def _cards(data: ReportData) -> tuple[str, set[str]]:
    cards = []
    carded: set[str] = set()
    for inc in data.incidents[:MAX_CARDS]:
        history = _history(inc, data.incident_rows.get(inc.step))
        steps = [int(r["step"]) for r in history if isinstance(r.get("step"), int)]
        sparks = []
        if steps:
            rows = [r for r in history if isinstance(r.get("step"), int)]
            for key, label, log in (("loss", "loss", False), ("grad_norm", "grad norm", True)):
                values = [_float(r.get(key)) for r in rows]
                svg = sparkline_svg(steps, values, label=label, highlight=inc.step, log=log)
                sparks.append(f"<figure>{svg}<figcaption>{t.esc(label)}, steps {steps[0]}–{steps[-1]}"
                              f"{' (log)' if log else ''}</figcaption></figure>")
        snippet = read_snippet(inc.source, data.run_dir, data.meta)
        cards.append(t.incident_card_html(inc, snippet, history, sparks))
        carded.add(inc.id)
    return "".join(cards), carded


def _displayed(inc: Incident, meta: dict[str, Any]) -> Incident:
    """A copy of ``inc`` whose paths (source, bundle, the chain's sources) read relative to
    the run's working directory, as the terminal shows them."""
    chain = [dict(c, source=shown_path(c["source"], meta)) if isinstance(c.get("source"), str) else c
             for c in inc.chain]
    return dataclasses.replace(
        inc, source=shown_path(inc.source, meta) if inc.source else inc.source,
        bundle=shown_path(inc.bundle, meta) if inc.bundle else inc.bundle, chain=chain)


def _history(inc: Incident, at_step: dict[str, Any] | None) -> list[dict[str, Any]]:
    rows = [dict(r) for r in inc.history if isinstance(r, dict)]
    if at_step is not None and not any(r.get("step") == inc.step for r in rows):
        rows.append(dict(at_step))
    return rows


def _float(value: Any) -> float | None:
    """History figures come back from JSON: floats, None, or the strings 'nan' / 'inf' / '-inf'."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _short(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"


def _write_atomic(target: Path, text: str) -> None:
    """Write ``text`` to ``target`` through a temporary file in the same directory and a rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a report is meant to be shared
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
