"""Typer command classes that print conventional ``--help`` texts.

Typer (0.29) renders a required argument as ``{RUN_DIR}`` in the usage line and gives a
flag a type column (``--json <bool>``). Command-line tools write ``RUN_DIR`` and
``[ARGS]...`` (for a command that passes extra arguments on) and show a flag bare; these classes, passed as ``cls=`` to ``typer.Typer``
and ``app.command``, make the usage line and the option table say so. Everything else
(the rich panels, the wrapping, the colours) is Typer's own rendering.

Usage::

    app = typer.Typer(cls=Group)
    app.command("report", cls=Command)(report_command)

    $ nantrace report --help
    Usage: nantrace report [OPTIONS] RUN_DIR
"""

from __future__ import annotations

from typing import Any

import typer.core


def _usage_name(param: typer.core.TyperArgument) -> str:
    """``RUN_DIR`` for a required argument, ``[ARGS]...`` for optional repeated ones."""
    name = param.metavar or (param.name or "arg").upper()
    if param.nargs != 1:
        name += "..."
    return name if param.required else f"[{name}]"


class _Conventional:
    """Mix-in for a Typer command or group: conventional usage pieces, bare flags."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        renamed: dict[str, str] = {}
        for param in self.get_params(ctx):  # type: ignore[attr-defined]
            if isinstance(param, typer.core.TyperArgument):
                for piece in param.get_usage_pieces(ctx):
                    renamed[piece] = _usage_name(param)
        pieces = [renamed.get(piece, piece) for piece in super().collect_usage_pieces(ctx)]  # type: ignore[misc]
        if getattr(self, "context_settings", {}).get("allow_extra_args") and not isinstance(self, typer.core.TyperGroup):
            pieces.append("[ARGS]...")  # passed through untouched (``nantrace run SCRIPT [ARGS]...``)
        return pieces

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if isinstance(param, typer.core.TyperOption) and param.is_flag and param.metavar is None:
                param.metavar = ""  # a flag takes no value: no type column (Typer shows ``<bool>``)
        return params


class Command(_Conventional, typer.core.TyperCommand):
    """A subcommand (``nantrace report``...)."""


class Group(_Conventional, typer.core.TyperGroup):
    """The ``nantrace`` group itself."""
