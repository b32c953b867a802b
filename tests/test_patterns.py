"""The pattern library (nantrace.diagnosis.patterns): every entry formats, every cause code
has an entry, and explain() gives the op-specific text where one exists, keyed by the ATen
names that the tracer actually reports."""

from __future__ import annotations

import string

import pytest

from nantrace.diagnosis.patterns import PATTERNS, explain, lookup, short_op
from nantrace.incident import CAUSES

FIELDS = {"op", "where", "dtype", "detail", "max"}


def _fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: f"{p.cause}:{'/'.join(p.ops) or '*'}")
def test_every_entry_formats(pattern) -> None:
    assert pattern.cause in CAUSES
    assert _fields(pattern.summary) <= FIELDS and _fields(pattern.fix) <= FIELDS
    op = f"aten.{pattern.ops[0]}.default" if pattern.ops else "aten.some_op.default"
    for module in (None, "", "encoder.layers.1.attn"):
        summary, fix = explain(pattern.cause, op, module=module, dtype="float16", detail="3 zeros", max_value="65504")
        for text in (summary, fix):
            assert text and "{" not in text and "}" not in text
    summary, fix = explain(pattern.cause)  # before localisation: no op, no module
    assert summary and fix and "{" not in summary + fix


@pytest.mark.parametrize("cause", CAUSES)
def test_every_cause_has_exactly_one_generic_entry(cause: str) -> None:
    generic = [p for p in PATTERNS if p.cause == cause and not p.ops]
    assert len(generic) == 1
    assert lookup(cause) is generic[0]
    assert lookup(cause, "aten.no_such_op.default") is generic[0]


def test_unknown_cause_is_an_error() -> None:
    with pytest.raises(KeyError):
        lookup("not_a_cause")


def test_every_op_specific_entry_is_reachable() -> None:
    for p in PATTERNS:
        for op in p.ops:
            found = lookup(p.cause, f"aten.{op}.default")
            assert op in found.ops and found.cause == p.cause  # this entry, or an earlier one for the same op


@pytest.mark.parametrize(("cause", "op", "needle"), [
    # the ATen names the dispatch-level tracer reports, not the Python API names
    ("label_out_of_range", "aten.nll_loss_forward.default", "0/0"),
    ("label_out_of_range", "aten.nll_loss2d_forward.default", "0/0"),
    ("log_nonpositive", "aten._log_softmax.default", "log_softmax on finite logits"),
    ("div_by_zero", "aten.rsqrt.default", "torch.rsqrt(x + eps)"),
    ("div_by_zero", "aten.div.Tensor", "A division by zero"),
    ("sqrt_negative", "aten.pow.Tensor_Scalar", "fractional power"),
    ("grad_singularity", "aten.acos.default", "±1"),
    ("grad_singularity", "aten.asin.default", "±1"),
    ("grad_singularity", "aten.pow.Tensor_Scalar", "p < 1"),
    ("grad_singularity", "aten.atan2.default", "atan2(0, 0)"),
    ("grad_singularity", "aten.sqrt.default", "torch.sqrt(x + eps)"),
    ("grad_singularity", "aten.linalg_vector_norm.default", "torch.sqrt(x + eps)"),
    ("exp_overflow", "aten.exp.default", "Subtract the maximum"),
    ("exp_overflow", "aten.pow.Tensor_Tensor", "power overflowed"),
    ("precision_overflow", "aten.bmm.default", "bfloat16 instead of float16"),
    ("precision_overflow", "aten.addmm.default", "bfloat16 instead of float16"),
])
def test_explain_gives_op_specific_text(cause: str, op: str, needle: str) -> None:
    summary, fix = explain(cause, op, module="attn", dtype="float16", detail="x", max_value="65504")
    assert needle in summary + " " + fix
    generic = lookup(cause)
    assert (summary, fix) != (generic.summary, generic.fix)
    assert lookup(cause, op) is not generic


def test_explain_names_where_the_op_ran() -> None:
    assert "in module 'encoder.attn'" in explain("log_nonpositive", "aten.log.default", module="encoder.attn")[0]
    assert "top-level forward" in explain("log_nonpositive", "aten.log.default", module="")[0]
    assert "loss function" in explain("log_nonpositive", "aten.log.default", module=None)[0]
    assert "module" not in explain("log_nonpositive", None, module=None)[0]
    summary, fix = explain("log_nonpositive", "aten.log.default", detail="2 zeros")
    assert summary.startswith("log of an argument") and "(2 zeros)" in summary
    assert "x.clamp_min(torch.finfo(x.dtype).tiny).log()" in fix


@pytest.mark.parametrize(("op", "short"), [
    ("aten.log.default", "log"),
    ("aten.sqrt_.default", "sqrt"),
    ("aten._softmax.default", "_softmax"),
    ("aten.nll_loss_forward.default", "nll_loss_forward"),
    ("aten.pow.Tensor_Scalar", "pow"),
    (None, ""),
    ("", ""),
])
def test_short_op(op: str | None, short: str) -> None:
    assert short_op(op) == short
