"""``nantrace replay BUNDLE_DIR``: re-run a failing step from its bundle and print the diagnosis.

Usage::

    $ nantrace replay runs/exp1/incidents/step000030-nonfinite_loss-9e7d6a8a768c
    ╭─ nantrace · step 30 · nonfinite_loss · skipped ─────────────────────────────╮
    │ what       log of an argument outside its domain ...                        │
    ...
    reproduced: same op, module and cause as recorded
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

SHORT_HELP = "Re-run the failing step from an incident bundle and print the diagnosis."


def replay_command(
    bundle_dir: Path = typer.Argument(..., metavar="BUNDLE_DIR", show_default=False,
                                      help="An incident bundle: a directory RUN_DIR/incidents/step…-KIND-ID "
                                           "(or another rank's pointer to one, which is followed)."),
    model: Optional[str] = typer.Option(None, "--model", metavar="MODULE:FACTORY",
                                        help="What builds the model, when the bundle records no importable factory "
                                             "(the model class was defined in a script)."),
    as_json: bool = typer.Option(False, "--json", help="Print the new diagnosis as JSON instead of a panel."),
) -> None:
    """Re-run the failing step from BUNDLE_DIR in this process and print the diagnosis.

    The bundle holds the batch, the pre-step weights and RNG state, so the step replays
    on any machine. The last line says whether the op, module and cause match the ones
    recorded when the incident happened. A pointer (written under data parallelism by a rank
    that holds no full bundle) is followed to the bundle of the rank it names. Exit code 2
    when the bundle cannot be read or a pointer's bundle is not on this filesystem.
    """
    from .._replay import replay
    from ..console import OUT, print_incident
    from ..console import error as console_error

    try:
        incident = replay(bundle_dir, model)
    except ValueError as exc:
        console_error(str(exc))
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(incident.to_dict(), indent=2))
        return
    followed = incident.details.get("followed_pointer")
    if followed is not None:
        OUT.print(f"{followed} is a pointer from rank {incident.details.get('pointer_writer_rank')}: replaying "
                  f"rank {incident.details.get('bundle_rank')}'s bundle {incident.bundle}", soft_wrap=True,
                  markup=False, highlight=False)
    print_incident(incident, OUT)
    saved = json.loads((Path(incident.bundle or bundle_dir) / "diagnosis.json").read_text())
    same = all(saved.get(k) == getattr(incident, k) for k in ("op", "module", "cause"))
    verdict = "[green]reproduced[/green]: same op, module and cause as recorded" if same else (
        f"[yellow]differs from the recorded diagnosis[/yellow] (recorded: op={saved.get('op')}, "
        f"module={saved.get('module')!r}, cause={saved.get('cause')})"
    )
    OUT.print(verdict, soft_wrap=True)
