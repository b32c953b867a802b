"""Gradient check for custom autograd Functions, with a message that names the bug.

`torch.autograd.gradcheck` says "Jacobian mismatch for output 0 with respect to input 1"
and prints two matrices. `check_gradients` computes the same two Jacobians (autograd's
and central differences in float64) and says which (output, input) pair disagrees, at
which element, by how much, and what the pattern suggests: no gradient returned, a
constant factor, the wrong sign, gradients in the wrong order, grad_output ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .issues import jsonable

__all__ = ["GradcheckReport", "GradientMismatch", "check_gradients"]


@dataclass
class GradientMismatch:
    """One (output, input) pair whose analytic and numerical derivatives disagree."""

    output_index: int
    input_index: int
    output_element: tuple[int, ...]
    input_element: tuple[int, ...]
    analytic: float
    numerical: float
    max_abs_error: float
    max_rel_error: float
    num_bad: int
    explanation: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return jsonable(self.__dict__)


@dataclass
class GradcheckReport:
    """Result of `check_gradients`: `ok` when every pair agrees and everything is finite."""

    function: str
    mismatches: list[GradientMismatch] = field(default_factory=list)
    nonfinite: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    checked_pairs: list[tuple[int, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.nonfinite and self.error is None

    @property
    def summary(self) -> str:
        if self.error is not None:
            return f"gradient check of {self.function} failed to run: {self.error}"
        if self.ok:
            return (f"gradients of {self.function} agree with finite differences "
                    f"({len(self.checked_pairs)} (output, input) pair(s) checked)")
        lines = [m.message for m in self.mismatches]
        for nf in self.nonfinite[:5]:
            lines.append(f"d output[{nf['output_index']}] / d input[{nf['input_index']}] at output element "
                         f"{tuple(nf['output_element'])}, input element {tuple(nf['input_element'])} is "
                         f"{nf['value']} (non-finite analytic gradient)")
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        """Raise AssertionError with the summary when the check failed."""
        if not self.ok:
            raise AssertionError(self.summary)

    def to_dict(self) -> dict[str, Any]:
        return {"function": self.function, "ok": self.ok, "error": self.error,
                "mismatches": [m.to_dict() for m in self.mismatches],
                "nonfinite": jsonable(self.nonfinite), "checked_pairs": [list(p) for p in self.checked_pairs],
                "summary": self.summary}

    def __str__(self) -> str:
        return self.summary


def _resolve(fn: Any) -> tuple[Callable[..., Any], str]:
    if isinstance(fn, type) and issubclass(fn, torch.autograd.Function):
        return fn.apply, fn.__name__
    if not callable(fn):
        raise TypeError(f"fn must be a torch.autograd.Function subclass or a callable; got {fn!r}")
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, type) and issubclass(owner, torch.autograd.Function):
        return fn, owner.__name__
    return fn, getattr(fn, "__qualname__", type(fn).__name__)


def _outputs(out: Any) -> list[tuple[int, torch.Tensor]]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [(k, o) for k, o in enumerate(items) if isinstance(o, torch.Tensor) and o.is_floating_point()]


def _unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size)
        flat //= size
    return tuple(reversed(idx))


def _num(x: float) -> str:
    if not math.isfinite(x):
        return {math.inf: "inf", -math.inf: "-inf"}.get(x, "nan")
    return f"{x:.6g}"


def _explain(
    a: torch.Tensor, n: torch.Tensor, o: int, i: int, none_returned: bool,
    numeric: dict[tuple[int, int], torch.Tensor], atol: float, rtol: float,
) -> str:
    """What the pattern of the analytic block `a` against the numerical block `n` suggests."""
    close = lambda x, y: bool(torch.allclose(x, y, atol=atol, rtol=rtol))  # noqa: E731
    n_zero = bool((n.abs() <= atol).all())
    a_zero = bool((a.abs() <= atol).all())
    if none_returned and not n_zero:
        return f"returns no gradient (None) for input {i}"
    if a_zero and not n_zero:
        return f"returns a zero gradient for input {i}"
    if n_zero and not a_zero:
        return f"returns a gradient for input {i} although output {o} does not depend on it"
    for (oo, j), nj in numeric.items():
        if oo == o and j != i and nj.shape == a.shape and not bool((nj.abs() <= atol).all()) and close(a, nj):
            return f"returns the gradient of input {j} in the slot of input {i} (gradients in the wrong order)"
    denom = float((n * n).sum())
    if denom > 0:
        c = float((a * n).sum()) / denom
        if abs(c - 1) > rtol and close(a, c * n):
            if abs(c + 1) <= 1e-3:
                return "returns the gradient with the wrong sign"
            ratio = f"{c:.4g}" if abs(c) >= 1 else f"1/{1 / c:.4g}" if c != 0 else "0"
            return (f"returns {ratio} times the true gradient for input {i} "
                    f"(a constant factor is missing or extra)")
    if a.shape[0] > 1 and bool((a == a[:1]).all()) and not bool((n == n[:1]).all()):
        return "ignores grad_output (every output element gets the same gradient)"
    return f"computes a gradient for input {i} that disagrees with the forward"


def check_gradients(
    fn: Any,
    *inputs: Any,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
) -> GradcheckReport:
    """Compare the backward of `fn` with central differences, in float64, pair by pair.

    `fn` is a `torch.autograd.Function` subclass (its ``apply`` is called) or any
    callable. Floating-point tensor inputs are copied to float64 and differentiated;
    everything else is passed through unchanged. Every floating output is checked
    against every differentiated input. An entry disagrees when
    ``|analytic - numerical| > atol + rtol * |numerical|``; non-finite analytic entries
    are reported separately. Cost: one backward per output element and two forwards per
    input element, so keep the inputs small (a few hundred elements).
    """
    call, name = _resolve(fn)
    if not (eps > 0 and atol >= 0 and rtol >= 0):
        raise ValueError(f"need eps > 0, atol >= 0, rtol >= 0; got eps={eps}, atol={atol}, rtol={rtol}")
    args: list[Any] = []
    diff: list[int] = []
    for k, x in enumerate(inputs):
        if isinstance(x, torch.Tensor) and x.is_complex():
            raise TypeError(f"input {k} is complex; check_gradients handles real tensors only")
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            args.append(x.detach().to(torch.float64).clone().requires_grad_(True))
            diff.append(k)
        else:
            args.append(x)
    report = GradcheckReport(function=name)
    if not diff:
        raise ValueError("check_gradients needs at least one floating-point tensor input")

    try:
        outs = _outputs(call(*args))
    except Exception as exc:
        report.error = f"forward raised {type(exc).__name__}: {exc}"
        return report
    if not outs:
        raise ValueError(f"{name} returned no floating-point tensor output")

    # analytic Jacobians: one backward per output element (grad_output = one-hot)
    analytic: dict[tuple[int, int], torch.Tensor] = {}
    none_for: dict[tuple[int, int], bool] = {}
    try:
        for o, out in outs:
            rows = {i: torch.zeros(out.numel(), args[i].numel(), dtype=torch.float64) for i in diff}
            nones = {i: True for i in diff}
            if out.requires_grad:
                for k in range(out.numel()):
                    g = torch.zeros_like(out)
                    g.view(-1)[k] = 1.0
                    grads = torch.autograd.grad([out], [args[i] for i in diff], grad_outputs=[g],
                                                retain_graph=True, allow_unused=True)
                    for i, gi in zip(diff, grads):
                        if gi is not None:
                            nones[i] = False
                            rows[i][k] = gi.detach().reshape(-1).to(torch.float64)
            for i in diff:
                analytic[(o, i)] = rows[i]
                none_for[(o, i)] = nones[i]
    except Exception as exc:
        report.error = f"backward raised {type(exc).__name__}: {exc}"
        return report

    # numerical Jacobians: central differences
    numeric: dict[tuple[int, int], torch.Tensor] = {}
    with torch.no_grad():
        for i in diff:
            x = args[i].detach()  # shares storage with the leaf
            flat = x.view(-1)
            cols = {o: torch.zeros(out.numel(), flat.numel(), dtype=torch.float64) for o, out in outs}
            for e in range(flat.numel()):
                orig = float(flat[e])
                flat[e] = orig + eps
                plus = {o: t.detach().reshape(-1).to(torch.float64).clone() for o, t in _outputs(call(*args))}
                flat[e] = orig - eps
                minus = {o: t.detach().reshape(-1).to(torch.float64).clone() for o, t in _outputs(call(*args))}
                flat[e] = orig
                for o, _ in outs:
                    cols[o][:, e] = (plus[o] - minus[o]) / (2 * eps)
            for o, _ in outs:
                numeric[(o, i)] = cols[o]

    shapes_out = {o: out.shape for o, out in outs}
    for (o, i), a in analytic.items():
        n = numeric[(o, i)]
        report.checked_pairs.append((o, i))
        finite = torch.isfinite(a)
        if not bool(finite.all()):
            for k, e in (~finite).nonzero().tolist()[:20]:
                report.nonfinite.append({"output_index": o, "input_index": i,
                                         "output_element": list(_unravel(k, shapes_out[o])),
                                         "input_element": list(_unravel(e, args[i].shape)),
                                         "value": _num(float(a[k, e]))})
        n_ok = torch.isfinite(n)
        err = (a - n).abs()
        tol = atol + rtol * n.abs()
        bad = (err > tol) & finite & n_ok
        if not bool(bad.any()):
            continue
        masked = torch.where(bad, err, torch.zeros_like(err))
        flat_at = int(masked.argmax())
        k, e = divmod(flat_at, a.shape[1])
        rel = torch.where(bad, err / n.abs().clamp_min(1e-12), torch.zeros_like(err))
        out_el = _unravel(k, shapes_out[o])
        in_el = _unravel(e, args[i].shape)
        av, nv = float(a[k, e]), float(n[k, e])
        explanation = _explain(torch.where(finite, a, 0.0), torch.where(n_ok, n, 0.0), o, i,
                               none_for[(o, i)], numeric, atol, rtol)
        where = (f"at element {in_el}" if out_el == in_el and shapes_out[o] == args[i].shape
                 else f"at output element {out_el}, input element {in_el}")
        message = (f"d output[{o}] / d input[{i}] {where}: analytic {_num(av)}, numerical {_num(nv)} "
                   f"(abs error {_num(float(err[k, e]))}, {int(bad.sum())} of {bad.numel()} entries "
                   f"disagree): the backward of {name} {explanation}")
        report.mismatches.append(GradientMismatch(
            output_index=o, input_index=i, output_element=out_el, input_element=in_el,
            analytic=av, numerical=nv, max_abs_error=float(err[k, e]), max_rel_error=float(rel.max()),
            num_bad=int(bad.sum()), explanation=explanation, message=message,
        ))
    return report
