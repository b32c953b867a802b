"""``nantrace report RUN_DIR [-o FILE]``: render a run directory as one self-contained HTML file.

Usage::

    $ nantrace report runs/exp1
    runs/exp1/report.html                      # stdout: the file written
    report written in 0.4s (3.9 MB)            # stderr
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

SHORT_HELP = "Render a run directory as one self-contained HTML report."


def report_command(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", show_default=False,
                                   help="A run directory written by nantrace (it holds nantrace.db)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", metavar="FILE",
                                          help="HTML file to write (default: RUN_DIR/report.html)."),
) -> None:
    """Render RUN_DIR as one self-contained HTML report (opens offline, no network needed).

    The page shows the run's loss, gradient-norm and learning-rate curves with incident
    markers, per-layer heatmaps and one card per incident. The path of the written file is
    printed on stdout. Exit code 2 when RUN_DIR is not a readable run directory.
    """
    from ..console import display_path
    from ..console import error as console_error

    try:
        from ..report.render import render_report
    except ImportError as exc:  # plotly is an optional extra
        console_error(f"the report needs plotly: pip install 'nantrace[report]' ({exc})")
        raise typer.Exit(2) from None
    start = time.perf_counter()
    try:
        path = render_report(run_dir, output)
    except ValueError as exc:
        console_error(str(exc))
        raise typer.Exit(2) from None
    size = path.stat().st_size / 1e6
    typer.echo(display_path(str(path)))
    typer.echo(f"report written in {time.perf_counter() - start:.1f}s ({size:.1f} MB)", err=True)
