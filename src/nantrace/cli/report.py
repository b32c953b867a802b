"""``nantrace report RUN_DIR [-o FILE]``: render a run directory as one self-contained HTML file."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer


def report_command(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="A run directory written by nantrace (it holds nantrace.db)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="HTML file to write (default: RUN_DIR/report.html)."),
) -> None:
    """Render RUN_DIR as one self-contained HTML report (opens offline, no network needed)."""
    from rich.markup import escape

    from ..console import error as console_error

    try:
        from ..report.render import render_report
    except ImportError as exc:  # plotly is an optional extra
        console_error(escape(f"the report needs plotly: pip install 'nantrace[report]' ({exc})"))
        raise typer.Exit(2) from None
    start = time.perf_counter()
    try:
        path = render_report(run_dir, output)
    except ValueError as exc:
        console_error(escape(str(exc)))
        raise typer.Exit(2) from None
    size = path.stat().st_size / 1e6
    typer.echo(f"{path}")
    typer.echo(f"report written in {time.perf_counter() - start:.1f}s ({size:.1f} MB)", err=True)
