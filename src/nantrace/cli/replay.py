"""``nantrace replay BUNDLE_DIR``: re-run a failing step from its bundle and print the diagnosis."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..console import CONSOLE, print_incident
from ..console import error as console_error


def replay_command(
    bundle_dir: Path = typer.Argument(..., help="An incident bundle: RUN_DIR/incidents/<incident>."),
    model: Optional[str] = typer.Option(None, "--model", help="module:factory that builds the model, if the bundle records none."),
    as_json: bool = typer.Option(False, "--json", help="Print the new diagnosis as JSON instead of a panel."),
) -> None:
    """Re-run the failing step from BUNDLE_DIR in this process and print the diagnosis."""
    from .._replay import replay

    try:
        incident = replay(bundle_dir, model)
    except ValueError as exc:
        console_error(str(exc))
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(incident.to_dict(), indent=2))
        return
    print_incident(incident)
    saved = json.loads((Path(bundle_dir) / "diagnosis.json").read_text())
    same = all(saved.get(k) == getattr(incident, k) for k in ("op", "module", "cause"))
    verdict = "[green]reproduced[/green]: same op, module and cause as recorded" if same else (
        f"[yellow]differs from the recorded diagnosis[/yellow] (recorded: op={saved.get('op')}, "
        f"module={saved.get('module')!r}, cause={saved.get('cause')})"
    )
    CONSOLE.print(verdict)
