"""The HTML report of a run directory: ``render_report(run_dir, output=None) -> Path``.

``data`` loads and reduces the run store, ``figures`` builds the plotly figures,
``template`` holds the HTML, ``render`` puts them together and writes the file.
Needs plotly (``pip install nantrace[report]``).
"""

from __future__ import annotations

from .render import render_report

__all__ = ["render_report"]
