"""Human-facing rendering of incidents with rich: one readable block per incident.

Two consoles, following the command-line convention:

- :data:`OUT` (stdout) carries *results*: what a command was asked to produce (the
  diagnosis ``nantrace replay`` prints, the report of ``nantrace check``, the final summary
  of ``demo`` and ``run``), so ``nantrace demo > log`` captures them;
- :data:`CONSOLE` (stderr) carries *logs and progress*: the panel a guard prints while the
  user's training runs (it is a log line of a library living inside someone else's program,
  whose stdout belongs to them), progress bars, notes and errors.

The panel never truncates a number, a dtype, a shape or a ``file:line``: below the width
its content needs it wraps (text) or re-lays itself out (the input statistics table turns
into one column per argument, then one small table per argument).

Usage::

    from nantrace.console import incident_text
    print(incident_text(guard.incidents[0], width=80))
    ╭─ nantrace · step 30 · nonfinite_loss · skipped ──────────────────────────────╮
    │ what       log of an argument outside its domain in the model's top-level    │
    │            forward (95 zeros and 0 negatives in its input).                  │
    │ op         aten.log.default                                                  │
    ...
"""

from __future__ import annotations

import linecache
import os
from collections.abc import Iterable, Sequence
from typing import Any

import random as _random

_USER_RANDOM = _random.getstate()  # rich draws from Python's global RNG as it is imported (rich.style)
try:
    from rich.console import Console, ConsoleOptions, Group, RenderResult
    from rich.panel import Panel
    from rich.syntax import Syntax
    from rich.table import Table
    from rich.text import Text
finally:
    _random.setstate(_USER_RANDOM)  # nantrace changes nothing the user's training draws
    del _USER_RANDOM

from .incident import Incident

__all__ = [
    "CONSOLE",
    "OUT",
    "InputStats",
    "display_path",
    "error",
    "incident_text",
    "note",
    "print_incident",
    "render_incident",
    "source_snippet",
]

CONSOLE = Console(stderr=True, highlight=False, soft_wrap=False)
"""stderr: live incidents, progress, notes and errors; share it (e.g. with a rich Progress) to keep output tidy."""

OUT = Console(highlight=False, soft_wrap=False)
"""stdout: the results of a command (a replayed diagnosis, a check's report, a final summary)."""

LABEL_WIDTH = 10
"""Width of the label column (``transient``, ``bad params``) shared by every labelled row."""

STAT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("dtype", "dtype"), ("shape", "shape"), ("min", "min"), ("max", "max"), ("min|x|", "min_abs"),
    ("zeros", "zeros"), ("neg", "negatives"), ("nan", "nan"), ("inf", "inf"),
)
"""(heading, key in ``Incident.input_stats``) of the statistics shown for each input."""


# ----------------------------------------------------------------------------- paths
def display_path(path: str, cwd: str | None = None) -> str:
    """``path`` relative to ``cwd`` (default: the working directory) when it lies under it,
    else unchanged. Accepts ``path:LINE`` too (the line number is kept)."""
    base, sep, line = path.rpartition(":")
    if sep and line.isdigit() and base:
        return f"{display_path(base, cwd)}:{line}"
    if not os.path.isabs(path):
        return path
    root = os.path.abspath(cwd or os.getcwd())
    try:
        if os.path.commonpath([root, os.path.abspath(path)]) == root:
            return os.path.relpath(path, root)
    except ValueError:  # another drive (Windows)
        pass
    return path


def source_snippet(source: str | None, context: int = 2) -> tuple[str, int, str] | None:
    """(path, line, text of the lines around it) for a ``path:LINE`` source, if readable.

    The text holds the lines ``LINE - context`` .. ``LINE + context`` that exist, exactly as
    in the file; blank lines after the highlighted one are dropped (they say nothing) and the
    text carries no trailing newline, so no empty line appears that is not in the file.
    """
    if not source or ":" not in source:
        return None
    path, _, line = source.rpartition(":")
    try:
        lineno = int(line)
    except ValueError:
        return None
    first = max(1, lineno - context)
    lines = [linecache.getline(path, n) for n in range(first, lineno + context + 1)]
    if not any(lines):
        return None
    while len(lines) > lineno - first + 1 and not lines[-1].strip():
        lines.pop()
    return path, lineno, "".join(lines).rstrip("\n")


# ----------------------------------------------------------------------------- numbers
def _fmt(value: Any) -> str:
    """A statistic as shown: six significant digits, enough for 65504 (the float16 maximum)."""
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return "" if value is None else str(value)


class InputStats:
    """The statistics of the origin op's inputs, laid out to fit the width it is given.

    Wide enough: one row per input (``arg  dtype  shape  min ...``). Narrower: one column
    per input and one row per statistic. Narrower still: one such table per input. Cells
    never wrap and are never cut, so a number, a dtype or a shape is always whole.
    """

    def __init__(self, stats: Sequence[dict[str, Any]]) -> None:
        self.args = [str(s.get("arg", f"arg{i}")) for i, s in enumerate(stats)]
        self.cells = [[_fmt(s.get(key)) for _, key in STAT_COLUMNS] for s in stats]

    def wide(self) -> Table:
        table = self._table()
        table.add_column("arg", no_wrap=True)
        for heading, _ in STAT_COLUMNS:
            table.add_column(heading, justify="left" if heading in ("dtype", "shape") else "right", no_wrap=True)
        for arg, cells in zip(self.args, self.cells):
            table.add_row(arg, *cells)
        return table

    def tall(self, which: Iterable[int]) -> Table:
        which = list(which)
        table = self._table()
        table.add_column("", no_wrap=True, style="bold")
        for i in which:
            table.add_column(self.args[i], justify="right", no_wrap=True, overflow="fold")
        for row, (heading, _) in enumerate(STAT_COLUMNS):
            table.add_row(heading, *(self.cells[i][row] for i in which))
        return table

    @staticmethod
    def _table() -> Table:
        return Table(show_edge=False, pad_edge=False, box=None, padding=(0, 1, 0, 1), collapse_padding=True,
                     header_style="bold")

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text("inputs of the origin op", style="bold cyan")
        width = options.max_width
        for table in (self.wide(), self.tall(range(len(self.args)))):
            if console.measure(table, options=options.update_width(1 << 16)).maximum <= width:
                yield table
                return
        for i in range(len(self.args)):
            yield self.tall([i])


# ----------------------------------------------------------------------------- the panel
def _grid() -> Table:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold cyan", no_wrap=True, min_width=LABEL_WIDTH)
    grid.add_column(overflow="fold")
    return grid


def _module(module: str | None) -> str:
    if module is None:
        return "outside the model"
    return "'' (the watched model itself)" if module == "" else repr(module)


def render_incident(incident: Incident) -> Panel:
    """The incident as a rich panel: what, where (op, module, line with code), why, fix, evidence."""
    title = f"nantrace · step {incident.step} · {incident.kind} · {incident.action}"
    head = _grid()
    head.add_row("what", Text(incident.summary))
    head.add_row("phase", Text(str(incident.phase)))
    if incident.op:
        head.add_row("op", Text(incident.op))
    if incident.module is not None or incident.op:
        head.add_row("module", Text(_module(incident.module)))
    if incident.source:
        head.add_row("source", Text(display_path(incident.source)))
    head.add_row("cause", Text(incident.cause, style="bold yellow"))
    if incident.transient is not None:
        head.add_row("transient", Text("yes: an identical re-run was finite" if incident.transient
                                       else "no: reproduced on re-run"))
    if incident.rank:
        head.add_row("rank", Text(str(incident.rank)))
    parts: list[Any] = [head]
    snippet = source_snippet(incident.source)
    if snippet:
        _, lineno, code = snippet
        parts.append(Syntax(code, "python", line_numbers=True, start_line=max(1, lineno - 2),
                            highlight_lines={lineno}, word_wrap=True))
    if incident.input_stats:
        parts.append(InputStats(incident.input_stats))
    tail = _grid()
    if incident.chain:
        tail.add_row("chain", Text(" → ".join(
            f"{c.get('op')}" + (f" [{c.get('module')}]" if c.get("module") else "") for c in incident.chain)))
    for key, label in (("nonfinite_params", "bad params"), ("nonfinite_grads", "bad grads")):
        bad = incident.details.get(key)
        if bad:
            names = ", ".join(f"{b['name']} ({b['nan']} NaN, {b['inf']} Inf)" if b.get("nan") is not None
                              else f"{b['name']} (norm {b.get('norm', 'non-finite')})" for b in bad[:6])
            more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
            tail.add_row(label, Text(names + more))
    tail.add_row(Text("fix", style="bold green"), Text(incident.fix))
    if incident.bundle:
        from .storage.pointer import pointer_note

        note = pointer_note(incident.details)
        tail.add_row("bundle", Text(display_path(incident.bundle) + (f" ({note})" if note else "")))
    parts.append(tail)
    return Panel(Group(*parts), title=title, title_align="left",
                 border_style="red" if incident.kind.startswith("nonfinite") else "yellow")


def print_incident(incident: Incident, console: Console | None = None) -> None:
    """Print the panel on ``console`` (default: :data:`CONSOLE`, stderr)."""
    (console or CONSOLE).print(render_incident(incident))


def incident_text(incident: Incident, width: int = 100) -> str:
    """The rendered panel as plain text (for logs, snapshot tests and the CLI)."""
    with open(os.devnull, "w") as sink:
        console = Console(width=width, record=True, file=sink, color_system=None)
        console.print(render_incident(incident))
        return console.export_text()


# ----------------------------------------------------------------------------- messages
def error(message: str) -> None:
    """Print a user-facing error on stderr, unwrapped so it can be grepped and copied whole."""
    from rich.markup import escape

    CONSOLE.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True, markup=True, highlight=False)


def note(message: str) -> None:
    """Print a one-line note from nantrace on stderr (``nantrace: ...``), unwrapped."""
    from rich.markup import escape

    CONSOLE.print(f"[yellow]nantrace:[/yellow] {escape(message)}", soft_wrap=True, markup=True, highlight=False)
