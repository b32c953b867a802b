"""``python -m nantrace ...``: the ``nantrace`` command without the console script on PATH."""

from .cli.main import main

main()
