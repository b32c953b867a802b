"""The printed diagnosis, compared whole against expected renderings (snapshots).

The panel must never truncate a number, a dtype, a shape or a ``file:line`` at any width
from 80 columns up: it wraps text and re-lays the input statistics out instead. The
snapshots live in ``tests/snapshots/panel_*.txt``; after an intended change of the layout,
regenerate them with ``NANTRACE_UPDATE_SNAPSHOTS=1 pytest tests/test_console.py`` and
review the diff.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from nantrace.console import InputStats, display_path, incident_text, source_snippet
from nantrace.diagnosis.patterns import explain
from nantrace.incident import Incident

SNAPSHOTS = Path(__file__).parent / "snapshots"

MODEL_PY = '''\
class Attention:
    def forward(self, q, k, pad):
        scores = q @ k.transpose(-1, -2)
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        # every query of an empty record sees only -inf
        attn = scores.softmax(dim=-1)
        return attn


def unrelated():
    pass
'''

LIBRARY_SOURCE = "/opt/conda/envs/train/lib/python3.11/site-packages/transformers/models/llama/modeling_llama.py:1234"


def snapshot(name: str, text: str) -> str:
    """The stored snapshot ``name`` (written from ``text`` when NANTRACE_UPDATE_SNAPSHOTS=1)."""
    path = SNAPSHOTS / name
    if os.environ.get("NANTRACE_UPDATE_SNAPSHOTS") == "1":
        path.write_text(text)
    return path.read_text()


def masked_softmax() -> Incident:
    """The demo's failure: a fully masked attention row, with a long shape and large counts."""
    summary, fix = explain("masked_softmax_all", "aten._softmax.default", module="blocks.0.attn",
                           detail="128 row(s) of 32 entries all -inf")
    return Incident(
        step=70, kind="nonfinite_loss", phase="forward", op="aten._softmax.default", module="blocks.0.attn",
        source="model.py:6", rank=0, cause="masked_softmax_all", summary=summary, fix=fix, action="skipped",
        transient=False, bundle="runs/demo/incidents/step000070-nonfinite_loss-b596ee42add0",
        input_stats=[{"arg": "arg0", "dtype": "float32", "shape": [16, 4, 32, 32], "min": float("-inf"),
                      "max": 3.2406, "min_abs": 6.5612e-06, "zeros": 0, "negatives": 48040, "nan": 0, "inf": 29568}],
        chain=[{"op": "aten.masked_fill.Scalar", "module": "blocks.0.attn"},
               {"op": "aten._softmax.default", "module": "blocks.0.attn"},
               {"op": "aten.bmm.default", "module": "blocks.0.attn"}],
        details={"nonfinite_grads": [{"name": f"blocks.{i}.attn.qkv.weight", "nan": 4096, "inf": 0} for i in range(8)]},
    )


def library_overflow() -> Incident:
    """An fp16 overflow in a library's module: three inputs, an absolute path outside the cwd."""
    summary, fix = explain("precision_overflow", "aten.addmm.default", module="model.layers.31.mlp.down_proj")
    stats = [
        {"arg": "arg0", "dtype": "float16", "shape": [11008], "min": -0.0312, "max": 0.0297, "min_abs": 0.0,
         "zeros": 3, "negatives": 5491, "nan": 0, "inf": 0},
        {"arg": "arg1", "dtype": "float16", "shape": [8192, 11008], "min": -64800.0, "max": 65504.0,
         "min_abs": 5.96e-08, "zeros": 1027, "negatives": 45093117, "nan": 0, "inf": 0},
        {"arg": "arg2", "dtype": "torch.bfloat16", "shape": [11008, 4096], "min": -0.125, "max": 0.1211,
         "min_abs": 1.788e-07, "zeros": 12, "negatives": 22544391, "nan": 0, "inf": 0},
    ]
    return Incident(
        step=123456, kind="nonfinite_grad", phase="backward", op="aten.addmm.default",
        module="model.layers.31.mlp.down_proj", source=LIBRARY_SOURCE, rank=3, cause="precision_overflow",
        summary=summary, fix=fix, action="rolled_back", transient=False, input_stats=stats,
    )


def root_log() -> Incident:
    summary, fix = explain("log_nonpositive", "aten.log.default", module="", detail="95 zeros and 0 negatives in its input")
    return Incident(
        step=30, kind="nonfinite_loss", phase="forward", op="aten.log.default", module="", source="train.py:19",
        rank=0, cause="log_nonpositive", summary=summary, fix=fix, action="skipped", transient=None,
        input_stats=[{"arg": "arg0", "dtype": "float32", "shape": [32, 4], "min": 0.0, "max": 1.0, "min_abs": 0.0,
                      "zeros": 95, "negatives": 0, "nan": 0, "inf": 0}],
        chain=[{"op": "aten.log.default", "module": ""}],
    )


@pytest.fixture
def in_project(tmp_path, monkeypatch):
    """A working directory holding the user's ``model.py`` (so the panel shows its lines)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.py").write_text(MODEL_PY)
    return tmp_path


@pytest.mark.parametrize("width", [80, 120])
def test_the_panel_snapshot(in_project, width):
    assert incident_text(masked_softmax(), width=width) == snapshot(f"panel_masked_softmax_{width}.txt",
                                                                     incident_text(masked_softmax(), width=width))


@pytest.mark.parametrize("width", [80, 120])
def test_the_panel_of_a_library_overflow_snapshot(in_project, width):
    text = incident_text(library_overflow(), width=width)
    assert text == snapshot(f"panel_library_overflow_{width}.txt", text)


def test_the_root_module_is_named_and_the_panel_needs_no_source_file(in_project):
    text = incident_text(root_log(), width=80)
    assert text == snapshot("panel_root_log_80.txt", text)
    assert "│ module     '' (the watched model itself)" in text


CELLS = re.compile(r"[-\w.|+\[\], ]+")


@pytest.mark.parametrize("make", [masked_softmax, library_overflow, root_log])
@pytest.mark.parametrize("width", range(80, 161, 9))
def test_no_value_is_ever_cut(in_project, make, width):
    """At every width from 80 columns up: no ellipsis, and every statistic, dtype, shape and
    the op appear whole on one line; a path longer than its column is folded, never cut."""
    incident = make()
    text = incident_text(incident, width=width)
    assert "…" not in text
    assert all(len(line) == width for line in text.splitlines())
    lines = text.splitlines()
    for stats in incident.input_stats:
        view = InputStats([stats])
        for cell in [stats["dtype"], *view.cells[0]]:
            assert any(cell in line for line in lines), (cell, width)
    assert any(incident.op in line for line in lines)
    inner = "".join(line[1:-1].strip().removeprefix("source").strip() for line in lines if "│" in line)
    assert display_path(incident.source) in inner  # whole once the folded lines are joined


def test_the_statistics_turn_into_columns_when_a_row_would_not_fit(in_project):
    text = incident_text(library_overflow(), width=80)
    assert "│ inputs of the origin op" in text
    assert re.search(r"│ shape\s+\[11008\]\s+\[8192, 11008\]\s+\[11008, 4096\]", text)
    assert re.search(r"│ dtype\s+float16\s+float16\s+torch.bfloat16", text)
    assert re.search(r"│ max\s+0.0297\s+65504\s+0.1211", text)  # the float16 maximum, whole


def test_paths_under_the_working_directory_are_shown_relative(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert display_path(f"{tmp_path}/src/train.py:42") == "src/train.py:42"
    assert display_path("relative/train.py:7") == "relative/train.py:7"
    assert display_path(LIBRARY_SOURCE) == LIBRARY_SOURCE  # outside the working directory: kept whole
    assert display_path(str(tmp_path / "runs" / "x")) == "runs/x"


def test_the_snippet_holds_only_lines_of_the_file(in_project):
    # line 6 with two lines of context; lines 8-9 are blank and say nothing: dropped, no trailing newline
    path, line, code = source_snippet("model.py:6")
    assert (path, line) == ("model.py", 6)
    assert code.splitlines() == MODEL_PY.splitlines()[3:7]
    assert not code.endswith("\n")
    # the last lines of a file: nothing is invented after them
    _, _, tail = source_snippet("model.py:11")
    assert tail.splitlines() == ["", "def unrelated():", "    pass"]
