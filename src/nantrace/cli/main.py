"""``nantrace`` entry point: registers the subcommands."""

from __future__ import annotations

import typer

from .. import __version__
from . import check, demo, replay, report, run

app = typer.Typer(
    name="nantrace",
    help="Find, explain and survive numerical failures in PyTorch training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"nantrace {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Find, explain and survive numerical failures in PyTorch training."""


app.command("check")(check.check_command)
app.command("demo")(demo.demo)
app.command("replay")(replay.replay_command)
app.command("report")(report.report_command)
app.command("run", context_settings=run.CONTEXT_SETTINGS)(run.run_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
