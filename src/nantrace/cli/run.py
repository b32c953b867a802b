"""``nantrace run SCRIPT [ARGS...]``: run an unmodified training script under watch.

The logic lives in :mod:`nantrace.autowatch`; this is the command-line glue. Everything
after SCRIPT goes to the script, options included (``nantrace run train.py --lr 3e-4``).

Usage::

    $ nantrace run --run-dir runs/exp1 train.py --epochs 3
    ╭─ nantrace · step 3 · nonfinite_loss · skipped ───────────────────╮
    │ what    A division by zero in module 'pool' ...                  │
    ...
    nantrace run: watched Net with AdamW: 1 incident(s), 1 update(s) skipped; run directory runs/exp1
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

CONTEXT_SETTINGS: dict[str, Any] = {
    "allow_extra_args": True,
    "ignore_unknown_options": True,
    "allow_interspersed_args": False,  # nothing after SCRIPT is parsed as ours
}
"""Pass as ``app.command("run", context_settings=CONTEXT_SETTINGS)``."""


def run_command(
    ctx: typer.Context,
    script: Path = typer.Argument(..., help="The training script to run, unmodified; ARGS after it go to the script."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Run directory to write (default: nantrace-runs/<script>-<YYYYmmdd-HHMMSS>)."),
    on_anomaly: str = typer.Option("skip", "--on-anomaly", help="skip (drop the bad update, go on), raise or pause (stop with the diagnosis)."),
) -> None:
    """Run an unmodified training SCRIPT [ARGS...] with every model and optimizer it creates watched."""
    from ..autowatch import default_run_dir, run_script
    from ..console import CONSOLE
    from ..console import error as console_error
    from ..response.policies import POLICIES

    if on_anomaly not in POLICIES:
        raise typer.BadParameter(f"unknown policy {on_anomaly!r}; expected one of {', '.join(POLICIES)}",
                                 param_hint="'--on-anomaly'")
    if not script.is_file():
        console_error(f"no such script: {script}" if not script.exists() else f"not a file: {script}")
        raise typer.Exit(2)
    if run_dir is not None and run_dir.exists() and not run_dir.is_dir():
        console_error(f"--run-dir {run_dir} exists and is not a directory")
        raise typer.Exit(2)
    out = run_dir if run_dir is not None else default_run_dir(script)
    result = run_script(script, list(ctx.args), run_dir=out, on_anomaly=on_anomaly)
    sys.stdout.flush()
    if result.traceback:
        sys.stderr.write(result.traceback)
    elif result.message:
        sys.stderr.write(result.message + "\n")
    auto = result.watch
    if not auto.sessions:
        CONSOLE.print("nantrace run: the script stepped no optimizer over a model it called; nothing was watched.",
                      soft_wrap=True, highlight=False)
    else:
        pairs = ", ".join(f"{type(g.root).__name__} with {type(g.optimizer).__name__}" for g in auto.guards)
        skipped = sum(1 for i in auto.incidents if i.action == "skipped")
        CONSOLE.print(f"nantrace run: watched {pairs}: {len(auto.incidents)} incident(s), {skipped} update(s) skipped; "
                      f"run directory {out}", soft_wrap=True, highlight=False)
        if auto.incidents:
            CONSOLE.print(f"Report: nantrace report {out}", soft_wrap=True, highlight=False)
    raise typer.Exit(result.exit_code)
