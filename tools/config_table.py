"""Regenerate the Config table in docs/api.md from the field docstrings in config.py.

Usage::

    python tools/config_table.py          # rewrites the table between the markers
    python tools/config_table.py --check  # exit 1 if docs/api.md is out of date
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- config-table:begin -->", "<!-- config-table:end -->"


def table() -> str:
    tree = ast.parse((ROOT / "src/nantrace/config.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    lines = ["| field | default | meaning |", "|---|---|---|"]
    for i, node in enumerate(cls.body):
        if not isinstance(node, ast.AnnAssign):
            continue
        doc = ""
        nxt = cls.body[i + 1] if i + 1 < len(cls.body) else None
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            doc = " ".join(nxt.value.value.split()).replace("|", "\\|")
        default = ast.unparse(node.value) if node.value is not None else ""
        lines.append(f"| `{node.target.id}` | `{default}` | {doc} |")
    return "\n".join(lines)


def main() -> int:
    path = ROOT / "docs/api.md"
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{table()}\n{END}{tail}"
    if "--check" in sys.argv:
        return 0 if new == text else 1
    path.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
