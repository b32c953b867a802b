"""The README a newcomer reads: every command with an example, the four policies, how to
call the installed command, every doc page linked, and a quick-start output that is the
real one."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_every_command_appears_with_an_example():
    from nantrace.cli.main import app

    commands = {c.name for c in app.registered_commands}
    assert commands == {"demo", "run", "report", "replay", "check"}
    table = README.split("## Command line", 1)[1].split("\n## ", 1)[0]
    for command in commands:
        row = next(line for line in table.splitlines() if line.startswith(f"| `nantrace {command}`"))
        example = row.rstrip(" |").rsplit("| ", 1)[1]
        assert example.startswith(f"`nantrace {command}"), (command, example)


def test_the_four_policies_are_listed():
    section = README.split("four policies", 1)[1].split("\n## ", 1)[0]
    for policy in ("skip", "raise", "rollback", "pause"):
        assert f"| `{policy}`" in section, policy


def test_it_says_where_the_installed_command_is():
    assert ".venv/bin/nantrace" in README and "source .venv/bin/activate" in README and "make cli" in README
    makefile = (ROOT / "Makefile").read_text()
    assert "\ncli: $(STAMP)\n" in makefile and "--quiet" not in makefile


def test_every_doc_page_is_linked():
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in README, page.name


def test_the_quick_start_output_is_the_real_one(tmp_path):
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples" / "quickstart.py", tmp_path / "examples")
    env = dict(os.environ, COLUMNS="100", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "examples/quickstart.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    shown = README.split("`python examples/quickstart.py` prints", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    real = proc.stderr + proc.stdout
    strip_id = lambda text: re.sub(r"nonfinite_loss-[0-9a-f]{12}", "nonfinite_loss-ID", text)  # noqa: E731
    assert strip_id(shown) == strip_id(real)
