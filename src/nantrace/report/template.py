"""HTML of the report: the page skeleton, its CSS and script, and the HTML fragments.

Every piece of run data goes through :func:`esc` (HTML-escaped); figure JSON goes into a
``<script type="application/json">`` block with ``<`` written as ``\\u003c`` so no value
can close the script element. Nothing here fetches anything from the network.
"""

from __future__ import annotations

import html
import json
import math
import string
from typing import Any, Iterable, Sequence

from ..incident import Incident
from .data import CodeSnippet

CARD_KINDS_SEVERE = ("nonfinite_loss", "nonfinite_grad", "nonfinite_param", "nonfinite_input", "nonfinite_activation")


def esc(value: Any) -> str:
    """``value`` as HTML-escaped text (None → an em dash)."""
    if value is None:
        return "—"
    return html.escape(str(value), quote=True)


def num(value: Any, digits: int = 4) -> str:
    """A figure for a table cell; non-finite values (also the stored strings 'nan'/'inf') stand out in red."""
    if value is None or value == "":
        return '<span class="na">—</span>'
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("nan", "inf", "+inf", "-inf", "infinity", "-infinity"):
            return f'<span class="nonfinite">{esc(_word(float(low.replace("infinity", "inf"))))}</span>'
        return esc(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return f'<span class="nonfinite">{_word(value)}</span>'
        return f"{value:.{digits}g}"
    return esc(value)


def _word(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return "+Inf" if value > 0 else "-Inf"


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ``11th``, ``22nd`` ..."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def json_for_script(value: Any) -> str:
    """JSON that is safe inside a ``<script>`` element."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


# ----------------------------------------------------------------------------- fragments
def facts_html(facts: Sequence[tuple[str, str]]) -> str:
    """The run facts as a definition list (values already HTML)."""
    items = "".join(f"<div><dt>{esc(k)}</dt><dd>{v}</dd></div>" for k, v in facts)
    return f'<dl class="facts">{items}</dl>'


def notes_html(notes: Iterable[str]) -> str:
    return "".join(f'<p class="note">{n}</p>' for n in notes)


def incident_table_html(incidents: Sequence[Incident], carded: set[str], limit: int) -> str:
    """One row per incident (at most ``limit``; the rest counted, not hidden silently)."""
    if not incidents:
        return '<p class="ok">No incidents: every step was finite and no anomaly was reported.</p>'
    rows = []
    for inc in incidents[:limit]:
        step = f'<a href="#incident-{esc(inc.id)}">{inc.step}</a>' if inc.id in carded else str(inc.step)
        rows.append(
            f'<tr class="{_severity(inc)}"><td class="r">{step}</td><td>{esc(inc.kind)}</td><td>{esc(inc.cause)}</td>'
            f"<td>{esc(inc.phase)}</td><td><code>{esc(inc.op)}</code></td><td><code>{_module(inc.module)}</code></td>"
            f"<td>{esc(inc.action)}</td><td>{_transient(inc.transient)}</td></tr>"
        )
    more = ""
    if len(incidents) > limit:
        more = f'<p class="note">{len(incidents) - limit:,} more incidents are not listed here (the run store holds all of them).</p>'
    return (
        '<table class="grid incidents"><thead><tr><th>step</th><th>kind</th><th>cause</th><th>phase</th><th>op</th>'
        "<th>module</th><th>action</th><th>transient</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>" + more
    )


def _severity(incident: Incident) -> str:
    return "severe" if incident.kind in CARD_KINDS_SEVERE else "warn"


def _module(module: str | None) -> str:
    if module is None:
        return "(outside the model)"
    if module == "":
        return "'' (the model itself)"
    return esc(module)


def _transient(value: bool | None) -> str:
    if value is None:
        return "not checked"
    return "yes: a re-run was finite" if value else "no: reproduced on re-run"


def code_html(snippet: CodeSnippet | None, source: str | None) -> str:
    """The source lines around the incident's line, that line highlighted."""
    if not source:
        return ""
    if snippet is None:
        return f'<p class="note">Source file of <code>{esc(source)}</code> not found where the report was rendered.</p>'
    lines = []
    for number, text in snippet.lines:
        cls = ' class="hl"' if number == snippet.line else ""
        lines.append(f'<span{cls}><span class="ln">{number}</span>{esc(text.rstrip()) or " "}</span>')
    return (f'<figure class="code"><figcaption>{esc(snippet.path)}:{snippet.line}</figcaption>'
            f'<pre><code>{"".join(lines)}</code></pre></figure>')


def input_stats_html(stats: Sequence[dict[str, Any]]) -> str:
    if not stats:
        return ""
    cols = ("arg", "dtype", "shape", "min", "max", "min_abs", "zeros", "negatives", "nan", "inf")
    heads = ("arg", "dtype", "shape", "min", "max", "min |x|", "zeros", "negatives", "NaN", "Inf")
    body = []
    for s in stats:
        cells = []
        for c in cols:
            v = s.get(c)
            if c in ("arg", "dtype"):
                cells.append(f"<td>{esc(v)}</td>")
            elif c == "shape":
                cells.append(f"<td>{esc(list(v) if isinstance(v, (list, tuple)) else v)}</td>")
            elif c in ("nan", "inf") and isinstance(v, int) and v > 0:
                cells.append(f'<td class="r"><span class="nonfinite">{v:,}</span></td>')
            else:
                cells.append(f'<td class="r">{num(v)}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in heads)
    return (f'<h4>Inputs of the origin op</h4><table class="grid"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table>')


def chain_html(chain: Sequence[dict[str, Any]]) -> str:
    """The chain from the origin to where the bad value was observed."""
    if not chain:
        return ""
    items = []
    for link in chain:
        if link.get("phase") is None and link.get("module") is None and str(link.get("op", "")).startswith("..."):
            items.append(f'<li class="elided">{esc(link.get("op"))}</li>')
            continue
        tags = []
        if link.get("origin"):
            tags.append('<span class="tag origin">origin</span>')
        produces = link.get("produces")
        if produces:
            tags.append(f'<span class="tag produces">→ {esc(produces)}</span>')
        where = []
        if link.get("module") is not None:
            where.append(f"<code>{_module(link.get('module'))}</code>")
        if link.get("phase"):
            where.append(esc(link.get("phase")))
        if link.get("source"):
            where.append(f'<span class="src">{esc(link.get("source"))}</span>')
        cls = ' class="origin"' if link.get("origin") else ""
        items.append(f"<li{cls}><code class=\"op\">{esc(link.get('op'))}</code> {' '.join(tags)}"
                     f"<div class=\"where\">{' · '.join(where)}</div></li>")
    return f'<h4>Chain (origin → … → observed)</h4><ol class="chain">{"".join(items)}</ol>'


def history_html(rows: Sequence[dict[str, Any]], incident_step: int, sparklines: Sequence[str]) -> str:
    """Health figures of the steps before the incident (and of the incident step itself)."""
    if not rows:
        return ""
    shown = list(rows)[-9:]
    body = []
    for r in shown:
        cls = ' class="at"' if r.get("step") == incident_step else ""
        body.append(
            f"<tr{cls}><td class=\"r\">{esc(r.get('step'))}</td><td class=\"r\">{num(r.get('loss'))}</td>"
            f"<td class=\"r\">{num(r.get('grad_norm'))}</td><td class=\"r\">{num(r.get('param_norm'))}</td>"
            f"<td class=\"r\">{num(r.get('scale'))}</td><td>{'yes' if r.get('skipped') else 'no'}</td>"
            f"<td>{esc(r.get('action') or '')}</td></tr>"
        )
    note = f'<p class="note">last {len(shown)} of {len(rows)} steps shown in the table; the sparklines show all of them.</p>' if len(rows) > len(shown) else ""
    return (
        f'<h4>Leading up to it</h4><div class="sparks">{"".join(sparklines)}</div>'
        '<table class="grid history"><thead><tr><th>step</th><th>loss</th><th>grad norm</th><th>param norm</th>'
        f'<th>scale</th><th>skipped</th><th>action</th></tr></thead><tbody>{"".join(body)}</tbody></table>{note}'
    )


def details_html(details: dict[str, Any]) -> str:
    """The incident's remaining evidence: non-finite tensors as a table, the rest as key/value."""
    parts = []
    for key in ("nonfinite_grads", "nonfinite_params"):
        bad = details.get(key)
        if isinstance(bad, list) and bad:
            rows = "".join(
                f"<tr><td><code>{esc(b.get('name'))}</code></td><td class=\"r\">{num(b.get('nan'))}</td>"
                f"<td class=\"r\">{num(b.get('inf'))}</td><td class=\"r\">{num(b.get('numel'))}</td>"
                f"<td>{esc(b.get('shape'))}</td></tr>" for b in bad if isinstance(b, dict)
            )
            label = "gradients" if key == "nonfinite_grads" else "parameters"
            parts.append(
                f"<details><summary>Non-finite {label} ({len(bad)} tensors)</summary><table class=\"grid\"><thead><tr>"
                f"<th>tensor</th><th>NaN</th><th>Inf</th><th>numel</th><th>shape</th></tr></thead><tbody>{rows}</tbody>"
                "</table></details>"
            )
    rest = {k: v for k, v in details.items() if k not in ("nonfinite_grads", "nonfinite_params")}
    if rest:
        items = "".join(f"<div><dt>{esc(k)}</dt><dd>{_detail(v)}</dd></div>" for k, v in rest.items())
        parts.append(f'<details><summary>Other details</summary><dl class="kv small">{items}</dl></details>')
    return "".join(parts)


def _detail(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return esc(value)
    if isinstance(value, (int, float, str)):
        return num(value)
    return f"<code>{esc(json.dumps(value, default=str))}</code>"


def _pointer_note(inc: Incident) -> str:
    """After a pointer's path: which rank holds the full bundle (the report never reads it)."""
    from ..storage.pointer import pointer_note

    note = pointer_note(inc.details)
    return f" ({esc(note)})" if note else ""


def incident_card_html(inc: Incident, snippet: CodeSnippet | None, history: Sequence[dict[str, Any]],
                       sparklines: Sequence[str]) -> str:
    """One incident: what, where (with the code), why, the fix, and the evidence."""
    kv = [
        ("phase", esc(inc.phase)),
        ("op", f"<code>{esc(inc.op)}</code>"),
        ("module", f"<code>{_module(inc.module)}</code>"),
        ("source", f"<code>{esc(inc.source)}</code>"),
        ("rank", esc(inc.rank)),
        ("cause", f'<span class="cause">{esc(inc.cause)}</span>'),
        ("action", esc(inc.action)),
        ("transient", esc(_transient(inc.transient))),
        ("bundle", f"<code>{esc(inc.bundle)}</code>{_pointer_note(inc)}" if inc.bundle else "— (none written)"),
        ("id", f"<code>{esc(inc.id)}</code>"),
    ]
    kv_html = "".join(f"<div><dt>{k}</dt><dd>{v}</dd></div>" for k, v in kv)
    replay = (f'<p class="replay">Reproduce: <code>nantrace replay {esc(inc.bundle)}</code></p>' if inc.bundle else "")
    return (
        f'<article class="card {_severity(inc)}" id="incident-{esc(inc.id)}" data-step="{inc.step}">'
        f'<header><span class="step">step {inc.step}</span><h3>{esc(inc.kind)}</h3>'
        f'<span class="pill">{esc(inc.cause)}</span><span class="pill action">{esc(inc.action)}</span></header>'
        f'<p class="summary">{esc(inc.summary)}</p>'
        f'<dl class="kv">{kv_html}</dl>'
        f"{code_html(snippet, inc.source)}"
        f'<div class="fix"><strong>Fix</strong> {esc(inc.fix)}</div>{replay}'
        f"{input_stats_html(inc.input_stats)}{chain_html(inc.chain)}"
        f"{history_html(history, inc.step, sparklines)}{details_html(inc.details)}"
        "</article>"
    )


# ----------------------------------------------------------------------------- page
_PAGE = string.Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="nantrace $version">
<title>$title</title>
<style>
$css
</style>
<script>$plotlyjs</script>
</head>
<body>
<header class="top">
  <h1>nantrace report <span class="sub">$heading</span></h1>
  <p class="where">run directory <code>$run_dir</code> · rendered $rendered</p>
  <nav><a href="#overview">Overview</a><a href="#curves">Curves</a><a href="#layers">Layers</a><a href="#incidents">Incidents ($n_incidents)</a></nav>
</header>
<main>
<section id="overview">
  <h2>Overview</h2>
  $facts
  $notes
  $incident_table
</section>
<section id="curves">
  <h2>Training curves</h2>
  <p class="legend">▼ incident (click it for the card) · <span class="nonfinite">✕ NaN ▲ +Inf ▼ −Inf</span> at the top edge · ■ skipped update · □ GradScaler skip · ○ zero/negative on a log axis. Zoom one plot and the others follow.</p>
  $curves
</section>
<section id="layers">
  <h2>Layers × steps</h2>
  $heatmaps
</section>
<section id="incidents">
  <h2>Incidents</h2>
  $cards
</section>
</main>
<footer>nantrace $version · self-contained report: no network access needed.</footer>
<script type="application/json" id="nantrace-figures">$figures</script>
<script>
$script
</script>
</body>
</html>
""")

CSS = """
:root { --fg:#1d2330; --muted:#5b6475; --line:#e3e6ec; --bg:#f6f7f9; --card:#fff; --red:#c62828; --warn:#b26a00; --accent:#1f4e99; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; color:var(--fg); background:var(--bg); }
header.top { background:#121826; color:#fff; padding:16px 28px 10px; }
header.top h1 { margin:0; font-size:22px; font-weight:600; }
header.top .sub { font-weight:400; color:#c7cede; font-size:18px; }
header.top .where { margin:4px 0 8px; color:#aab3c5; font-size:12px; }
header.top code { color:#dfe6f5; }
header.top nav a { color:#9fc1ff; margin-right:18px; text-decoration:none; font-size:13px; }
main { padding:8px 28px 40px; max-width:1500px; margin:0 auto; }
section { margin-top:18px; }
h2 { font-size:18px; border-bottom:1px solid var(--line); padding-bottom:4px; }
h3 { margin:0; font-size:16px; }
h4 { margin:16px 0 6px; font-size:13px; text-transform:uppercase; letter-spacing:.04em; color:var(--muted); }
code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size:12.5px; }
dl.facts { display:grid; grid-template-columns:repeat(auto-fill, minmax(210px, 1fr)); gap:8px; margin:0; }
dl.facts > div { background:var(--card); border:1px solid var(--line); border-radius:6px; padding:8px 10px; }
dl.facts dt { color:var(--muted); font-size:11.5px; text-transform:uppercase; letter-spacing:.04em; }
dl.facts dd { margin:2px 0 0; font-size:15px; font-weight:600; word-break:break-word; }
.note { color:var(--muted); font-size:12.5px; margin:8px 0; }
.ok { color:#2e7d32; font-weight:600; }
.legend { color:var(--muted); font-size:12.5px; }
.nonfinite { color:var(--red); font-weight:700; }
.na { color:#aab; }
.plot { background:var(--card); border:1px solid var(--line); border-radius:6px; margin:10px 0; padding-top:6px; }
.plot-title { font-size:14px; font-weight:600; margin:2px 12px 0; }
.plotly-target { min-height:120px; }
table.grid { border-collapse:collapse; background:var(--card); font-size:12.5px; margin:6px 0; }
table.grid th, table.grid td { border:1px solid var(--line); padding:3px 8px; text-align:left; vertical-align:top; }
table.grid th { background:#eef1f6; font-weight:600; }
table.grid td.r { text-align:right; font-variant-numeric: tabular-nums; }
table.grid tr.severe td:first-child { border-left:3px solid var(--red); }
table.grid tr.warn td:first-child { border-left:3px solid var(--warn); }
table.grid tr.at td { background:#fdecea; font-weight:600; }
.card { background:var(--card); border:1px solid var(--line); border-left:5px solid var(--red); border-radius:6px; padding:14px 18px; margin:14px 0; }
.card.warn { border-left-color:var(--warn); }
.card.flash { box-shadow:0 0 0 3px #ffb4a9; }
.card header { display:flex; align-items:center; gap:10px; flex-wrap:wrap; }
.card .step { background:#121826; color:#fff; border-radius:4px; padding:2px 8px; font-weight:600; font-size:12.5px; }
.pill { border:1px solid var(--line); border-radius:999px; padding:1px 9px; font-size:12px; background:#f3f5f9; }
.pill.action { background:#eef6ee; }
.summary { font-size:14.5px; margin:10px 0; }
dl.kv { display:grid; grid-template-columns:repeat(auto-fill, minmax(260px, 1fr)); gap:2px 18px; margin:6px 0; }
dl.kv > div { display:flex; gap:8px; border-bottom:1px dotted var(--line); padding:2px 0; }
dl.kv dt { color:var(--muted); min-width:70px; }
dl.kv dd { margin:0; word-break:break-all; }
dl.kv.small { font-size:12px; }
.cause { color:var(--red); font-weight:700; }
figure.code { margin:10px 0; border:1px solid var(--line); border-radius:6px; overflow:hidden; }
figure.code figcaption { background:#eef1f6; padding:3px 10px; font-size:12px; color:var(--muted); font-family:ui-monospace, Menlo, Consolas, monospace; }
figure.code pre { margin:0; padding:6px 0; background:#fbfbfc; overflow-x:auto; }
figure.code pre code > span { display:block; padding:0 10px; white-space:pre; }
figure.code .ln { display:inline-block; width:3.2em; color:#99a; text-align:right; margin-right:1em; user-select:none; }
figure.code .hl { background:#ffe9a8; border-left:3px solid #e0a800; }
.fix { background:#eef7ee; border:1px solid #cfe6cf; border-radius:6px; padding:8px 12px; margin:10px 0; }
.fix strong { color:#2e7d32; margin-right:6px; }
.replay { font-size:12.5px; color:var(--muted); }
ol.chain { margin:4px 0; padding-left:22px; }
ol.chain li { margin:3px 0; }
ol.chain li.origin { font-weight:600; }
ol.chain li.elided { color:var(--muted); list-style:none; margin-left:-18px; }
ol.chain .where { color:var(--muted); font-size:12px; font-weight:400; }
.tag { font-size:11px; border-radius:3px; padding:0 5px; margin-left:4px; }
.tag.origin { background:var(--red); color:#fff; }
.tag.produces { background:#fdecea; color:var(--red); }
.sparks { display:flex; gap:18px; flex-wrap:wrap; }
.sparks figure { margin:0; }
.sparks figcaption { font-size:11.5px; color:var(--muted); }
svg.spark { background:#fbfbfc; border:1px solid var(--line); border-radius:4px; }
details { margin:8px 0; }
details summary { cursor:pointer; color:var(--accent); }
footer { color:var(--muted); font-size:12px; text-align:center; padding:20px; }
"""

SCRIPT = r"""
(function () {
  "use strict";
  var specs = JSON.parse(document.getElementById("nantrace-figures").textContent);
  var config = {displaylogo: false, responsive: true, modeBarButtonsToRemove: ["select2d", "lasso2d"]};
  var linked = [];
  var syncing = false;
  function sync(source, ev) {
    if (syncing) { return; }
    var update = null;
    if (ev["xaxis.autorange"]) { update = {"xaxis.autorange": true}; }
    else if (ev["xaxis.range[0]"] !== undefined) { update = {"xaxis.range": [ev["xaxis.range[0]"], ev["xaxis.range[1]"]]}; }
    else if (ev["xaxis.range"]) { update = {"xaxis.range": ev["xaxis.range"].slice()}; }
    if (!update) { return; }
    syncing = true;
    var pending = linked.filter(function (d) { return d !== source; }).map(function (d) { return Plotly.relayout(d, update); });
    Promise.all(pending).then(function () { syncing = false; }, function () { syncing = false; });
  }
  function showCard(id) {
    var card = document.getElementById("incident-" + id);
    if (!card) { return; }
    card.scrollIntoView({behavior: "smooth", block: "start"});
    card.classList.add("flash");
    setTimeout(function () { card.classList.remove("flash"); }, 1600);
  }
  specs.forEach(function (spec) {
    var div = document.getElementById(spec.div);
    if (!div) { return; }
    Plotly.newPlot(div, spec.figure.data, spec.figure.layout, config).then(function () {
      if (spec.linked) {
        linked.push(div);
        div.on("plotly_relayout", function (ev) { sync(div, ev); });
      }
      div.on("plotly_click", function (ev) {
        var p = ev && ev.points && ev.points[0];
        if (p && typeof p.customdata === "string") { showCard(p.customdata); }
      });
    });
  });
})();
"""


def page_html(*, version: str, title: str, heading: str, run_dir: str, rendered: str, n_incidents: int, facts: str,
              notes: str, incident_table: str, curves: str, heatmaps: str, cards: str, figures_json: str,
              plotlyjs: str) -> str:
    """The whole page; every argument but ``plotlyjs`` and ``figures_json`` must already be safe HTML."""
    return _PAGE.substitute(
        version=esc(version), title=esc(title), heading=heading, run_dir=esc(run_dir), rendered=esc(rendered),
        n_incidents=n_incidents, facts=facts, notes=notes, incident_table=incident_table, curves=curves,
        heatmaps=heatmaps, cards=cards, figures=figures_json, css=CSS, script=SCRIPT,
        plotlyjs=plotlyjs.replace("</script", "<\\/script"),
    )
