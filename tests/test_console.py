"""The printed diagnosis, compared whole against an expected rendering (snapshot)."""

from __future__ import annotations

from nantrace.console import incident_text
from nantrace.incident import Incident

EXPECTED = """\
╭─ nantrace · step 812 · nonfinite_loss · skipped ─────────────────────────────────────────────────╮
│ what       log of an argument outside its domain in module 'head' (3 zeros and 0 negatives in    │
│            its input).                                                                           │
│ phase      forward                                                                               │
│ op         aten.log.default                                                                      │
│ module     'head'                                                                                │
│ source     train.py:42                                                                           │
│ cause      log_nonpositive                                                                       │
│ transient  no: reproduced on re-run                                                              │
│ inputs of the origin op                                                                          │
│ arg  ┃ dtype   ┃  shape ┃ min ┃ max ┃ min|x| ┃ zeros ┃ neg ┃ nan ┃ inf                           │
│ ━━━━━╇━━━━━━━━━╇━━━━━━━━╇━━━━━╇━━━━━╇━━━━━━━━╇━━━━━━━╇━━━━━╇━━━━━╇━━━━                           │
│ arg0 │ float32 │ [4, 3] │   0 │ 0.9 │      0 │     3 │   0 │   0 │   0                           │
│ chain  aten.log.default [head] → aten.mean.default                                               │
│ fix  Clamp the argument first, e.g. x.clamp_min(torch.finfo(x.dtype).tiny).log() or log(x +      │
│ eps); for log of probabilities use log_softmax / F.logsigmoid instead of log(softmax(...)) /     │
│ log(sigmoid(...)).                                                                               │
╰──────────────────────────────────────────────────────────────────────────────────────────────────╯
"""


def test_printed_diagnosis_snapshot():
    from nantrace.diagnosis.patterns import explain

    summary, fix = explain("log_nonpositive", "aten.log.default", module="head", detail="3 zeros and 0 negatives in its input")
    incident = Incident(
        step=812, kind="nonfinite_loss", phase="forward", op="aten.log.default", module="head", source="train.py:42",
        rank=0, cause="log_nonpositive", summary=summary, fix=fix, action="skipped", transient=False,
        input_stats=[{"arg": "arg0", "dtype": "float32", "shape": [4, 3], "min": 0.0, "max": 0.9, "min_abs": 0.0,
                      "zeros": 3, "negatives": 0, "nan": 0, "inf": 0}],
        chain=[{"op": "aten.log.default", "module": "head"}, {"op": "aten.mean.default", "module": None}],
    )
    assert incident_text(incident, width=100) == EXPECTED
