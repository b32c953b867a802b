"""``nantrace check TARGET``: a numerical-stability smoke test for CI.

The logic lives in :mod:`nantrace.check`; this is the command-line glue. TARGET is
``module:function`` or ``path/to/file.py:function``, a function taking no required
arguments that returns a ``nantrace.check.CheckSpec`` or a dict (see docs/check.md).
Exit code 0 when clean, 1 on any incident, 2 when the check could not run.

Usage::

    $ nantrace check stability_check:make_check --steps 50
    ╭─ nantrace · step 7 · nonfinite_loss · skipped ───────────────────╮
    │ what    log of an argument outside its domain in module 'energy' │
    │ op      aten.log.default                                         │
    ...
    nantrace check: 50 steps, 1 incident: FAILED
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NoReturn, Optional

import typer


def check_command(
    target: str = typer.Argument(..., metavar="TARGET", help="module:function or path/to/file.py:function returning the check spec "
                                           "(model, data, loss_fn; see docs/check.md)."),
    steps: int = typer.Option(50, "--steps", min=1, help="Training steps to run."),
    seed: int = typer.Option(0, "--seed", help="Seed for Python, NumPy and torch, set before TARGET builds the model."),
    policy: str = typer.Option("skip", "--policy", help="skip (drop each bad update, go on, count every incident) "
                                                        "or raise (stop at the first incident)."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Also write the run store and incident bundles "
                                                                   "here (default: nothing is written)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout instead of the diagnosis."),
) -> None:
    """Train TARGET's model for a few steps on the CPU under nantrace; exit 1 on any incident."""
    from ..check import CHECK_POLICIES, CheckStepError, CheckUsageError, run_check
    from ..console import CONSOLE

    if policy not in CHECK_POLICIES:
        raise typer.BadParameter(f"unknown policy {policy!r}; expected one of {', '.join(CHECK_POLICIES)}",
                                 param_hint="'--policy'")
    if run_dir is not None and run_dir.exists() and not run_dir.is_dir():
        _fail(f"--run-dir {run_dir} exists and is not a directory", as_json)
    try:
        result = run_check(target, steps=steps, seed=seed, policy=policy, run_dir=run_dir)
    except CheckUsageError as exc:
        if exc.detail:
            sys.stderr.write(exc.detail)
        _fail(str(exc), as_json)
    except CheckStepError as exc:
        cause = exc.__cause__
        if cause is not None:
            import traceback

            sys.stderr.write("".join(traceback.format_exception(type(cause), cause, cause.__traceback__)))
        _fail(str(exc), as_json)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        result.print_report(CONSOLE)
    raise typer.Exit(result.exit_code)


def _fail(message: str, as_json: bool) -> NoReturn:
    """Say why the check could not run (stderr; also as JSON on stdout with --json); exit 2."""
    from ..console import error as console_error

    console_error(message)
    if as_json:
        typer.echo(json.dumps({"ok": False, "exit_code": 2, "error": message}, indent=2))
    raise typer.Exit(2)
