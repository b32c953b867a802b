"""Source lines marked in a test file with ``# <origin:tag>``: where an incident's ``source`` must point."""

from __future__ import annotations

import re
from pathlib import Path

_TAG = re.compile(r"#\s*<origin:([\w-]+)>")


def origin_line(path: str, tag: str) -> int:
    """The one line of ``path`` marked ``# <origin:tag>``."""
    with open(path, encoding="utf-8") as f:
        hits = [i for i, line in enumerate(f, 1) for m in _TAG.finditer(line) if m.group(1) == tag]
    assert len(hits) == 1, tag
    return hits[0]


def points_at(source: str | None, path: str, tag: str) -> bool:
    """Whether an incident's ``source`` (relative or absolute ``file:line``) names that marked line."""
    return source is not None and source.replace("\\", "/").rsplit("/", 1)[-1] == f"{Path(path).name}:{origin_line(path, tag)}"
