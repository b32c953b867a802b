"""Plotly figures (and small inline SVG sparklines) built from :mod:`nantrace.report.data`.

Conventions shared by every figure:

- non-finite values are drawn as marks on a hidden overlay axis whose range is [0, 1], so
  they sit at the top edge of the plot whatever the data axis does (log or linear): NaN as
  a red ✕, +Inf as a red ▲, -Inf as a red ▼; values a log axis cannot draw (zero or
  negative) as grey ○ at the bottom edge;
- incidents are dark-red ▼ just above the plot, with a dotted vertical line, and carry the
  incident id (a click scrolls to its card); skipped updates are grey ■ at the bottom;
- heatmaps are coloured by log10 of the value, with three extra colour bands outside the
  Viridis range: grey for exact zeros (a dead layer), orange for ±Inf, red for NaN;
  cells with no measurement stay blank.
"""

from __future__ import annotations

import dataclasses
import html
import math
from typing import Any, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.colors import sequential

from ..incident import Incident
from .data import Curve, Heatmap, Marks, ReportData
from .template import ordinal

NAN_COLOUR = "#d62728"
INF_COLOUR = "#ff7f0e"
ZERO_COLOUR = "#9e9e9e"
INCIDENT_COLOUR = "#8b0000"
SKIP_COLOUR = "#616161"
MAX_INCIDENT_LINES = 200
"""Dotted vertical lines are drawn for at most this many incidents (the marks for all)."""
_LINE_COLOURS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")


@dataclasses.dataclass
class FigureSpec:
    """A figure with the id of the div it goes into and whether its x axis is linked to the others."""

    div_id: str
    figure: go.Figure
    title: str = ""
    linked: bool = True


# ----------------------------------------------------------------------------- curves
MARGIN_RIGHT = 110
"""Right margin of every chart (room for a heatmap's colour bar), so all plot areas align."""


def margin_left(data: ReportData) -> int:
    """Left margin shared by every chart: room for the longest heatmap row label (10 px font),
    so the step axes of the curves and of the heatmaps line up one above the other."""
    longest = max((len(label) for h in data.heatmaps for label in h.layers), default=0)
    return int(min(280, max(70, 6 * longest + 16)))


def curve_figures(data: ReportData) -> list[FigureSpec]:
    """Loss, gradient/parameter norms, learning rate(s) and loss scale over steps."""
    by_key = {c.key: c for c in data.curves}
    groups: list[tuple[str, str, list[Curve], str]] = [
        ("curve-loss", "Loss", [by_key["loss"]], "loss"),
        ("curve-norms", "Global gradient norm and parameter norm", [by_key["grad_norm"], by_key["param_norm"]], "norm"),
    ]
    lrs = [c for c in data.curves if c.key.startswith("lr")]
    if lrs:
        groups.append(("curve-lr", "Learning rate" + (" per param group" if len(lrs) > 1 else ""), lrs, "lr"))
    if "scale" in by_key:
        groups.append(("curve-scale", "GradScaler loss scale", [by_key["scale"]], "scale"))
    return [FigureSpec(div_id, _curve_figure(curves, axis, data), title) for div_id, title, curves, axis in groups]


def step_range(data: ReportData) -> list[float] | None:
    """The x range every chart shares: the run's first to last step (half a step of margin),
    so that a step sits at the same place in each of them."""
    if data.first_step is None or data.last_step is None:
        return None
    return [data.first_step - 0.5, data.last_step + 0.5]


LOG_AXIS: dict[str, Any] = dict(type="log", dtick=1, exponentformat="power", showexponent="all", minor=dict(showgrid=True))
"""A log y axis labelled at powers of ten only (10⁻², 10⁻¹, 1, 10...), with unlabelled minor
grid lines between them: plotly's default also labels 2 and 5 of every decade, which over a
few decades reads as a column of crowded digits."""
LINEAR_AXIS: dict[str, Any] = dict(type="linear", dtick=None, exponentformat="e", showexponent="all")


def _curve_figure(curves: list[Curve], axis_title: str, data: ReportData) -> go.Figure:
    fig = go.Figure()
    log = any(c.log for c in curves)
    for i, curve in enumerate(curves):
        colour = _LINE_COLOURS[i % len(_LINE_COLOURS)]
        fig.add_trace(go.Scatter(
            x=curve.x, y=curve.y, mode="lines" if len(curve.x) > 1 else "lines+markers", name=curve.label,
            line=dict(color=colour, width=1.4), connectgaps=False,
            hovertemplate=f"step %{{x}}<br>{html.escape(curve.label)} %{{y:.5g}}<extra></extra>",
        ))
    for curve in curves:
        suffix = f" ({curve.label})" if len(curves) > 1 else ""
        _add_marks(fig, curve.nan, 0.955, "x", NAN_COLOUR, f"NaN{suffix}", f"{curve.label} = NaN")
        _add_marks(fig, curve.posinf, 0.955, "triangle-up", NAN_COLOUR, f"+Inf{suffix}", f"{curve.label} = +Inf")
        _add_marks(fig, curve.neginf, 0.955, "triangle-down", NAN_COLOUR, f"-Inf{suffix}", f"{curve.label} = -Inf")
        _add_marks(fig, curve.nonpositive, 0.05, "circle-open", ZERO_COLOUR, f"≤ 0, off the log axis{suffix}",
                   f"{curve.label} ≤ 0 (not drawable on a log axis)")
    _add_marks(fig, data.skipped, 0.015, "square", SKIP_COLOUR, "update skipped", "update skipped")
    _add_marks(fig, data.scaler_skips, 0.015, "square-open", SKIP_COLOUR, "GradScaler skip", "GradScaler skipped the step (calibration)")
    _add_incidents(fig, data.incidents, y=1.0)
    yaxis: dict[str, Any] = dict(title=dict(text=axis_title), **(LOG_AXIS if log else LINEAR_AXIS))
    if not log:
        yaxis.update(_flat_range(curves))
    xaxis: dict[str, Any] = dict(title=dict(text="step"), showspikes=True, spikemode="across", spikethickness=1)
    if step_range(data) is not None:
        xaxis["range"] = step_range(data)
    fig.update_layout(
        height=290, margin=dict(l=margin_left(data), r=MARGIN_RIGHT, t=36, b=40), template="plotly_white",
        hovermode="closest",
        legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1, font=dict(size=11)),
        xaxis=xaxis,
        yaxis=yaxis,
        yaxis2=dict(overlaying="y", range=[0, 1], visible=False, fixedrange=True),
        updatemenus=[dict(
            type="buttons", direction="left", x=0.0, xanchor="left", y=1.0, yanchor="bottom", pad=dict(t=0, b=4),
            showactive=True, active=1 if log else 0, font=dict(size=10),
            buttons=[dict(label="linear", method="relayout", args=[{f"yaxis.{k}": v for k, v in LINEAR_AXIS.items()}]),
                     dict(label="log", method="relayout",
                          args=[{f"yaxis.{k}": v for k, v in LOG_AXIS.items() if k != "minor"}])],
        )],
    )
    _add_incident_lines(fig, data.incidents)
    return fig


def _flat_range(curves: Sequence[Curve]) -> dict[str, Any]:
    """An explicit y range when every finite value is the same (plotly would centre it in [v-1, v+1])."""
    finite = [c.y[np.isfinite(c.y)] for c in curves]
    values = np.concatenate(finite) if finite else np.zeros(0)
    if not len(values) or values.min() != values.max():
        return {}
    v = float(values[0])
    half = abs(v) * 0.5 if v != 0 else 1.0
    return {"range": [v - half, v + half]}


def _add_marks(fig: go.Figure, marks: Marks, y: float, symbol: str, colour: str, name: str, what: str) -> None:
    if not len(marks):
        return
    if marks.exact:
        labels = marks.labels or [what] * len(marks)
        text = [f"step {s}: {html.escape(label)}" for s, label in zip(marks.start.tolist(), labels)]
    else:
        text = [f"steps {a}–{b}: {n} × {html.escape(what)}"
                for a, b, n in zip(marks.start.tolist(), marks.end.tolist(), marks.count.tolist())]
    fig.add_trace(go.Scatter(
        x=marks.start, y=np.full(len(marks), y), yaxis="y2", mode="markers", name=f"{name} ({marks.total})",
        marker=dict(symbol=symbol, color=colour, size=9 if symbol != "square" else 6, line=dict(width=1.5, color=colour)),
        text=text, hovertemplate="%{text}<extra></extra>", cliponaxis=False,
    ))


def _incident_text(incident: Incident) -> str:
    where = " · ".join(p for p in (
        incident.op or "",
        f"module {incident.module!r}" if incident.module is not None else ("outside the model" if incident.op else ""),
    ) if p)
    return "<br>".join(html.escape(part) for part in (
        f"incident at step {incident.step}: {incident.kind}", f"cause {incident.cause} · action {incident.action}", where,
    ) if part)


def _add_incidents(fig: go.Figure, incidents: Sequence[Incident], y: float) -> None:
    if not incidents:
        return
    fig.add_trace(go.Scatter(
        x=[i.step for i in incidents], y=[y] * len(incidents), yaxis="y2", mode="markers", name=f"incident ({len(incidents)})",
        marker=dict(symbol="triangle-down", color=INCIDENT_COLOUR, size=13, line=dict(width=1, color="white")),
        text=[_incident_text(i) for i in incidents], customdata=[i.id for i in incidents],
        hovertemplate="%{text}<br><i>click: show the card</i><extra></extra>", cliponaxis=False,
    ))


def _add_incident_lines(fig: go.Figure, incidents: Sequence[Incident], colour: str = INCIDENT_COLOUR) -> None:
    for step in sorted({i.step for i in incidents})[:MAX_INCIDENT_LINES]:
        fig.add_shape(type="line", x0=step, x1=step, xref="x", y0=0, y1=1, yref="paper",
                      line=dict(color=colour, width=1, dash="dot"), layer="above")


# ----------------------------------------------------------------------------- heatmaps
@dataclasses.dataclass
class HeatmapEncoding:
    """Cell colours as one float32 grid: log10 of the value, plus bands for 0, ±Inf and NaN."""

    z: np.ndarray
    zmin: float
    zmax: float
    colorscale: list[list[Any]]
    tickvals: list[float]
    ticktext: list[str]
    counts: dict[str, int]


def encode_heatmap(values: np.ndarray, present: np.ndarray) -> HeatmapEncoding:
    """Map a heatmap's values to colour codes (pure numpy; the renderer draws them)."""
    finite = present & np.isfinite(values)
    positive = finite & (values > 0)
    zero = finite & (values <= 0)
    nan = present & np.isnan(values)
    inf = present & np.isinf(values)
    logs = np.log10(np.where(positive, values, 1.0))
    lo, hi = (float(logs[positive].min()), float(logs[positive].max())) if positive.any() else (0.0, 1.0)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    d = (hi - lo) * 0.06
    z_zero, z_inf, z_nan = lo - 1.5 * d, hi + 1.5 * d, hi + 3.5 * d
    zmin, zmax = lo - 2 * d, hi + 4 * d
    z = np.full(values.shape, np.nan, dtype=np.float32)
    z[positive] = logs[positive]
    z[zero] = z_zero
    z[inf] = z_inf
    z[nan] = z_nan

    def at(v: float) -> float:
        return min(1.0, max(0.0, (v - zmin) / (zmax - zmin)))

    # white separators between the bands; Viridis reaches a little beyond [lo, hi] so that the
    # extreme cells never land on a band edge
    edge = 0.3 * d
    scale: list[list[Any]] = [[0.0, ZERO_COLOUR], [at(lo - d), ZERO_COLOUR], [at(lo - d), "#ffffff"],
                              [at(lo - edge), "#ffffff"]]
    viridis = sequential.Viridis
    for k, colour in enumerate(viridis):
        scale.append([at(lo - edge + (hi - lo + 2 * edge) * k / (len(viridis) - 1)), colour])
    scale += [[at(hi + edge), "#ffffff"], [at(hi + d), "#ffffff"], [at(hi + d), INF_COLOUR], [at(hi + 2 * d), INF_COLOUR],
              [at(hi + 2 * d), "#ffffff"], [at(hi + 3 * d), "#ffffff"], [at(hi + 3 * d), NAN_COLOUR], [1.0, NAN_COLOUR]]
    position = 0.0
    for entry in scale:  # plotly.js rejects (and silently replaces) a scale whose positions ever decrease
        position = max(position, round(float(entry[0]), 9))
        entry[0] = position
    scale[0][0], scale[-1][0] = 0.0, 1.0
    first, last = math.ceil(lo), math.floor(hi)
    step = max(1, math.ceil((last - first + 1) / 7))
    tickvals = [float(v) for v in range(first, last + 1, step)]
    if not tickvals:
        tickvals = [lo, hi]
    ticktext = [_decade(v) for v in tickvals]
    return HeatmapEncoding(
        z=z, zmin=zmin, zmax=zmax, colorscale=scale,
        tickvals=[z_zero, *tickvals, z_inf, z_nan], ticktext=["0", *ticktext, "Inf", "NaN"],
        counts={"zero": int(zero.sum()), "inf": int(inf.sum()), "nan": int(nan.sum()), "cells": int(present.sum())},
    )


def _decade(v: float) -> str:
    if float(v).is_integer():
        return f"1e{int(v)}"
    return f"{10 ** v:.2g}"


def heatmap_figure(heatmap: Heatmap, incidents: Sequence[Incident], span: Sequence[float] | None = None,
                   left: int = 150) -> FigureSpec:
    """A layers × steps heatmap of ``heatmap`` (max per bucket, log colour scale).

    Only the columns holding a measurement are drawn, each centred on its step and as wide
    as the gaps to its neighbours (a figure sampled every 25 steps fills the width instead
    of 5 thin columns among 120), and rows never measured (a container that never runs) are
    left out. ``span`` and ``left`` (the left margin, px) are shared with the other charts.
    """
    rows = np.flatnonzero(heatmap.present.any(axis=1))
    cols = np.flatnonzero(heatmap.present.any(axis=0))
    values, present = heatmap.values[np.ix_(rows, cols)], heatmap.present[np.ix_(rows, cols)]
    layers = [heatmap.layers[i] for i in rows.tolist()]
    starts, ends = heatmap.start[cols], heatmap.end[cols]
    enc = encode_heatmap(values, present)
    shown = np.where(present, values, np.nan)
    magnitude = np.abs(shown[np.isfinite(shown) & (shown != 0)])
    if not len(magnitude) or (magnitude.max() < 1e38 and magnitude.min() > 1e-37):
        shown = shown.astype(np.float32)  # half the bytes; float64 only where float32 would distort a value
    n_layers = len(layers)
    title = f"{heatmap.title} ({_columns_phrase(heatmap, starts, ends)}; log colour scale)"
    hidden = len(heatmap.layers) - n_layers
    if hidden:
        title += f" · {hidden} never-measured row{'s' if hidden > 1 else ''} not shown"
    fig = go.Figure(go.Heatmap(
        z=enc.z, x=starts, y=layers, customdata=shown,
        zmin=enc.zmin, zmax=enc.zmax, colorscale=enc.colorscale, hoverongaps=False,
        colorbar=dict(title=dict(text=html.escape(heatmap.label), side="right"), tickvals=enc.tickvals,
                      ticktext=enc.ticktext, thickness=14, len=1.0, lenmode="fraction"),
        hovertemplate=(f"%{{y}}<br>{'steps from' if heatmap.bucket_width > 1 else 'step'} %{{x}}<br>"
                       f"{html.escape(heatmap.label)} %{{customdata:.4g}}<extra></extra>"),
    ))
    height = int(min(1400, max(260, 7 * n_layers + 130) if n_layers > 30 else max(260, 18 * n_layers + 130)))
    strip = 24 / (height - 34 - 40)  # a thin band above the grid for the marks, as a fraction of the plot
    xaxis: dict[str, Any] = dict(title=dict(text="step"), showgrid=False)
    if span is not None:
        xaxis["range"] = list(span)
    fig.update_layout(
        height=height,
        margin=dict(l=left, r=MARGIN_RIGHT, t=34, b=40), template="plotly_white", hovermode="closest",
        legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="left", x=0, font=dict(size=11)),
        xaxis=xaxis,
        yaxis=dict(autorange="reversed", automargin=False, showgrid=False, tickfont=dict(size=10), domain=[0, 1 - strip]),
        yaxis2=dict(domain=[1 - strip, 1], range=[0, 1], visible=False, fixedrange=True, anchor="x"),
    )
    # columns holding a non-finite cell are marked above the grid: a one-pixel-wide red
    # column of a long run would be easy to miss otherwise
    bad = present & ~np.isfinite(values)
    columns = np.flatnonzero(bad.any(axis=0))
    if len(columns):
        counts = bad[:, columns].sum(axis=0)
        names = [", ".join(layers[i] for i in np.flatnonzero(bad[:, c])[:3]) + (" …" if n > 3 else "")
                 for c, n in zip(columns.tolist(), counts.tolist())]
        text = [f"steps {a}–{b}: non-finite {html.escape(heatmap.label)} in {n} of {n_layers} rows ({html.escape(w)})"
                for a, b, n, w in zip(starts[columns].tolist(), ends[columns].tolist(), counts.tolist(), names)]
        fig.add_trace(go.Scatter(
            x=starts[columns], y=np.full(len(columns), 0.3), yaxis="y2", mode="markers",
            name=f"non-finite ({len(columns)} columns)", text=text, hovertemplate="%{text}<extra></extra>",
            marker=dict(symbol="x", color=NAN_COLOUR, size=8), cliponaxis=False, showlegend=True,
        ))
    if incidents:
        fig.add_trace(go.Scatter(
            x=[i.step for i in incidents], y=[0.75] * len(incidents), yaxis="y2", mode="markers",
            name=f"incident ({len(incidents)})", text=[_incident_text(i) for i in incidents],
            customdata=[i.id for i in incidents], hovertemplate="%{text}<br><i>click: show the card</i><extra></extra>",
            marker=dict(symbol="triangle-down", color=INCIDENT_COLOUR, size=11), cliponaxis=False, showlegend=True,
        ))
    return FigureSpec(f"heatmap-{heatmap.key}", fig, title)


def _columns_phrase(heatmap: Heatmap, starts: np.ndarray, ends: np.ndarray) -> str:
    """How the columns were formed: ``one column per step``, ``measured every 25 steps``..."""
    gaps = np.unique(np.diff(starts)) if len(starts) > 1 else np.zeros(0, dtype=np.int64)
    if heatmap.bucket_width > 1:
        phrase = f"max over buckets of {heatmap.bucket_width} steps"
    elif len(gaps) == 1 and gaps[0] > 1:
        phrase = f"measured every {int(gaps[0])} steps"
    elif len(gaps) > 1 or (len(starts) and len(starts) < int(ends[-1] - starts[0] + 1)):
        phrase = "measured at sampled steps"
    else:
        phrase = "one column per step"
    if heatmap.stride > 1:
        phrase += f", every {ordinal(heatmap.stride)} step read + all special steps"
    return phrase


# ----------------------------------------------------------------------------- sparklines
def sparkline_svg(steps: Sequence[int], values: Sequence[float | None], *, label: str, highlight: int | None = None,
                  width: int = 260, height: int = 48, log: bool = False) -> str:
    """A small inline SVG line of ``values`` over ``steps``; non-finite values as red dots at the top.

    ``highlight`` is a step drawn with a dark-red vertical line (the incident's step).
    """
    pad = 4
    pts = [(s, v) for s, v in zip(steps, values) if v is not None]
    if not pts:
        return f'<svg class="spark" width="{width}" height="{height}" role="img" aria-label="{html.escape(label)}: no data"></svg>'
    xs = [s for s, _ in pts]
    x0, x1 = min(xs), max(xs)
    finite = [v for _, v in pts if math.isfinite(v) and (v > 0 or not log)]
    tf = (lambda v: math.log10(v)) if log else (lambda v: v)
    lo, hi = (min(map(tf, finite)), max(map(tf, finite))) if finite else (0.0, 1.0)
    if hi - lo < 1e-12:
        lo, hi = lo - 1, hi + 1

    def px(s: float) -> float:
        return pad + (width - 2 * pad) * ((s - x0) / (x1 - x0) if x1 > x0 else 0.5)

    def py(v: float) -> float:
        return pad + 6 + (height - 2 * pad - 6) * (1 - (tf(v) - lo) / (hi - lo))

    parts = [f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="{html.escape(label)}">']
    if highlight is not None and x0 <= highlight <= x1:
        parts.append(f'<line x1="{px(highlight):.1f}" x2="{px(highlight):.1f}" y1="0" y2="{height}" '
                     f'stroke="{INCIDENT_COLOUR}" stroke-dasharray="2,2"/>')
    segment: list[str] = []
    segments: list[list[str]] = []
    for s, v in pts:
        if math.isfinite(v) and (v > 0 or not log):
            segment.append(f"{px(s):.1f},{py(v):.1f}")
        elif segment:
            segments.append(segment)
            segment = []
    if segment:
        segments.append(segment)
    for seg in segments:
        if len(seg) == 1:
            x, y = seg[0].split(",")
            parts.append(f'<circle cx="{x}" cy="{y}" r="1.8" fill="#1f77b4"/>')
        else:
            parts.append(f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.3" points="{" ".join(seg)}"/>')
    for s, v in pts:
        if not math.isfinite(v):
            word = "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf")
            parts.append(f'<circle cx="{px(s):.1f}" cy="{pad:.1f}" r="3" fill="{NAN_COLOUR}">'
                         f'<title>step {s}: {html.escape(label)} = {word}</title></circle>')
        elif log and v <= 0:
            parts.append(f'<circle cx="{px(s):.1f}" cy="{height - pad:.1f}" r="3" fill="none" stroke="{ZERO_COLOUR}">'
                         f'<title>step {s}: {html.escape(label)} = {v:g}</title></circle>')
    parts.append("</svg>")
    return "".join(parts)
