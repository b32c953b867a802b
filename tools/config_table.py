"""Regenerate the Config tables in docs/api.md from the settings groups' field docstrings.

Each group of ``nantrace.Config`` is defined (and documented, one docstring under each field) in
its own module; this reads those modules' source, so it needs no import of torch.

Usage::

    python tools/config_table.py          # rewrites the tables between the markers
    python tools/config_table.py --check  # exit 1 if docs/api.md is out of date
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src/nantrace"
BEGIN, END = "<!-- config-table:begin -->", "<!-- config-table:end -->"
GROUPS = (  # Config attribute, module defining it, class
    ("detection", "detection/settings.py", "DetectionConfig"),
    ("response", "response/settings.py", "ResponseConfig"),
    ("localisation", "localisation/settings.py", "LocalisationConfig"),
    ("dynamics", "dynamics/settings.py", "DynamicsConfig"),
    ("outputs", "storage/settings.py", "OutputsConfig"),
)


def _docstring(node: ast.AST | None) -> str:
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
        return " ".join(node.value.value.split()).replace("|", "\\|")
    return ""


def group_table(group: str, module: str, name: str) -> str:
    tree = ast.parse((PACKAGE / module).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    lines = [f"### `Config.{group}` (`{name}`, `{module}`)", "", _docstring(cls.body[0]), "",
             "| field | default | meaning |", "|---|---|---|"]
    for i, node in enumerate(cls.body):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        if isinstance(node.annotation, ast.Subscript) and ast.unparse(node.annotation.value) == "ClassVar":
            continue
        doc = _docstring(cls.body[i + 1] if i + 1 < len(cls.body) else None)
        default = ast.unparse(node.value) if node.value is not None else ""
        lines.append(f"| `{node.target.id}` | `{default}` | {doc} |")
    return "\n".join(lines)


def table() -> str:
    return "\n\n".join(group_table(*g) for g in GROUPS)


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
