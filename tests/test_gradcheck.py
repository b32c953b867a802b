"""Gradient check for custom autograd Functions (nantrace.data.check_gradients)."""

from __future__ import annotations

import json

import pytest
import torch

from nantrace.data import check_gradients

A = torch.arange(12.0).reshape(3, 4) / 4 + 0.5  # largest entry at (2, 3)
B = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class SquareForgetsFactor(Square):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return x * g


class SquareWrongSign(Square):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return -2 * x * g


class SquareIgnoresGradOutput(Square):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x  # grad_output is never multiplied in


class Mul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, g * a


class MulSwapped(Mul):
    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * a, g * b


class MulForgetsB(Mul):
    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, None


class TwoOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, g0, g1):
        return 2 * g0 + 2 * g1  # should be 2 * g0 + 3 * g1


class TwoOutputsCorrect(TwoOutputs):
    @staticmethod
    def backward(ctx, g0, g1):
        return 2 * g0 + 3 * g1


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k: int):
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


class Sqrt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.sqrt()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g / (2 * y)


class TooFewGrads(Mul):
    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b  # one gradient for two inputs


@pytest.mark.parametrize("fn, inputs", [
    (Square, (A,)),
    (Mul, (A, B)),
    (Scale, (A, 3)),
    (TwoOutputsCorrect, (B,)),
    (lambda x, y: (x.exp() * y).sum(dim=1), (B, A)),
])
def test_correct_gradients_pass(fn, inputs):
    report = check_gradients(fn, *inputs)
    assert report.ok, report.summary
    assert report.mismatches == [] and report.nonfinite == [] and report.error is None


WRONG = [
    pytest.param(SquareForgetsFactor, (A,), (0, 0), (2, 3), "returns 1/2 times the true gradient for input 0 (a constant factor is missing or extra)",
                 id="missing-factor-2"),
    pytest.param(SquareWrongSign, (A,), (0, 0), (2, 3), "returns the gradient with the wrong sign", id="wrong-sign"),
    pytest.param(MulForgetsB, (A, B), (0, 1), (2, 3), "returns no gradient (None) for input 1", id="returns-none"),
    pytest.param(MulSwapped, (A, B), (0, 0), (2, 3),
                 "returns the gradient of input 1 in the slot of input 0 (gradients in the wrong order)",
                 id="swapped"),
    pytest.param(TwoOutputs, (A,), (1, 0), None,
                 "returns 1/1.5 times the true gradient for input 0 (a constant factor is missing or extra)",
                 id="second-output"),
    pytest.param(SquareIgnoresGradOutput, (A,), (0, 0), None,
                 "ignores grad_output (every output element gets the same gradient)", id="ignores-grad-output"),
]


@pytest.mark.parametrize("fn, inputs, pair, element, explanation", WRONG)
def test_wrong_backward_is_named(fn, inputs, pair, element, explanation):
    report = check_gradients(fn, *inputs)
    assert not report.ok
    first = report.mismatches[0]
    assert (first.output_index, first.input_index) == pair
    assert first.explanation == explanation
    if element is not None:
        assert first.input_element == element and first.output_element == element
        assert f"at element {element}" in first.message
    assert first.message.startswith(f"d output[{pair[0]}] / d input[{pair[1]}]")
    assert f"the backward of {fn.__name__} {explanation}" in first.message
    json.dumps(report.to_dict(), allow_nan=False)


def test_returns_none_message_reads_like_the_docs():
    report = check_gradients(MulForgetsB, A, B)
    assert [(m.output_index, m.input_index) for m in report.mismatches] == [(0, 1)]
    m = report.mismatches[0]
    assert m.analytic == 0.0 and m.numerical == pytest.approx(3.25, rel=1e-6)
    assert m.message.startswith("d output[0] / d input[1] at element (2, 3): analytic 0, numerical 3.25 ")
    assert m.message.endswith("the backward of MulForgetsB returns no gradient (None) for input 1")
    assert m.num_bad == 12  # every diagonal entry d out[i] / d b[i] = a[i] is missing


def test_swapped_reports_both_inputs():
    report = check_gradients(MulSwapped, A, B)
    assert [(m.output_index, m.input_index) for m in report.mismatches] == [(0, 0), (0, 1)]
    assert "input 0 in the slot of input 1" in report.mismatches[1].explanation


def test_nonfinite_analytic_gradient():
    x = torch.tensor([0.0, 1.0, 4.0])
    report = check_gradients(Sqrt, x)
    assert not report.ok and report.mismatches == []
    # d y0/dx0 is +inf; the other rows divide grad_output 0 by 2*sqrt(0): NaN
    assert report.nonfinite == [
        {"output_index": 0, "input_index": 0, "output_element": [k], "input_element": [0], "value": v}
        for k, v in ((0, "inf"), (1, "nan"), (2, "nan"))]
    assert "non-finite analytic gradient" in report.summary


def test_backward_error_is_reported_not_raised():
    report = check_gradients(TooFewGrads, A, B)
    assert not report.ok
    assert report.error.startswith("backward raised RuntimeError")
    assert "incorrect number of gradients" in report.error


def test_inputs_are_not_modified_and_run_in_float64():
    x = A.clone()
    seen = []

    def fn(t):
        seen.append(t.dtype)
        return t * 2

    assert check_gradients(fn, x).ok
    assert set(seen) == {torch.float64}
    assert torch.equal(x, A) and x.dtype == torch.float32


@pytest.mark.parametrize("args, exc, words", [
    ((42, A), TypeError, ["Function", "42"]),
    ((Square, torch.ones(2, dtype=torch.long)), ValueError, ["floating-point tensor input"]),
    ((Square, torch.ones(2, dtype=torch.complex64)), TypeError, ["complex"]),
])
def test_bad_arguments(args, exc, words):
    with pytest.raises(exc) as info:
        check_gradients(*args)
    assert all(w in str(info.value) for w in words), str(info.value)
