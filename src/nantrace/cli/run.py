"""``nantrace run SCRIPT [ARGS...]``: run an unmodified training script under watch.

The logic lives in :mod:`nantrace.autowatch`; this is the command-line glue. Everything
after SCRIPT goes to the script, options included (``nantrace run train.py --lr 3e-4``).
The script's own output and traceback appear as with ``python SCRIPT``; the panels of the
incidents go to stderr as they happen; the closing summary goes to stdout and says what was
watched, what happened and where the run directory is (or that none was written).

Usage::

    $ nantrace run --run-dir runs/exp1 train.py --epochs 3
    ╭─ nantrace · step 3 · nonfinite_loss · skipped ───────────────────╮
    │ what       A division by zero in module 'pool' ...               │
    ...
    nantrace run: watched Net with AdamW: 1 incident, 1 update skipped; run directory runs/exp1
    Report: nantrace report runs/exp1
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from ..taxonomy import Action
from ._options import ON_ANOMALY_HELP, check_on_anomaly

SHORT_HELP = "Run an unmodified training script with every model and optimizer it creates watched."

CONTEXT_SETTINGS: dict[str, Any] = {
    "allow_extra_args": True,
    "ignore_unknown_options": True,
    "allow_interspersed_args": False,  # nothing after SCRIPT is parsed as ours
}
"""Pass as ``app.command("run", context_settings=CONTEXT_SETTINGS)``."""


def run_command(
    ctx: typer.Context,
    script: Path = typer.Argument(..., metavar="SCRIPT", show_default=False,
                                  help="The training script, unmodified; the ARGS after it go to the script."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", metavar="DIR",
                                           help="Run directory to write (default: "
                                                "nantrace-runs/SCRIPT-YYYYmmdd-HHMMSS)."),
    on_anomaly: str = typer.Option("skip", "--on-anomaly", metavar="POLICY", help=ON_ANOMALY_HELP),
) -> None:
    """Run SCRIPT [ARGS...] as `python SCRIPT ARGS...` would, with every model and optimizer it creates watched.

    nantrace options go before SCRIPT; everything after it is the script's. The exit code is
    the script's own. A script that calls nantrace.watch itself keeps its own guard (and its
    own run directory).
    """
    from ..autowatch import default_run_dir, run_script
    from ..console import error as console_error

    check_on_anomaly(on_anomaly)
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
        sys.stderr.flush()
        from ..console import print_incident

        for incident in result.diagnosed:  # why it raised: the bad value's origin
            print_incident(incident)
    elif result.message:
        sys.stderr.write(result.message + "\n")
    sys.stderr.flush()
    for line in summary(result, script):
        _say(line)
    raise typer.Exit(result.exit_code)


def summary(result: Any, script: Path) -> list[str]:
    """The closing lines of ``nantrace run``: what was watched, by whom, what happened, where it is."""
    from ..console import display_path

    auto = result.watch
    lines: list[str] = []
    failed = _how_it_failed(result)
    if isinstance(result.error, (SyntaxError, ValueError, OSError)) and not auto.sessions and not auto.own_guards:
        return [f"nantrace run: {script} could not be compiled, so nothing ran; no run directory was written."]
    if auto.own_guards:
        incidents = [i for g in auto.own_guards for i in g.incidents]
        dirs = sorted({display_path(g.run_dir) for g in auto.own_guards if g.run_dir is not None})
        where = f"its run directory {', '.join(dirs)}" if dirs else "it gave watch() no run_dir, so nothing was written"
        lines.append(f"nantrace run: the script watches {_pairs(auto.own_guards)} itself with nantrace.watch: "
                     f"{_counts(incidents)}; {where}" + (f"; {failed}" if failed and not auto.sessions else "") + ".")
    if auto.sessions:
        first = display_path(str(auto.guards[0].run_dir))
        extra = f" (and subdirectories for the other {len(auto.sessions) - 1})" if len(auto.sessions) > 1 else ""
        lines.append(f"nantrace run: watched {_pairs(auto.guards)}: {_counts(auto.incidents)}; "
                     f"run directory {first}{extra}" + (f"; {failed}" if failed else "") + ".")
        if auto.incidents:
            lines.append(f"Report: nantrace report {first}")
    elif auto.own_guards:
        lines.append("nantrace run: --run-dir was not used (the script's own guard writes where the script says).")
    elif failed:
        lines.append(f"nantrace run: {failed} before any optimizer step over a model it called; "
                     "nothing was watched and no run directory was written.")
    else:
        lines.append("nantrace run: the script stepped no optimizer over a model it called; "
                     "nothing was watched and no run directory was written.")
    return lines


def _how_it_failed(result: Any) -> str | None:
    if isinstance(result.error, KeyboardInterrupt):
        return "the script was interrupted (Ctrl-C)"
    if result.error is not None:
        return f"the script raised {type(result.error).__name__} (exit code {result.exit_code})"
    if result.exit_code:
        return f"the script exited with code {result.exit_code}"
    return None


def _pairs(guards: list[Any]) -> str:
    return ", ".join(f"{type(g.root).__name__} with {type(g.optimizer).__name__}" for g in guards)


def _counts(incidents: list[Any]) -> str:
    skipped = sum(1 for i in incidents if i.action == Action.SKIPPED)
    return (f"{len(incidents)} incident{'' if len(incidents) == 1 else 's'}, "
            f"{skipped} update{'' if skipped == 1 else 's'} skipped")


def _say(line: str) -> None:
    from ..console import OUT

    OUT.print(line, soft_wrap=True, highlight=False, markup=False)
