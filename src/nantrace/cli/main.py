"""``nantrace`` entry point: registers the subcommands.

Output convention (every subcommand): results (a diagnosis asked for, a check's report, a
final summary, the path of a written report) go to stdout; progress bars, the panels a
guard prints while training runs, notes and errors go to stderr. Exit codes: 0 success,
1 an incident (``check``) or the script's own failure (``run``), 2 bad usage or input.
"""

from __future__ import annotations

import typer

from .. import __version__
from . import check, demo, replay, report, run
from ._command import Command, Group

PROG = "nantrace"

app = typer.Typer(
    name=PROG,
    cls=Group,
    help="Find, explain and survive numerical failures (NaN/Inf, explosions, fp16 overflow) in PyTorch training.",
    epilog="Run 'nantrace COMMAND --help' for a command's options. Docs: README.md and docs/ in the repository.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"nantrace {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Find, explain and survive numerical failures (NaN/Inf, explosions, fp16 overflow) in PyTorch training."""


app.command("demo", cls=Command, short_help=demo.SHORT_HELP)(demo.demo)
app.command("run", cls=Command, short_help=run.SHORT_HELP, context_settings=run.CONTEXT_SETTINGS)(run.run_command)
app.command("report", cls=Command, short_help=report.SHORT_HELP)(report.report_command)
app.command("replay", cls=Command, short_help=replay.SHORT_HELP)(replay.replay_command)
app.command("check", cls=Command, short_help=check.SHORT_HELP)(check.check_command)


def main() -> None:
    """The ``nantrace`` console script (``python -m nantrace`` does the same)."""
    app(prog_name=PROG)


if __name__ == "__main__":
    main()
