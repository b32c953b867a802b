"""The documentation names every public option, kind, cause and command."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import nantrace

ROOT = Path(__file__).resolve().parents[1]
API = (ROOT / "docs" / "api.md").read_text()


def test_config_table_is_up_to_date():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "config_table.py"), "--check"])
    assert proc.returncode == 0, "docs/api.md is stale: run python tools/config_table.py"


def test_every_config_field_is_documented():
    for group in dataclasses.fields(nantrace.Config):
        assert f"`Config.{group.name}`" in API, group.name
        for field in dataclasses.fields(getattr(nantrace.Config(), group.name)):
            assert f"`{field.name}`" in API, field.name


def test_every_kind_and_cause_is_documented():
    for code in nantrace.KINDS + nantrace.CAUSES:
        assert f"`{code}`" in API or code in (ROOT / "docs" / "dynamics.md").read_text(), code


def test_readme_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    assert "make demo" in first_block and "make test" in first_block
