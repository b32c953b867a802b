"""``nantrace check TARGET``: a numerical-stability smoke test for CI.

The logic lives in :mod:`nantrace.check`; this is the command-line glue. TARGET is
``module:function`` or ``path/to/file.py:function``, a function taking no required
arguments that returns a ``nantrace.check.CheckSpec`` or a dict (see docs/check.md).
Exit code 0 when clean, 1 on any incident, 2 when the check could not run. The report
(every diagnosis and the verdict) goes to stdout; why a check could not run, to stderr.

Usage::

    $ nantrace check stability_check:make_check --steps 50
    ╭─ nantrace · step 7 · nonfinite_loss · skipped ───────────────────╮
    │ what       log of an argument outside its domain in module ...   │
    │ op         aten.log.default                                      │
    ...
    nantrace check: 50 steps, 1 incident: FAILED
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NoReturn, Optional

import typer

from ._options import ON_ANOMALY_HELP, check_on_anomaly

SHORT_HELP = "Train a model for a few steps under nantrace, for CI: exit 1 on any incident."


def check_command(
    target: str = typer.Argument(..., metavar="TARGET", show_default=False,
                                 help="module:function or path/to/file.py:function returning the check spec "
                                      "(model, data, loss_fn; see docs/check.md)."),
    steps: int = typer.Option(50, "--steps", min=1, metavar="N", help="Training steps to run."),
    seed: int = typer.Option(0, "--seed", metavar="SEED",
                             help="Seed for Python, NumPy and torch, set before TARGET builds the model."),
    on_anomaly: str = typer.Option("skip", "--on-anomaly", metavar="POLICY",
                                   help=ON_ANOMALY_HELP + " skip and rollback count every incident of the N steps."),
    policy: Optional[str] = typer.Option(None, "--policy", hidden=True, help="Deprecated alias of --on-anomaly."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", metavar="DIR",
                                           help="Also write the run store and incident bundles here "
                                                "(default: nothing is written)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout instead of the report."),
) -> None:
    """Train TARGET's model for a few steps on the CPU under nantrace; exit 1 on any incident.

    Every batch is validated too (NaN/Inf inputs, labels out of range). Exit codes: 0 clean,
    1 an incident, 2 the check could not run (bad TARGET, its code raised).
    """
    from ..check import CheckStepError, CheckUsageError, run_check
    from ..console import OUT, note

    if policy is not None:
        if on_anomaly != "skip" and on_anomaly != policy:
            raise typer.BadParameter(f"--policy {policy} contradicts --on-anomaly {on_anomaly}; "
                                     "--policy is a deprecated alias, give --on-anomaly alone", param_hint="'--policy'")
        note("--policy is deprecated; use --on-anomaly (the same option as in `nantrace run` and nantrace.watch)")
        on_anomaly = policy
    check_on_anomaly(on_anomaly)
    if run_dir is not None and run_dir.exists() and not run_dir.is_dir():
        _fail(f"--run-dir {run_dir} exists and is not a directory", as_json)
    try:
        result = run_check(target, steps=steps, seed=seed, on_anomaly=on_anomaly, run_dir=run_dir)
    except CheckUsageError as exc:
        if exc.detail:
            sys.stderr.write(exc.detail)
        _fail(str(exc), as_json)
    except CheckStepError as exc:
        cause = exc.__cause__
        if cause is not None:
            from ..check import user_traceback

            sys.stderr.write(user_traceback(cause))
        _fail(str(exc), as_json)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        result.print_report(OUT)
    raise typer.Exit(result.exit_code)


def _fail(message: str, as_json: bool) -> NoReturn:
    """Say why the check could not run (stderr; also as JSON on stdout with --json); exit 2."""
    from ..console import error as console_error

    console_error(message)
    if as_json:
        typer.echo(json.dumps({"ok": False, "exit_code": 2, "error": message}, indent=2))
    raise typer.Exit(2)
