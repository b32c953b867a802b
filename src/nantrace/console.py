"""Human-facing rendering of incidents with rich: one readable block per incident."""

from __future__ import annotations

import linecache
import sys
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from .incident import Incident

CONSOLE = Console(stderr=True, highlight=False, soft_wrap=False)
"""The console nantrace prints incidents to; share it (e.g. with a rich Progress) to keep output tidy."""


def source_snippet(source: str | None, context: int = 2) -> tuple[str, int, str] | None:
    """(path, line, text of the lines around it) for a ``path:LINE`` source, if readable."""
    if not source or ":" not in source:
        return None
    path, _, line = source.rpartition(":")
    try:
        lineno = int(line)
    except ValueError:
        return None
    lines = [linecache.getline(path, n) for n in range(max(1, lineno - context), lineno + context + 1)]
    if not any(lines):
        return None
    return path, lineno, "".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render_incident(incident: Incident) -> Panel:
    """The incident as a rich panel: what, where (op, module, line with code), why, fix, evidence."""
    title = f"nantrace · step {incident.step} · {incident.kind} · {incident.action}"
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold cyan", no_wrap=True)
    head.add_column()
    head.add_row("what", Text(incident.summary))
    head.add_row("phase", str(incident.phase))
    if incident.op:
        head.add_row("op", incident.op)
    if incident.module is not None or incident.op:
        head.add_row("module", repr(incident.module) if incident.module is not None else "outside the model")
    if incident.source:
        head.add_row("source", incident.source)
    head.add_row("cause", Text(incident.cause, style="bold yellow"))
    if incident.transient is not None:
        head.add_row("transient", "yes: an identical re-run was finite" if incident.transient else "no: reproduced on re-run")
    if incident.rank:
        head.add_row("rank", str(incident.rank))
    parts: list[Any] = [head]
    snippet = source_snippet(incident.source)
    if snippet:
        path, lineno, code = snippet
        parts.append(
            Syntax(code, "python", line_numbers=True, start_line=max(1, lineno - 2), highlight_lines={lineno}, word_wrap=True)
        )
    if incident.input_stats:
        stats = Table(title="inputs of the origin op", title_justify="left", show_edge=False, pad_edge=False)
        for col in ("arg", "dtype", "shape", "min", "max", "min|x|", "zeros", "neg", "nan", "inf"):
            stats.add_column(col, justify="right" if col not in ("arg", "dtype") else "left")
        for s in incident.input_stats:
            stats.add_row(
                str(s.get("arg", "")), str(s.get("dtype", "")), str(s.get("shape", "")),
                *(_fmt(s.get(k, "")) for k in ("min", "max", "min_abs", "zeros", "negatives", "nan", "inf")),
            )
        parts.append(stats)
    if incident.chain:
        chain = " → ".join(f"{c.get('op')}" + (f" [{c.get('module')}]" if c.get("module") else "") for c in incident.chain)
        parts.append(Text.assemble(("chain  ", "bold cyan"), chain))
    for key, label in (("nonfinite_params", "bad params  "), ("nonfinite_grads", "bad grads  ")):
        bad = incident.details.get(key)
        if bad:
            names = ", ".join(f"{b['name']} ({b['nan']} NaN, {b['inf']} Inf)" for b in bad[:6])
            more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
            parts.append(Text.assemble((label, "bold cyan"), names + more))
    parts.append(Text.assemble(("fix  ", "bold green"), incident.fix))
    if incident.bundle:
        parts.append(Text.assemble(("bundle  ", "bold cyan"), incident.bundle))
    return Panel(Group(*parts), title=title, title_align="left", border_style="red" if incident.kind.startswith("nonfinite") else "yellow")


def print_incident(incident: Incident, console: Console | None = None) -> None:
    (console or CONSOLE).print(render_incident(incident))


def incident_text(incident: Incident, width: int = 100) -> str:
    """The rendered panel as plain text (for logs, snapshot tests and the CLI)."""
    console = Console(width=width, record=True, file=open(_devnull(), "w"), color_system=None)
    console.print(render_incident(incident))
    return console.export_text()


def _devnull() -> str:
    return "NUL" if sys.platform == "win32" else "/dev/null"


def error(message: str) -> None:
    """Print a user-facing error on stderr, unwrapped so it can be grepped and copied whole."""
    from rich.markup import escape

    CONSOLE.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True, markup=True, highlight=False)
