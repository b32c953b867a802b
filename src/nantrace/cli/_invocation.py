"""How the user can call nantrace again, for the commands we print (``nantrace replay ...``).

``make demo`` installs the console script into ``.venv/bin/``, which is usually not on
PATH: telling such a user to type ``nantrace replay ...`` would fail. This names the
command the way that works from the user's shell.
"""

from __future__ import annotations

import os
import shutil
import sys

from ..console import display_path


def nantrace_command() -> str:
    """``nantrace`` when that resolves (on PATH) to the program running now; else the path
    of the console script that runs now (``.venv/bin/nantrace``); else ``python -m nantrace``
    with this interpreter."""
    argv0 = sys.argv[0] if sys.argv else ""
    on_path = shutil.which("nantrace")
    if os.path.basename(argv0) == "nantrace":
        if on_path and os.path.realpath(on_path) == os.path.realpath(argv0):
            return "nantrace"
        return display_path(os.path.abspath(argv0))
    if on_path and os.path.realpath(os.path.dirname(on_path)) == os.path.realpath(os.path.dirname(sys.executable)):
        return "nantrace"
    return f"{display_path(sys.executable)} -m nantrace"
