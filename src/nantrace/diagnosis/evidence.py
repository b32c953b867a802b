"""Positional evidence: the very elements that went bad, and the operands that made them.

A cause is a claim about values, so it is checked on values: the output elements of the
origin op that are non-finite, the input elements that produced them (gathered, in
float64), the op re-run in float64 on the same inputs (an overflow of the dtype's range
versus a genuine math error), and, for a backward origin, the derivative evaluated in
float64 at the forward inputs (a singularity versus a gradient that was merely huge).
Nothing here runs unless an incident is being diagnosed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from ..localisation.tracer import dense

F64 = torch.float64


def as_float64(obj: Any) -> Any:
    """A copy of a structure of arguments with every floating tensor detached in float64."""
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            x = x.detach()
            return x.to(F64) if x.is_floating_point() else x.clone()
        return x

    return tree_map(cast, obj)


def floating_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


@dataclasses.dataclass
class Recompute:
    """The origin op re-run in float64 on float64 copies of its inputs."""

    value: torch.Tensor | None
    """The first floating output in float64, or ``None`` when the re-run was impossible."""
    error: str | None = None

    def at(self, mask: torch.Tensor) -> torch.Tensor | None:
        if self.value is None or self.value.shape != mask.shape:
            return None
        return self.value[mask]


def recompute(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Recompute:
    """Run ``func`` again in float64; dtype arguments that would force a low precision are dropped."""
    if func is None:
        return Recompute(None, "the op was not kept")
    a, k = as_float64(args), as_float64(kwargs)
    k = {key: (F64 if isinstance(v, torch.dtype) and v.is_floating_point else v) for key, v in k.items()}
    try:
        with torch.no_grad():
            out = func(*a, **k)
    except Exception as exc:  # some kernels have no float64 variant or insist on a dtype
        if "half_to_float" in str(exc) or (len(a) > 2 and a[2] is True):
            try:
                with torch.no_grad():
                    out = func(*a[:2], False, *a[3:], **k)
            except Exception as exc2:
                return Recompute(None, f"{type(exc2).__name__}: {exc2}")
        else:
            return Recompute(None, f"{type(exc).__name__}: {exc}")
    outs = floating_outputs(out)
    if not outs:
        return Recompute(None, "no floating output")
    return Recompute(dense(outs[0]).to(F64))  # a nested output padded, as the record keeps it


def operands_at(args: tuple[Any, ...], kwargs: dict[str, Any], shape: torch.Size, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """For an elementwise op: each operand's values (float64) at the bad output positions.

    A plain-number operand (``aten.pow.Scalar``'s base in ``theta ** t``, ``torch.div(2.0, t)``'s numerator,
    ``rsub``'s ``1``, ``xlogy.Scalar_Self``'s ``x``) is an operand too: it is read as a 0-dim float64 value
    broadcast to the output's shape, so that every rule reading ``arg0``/``arg1`` sees it where a tensor would
    stand (``0.0 ** negative`` is a division by zero). Booleans are flags, not values, and are left out.
    Operands that do not broadcast to the output's shape (reductions, matmuls, norms) are left out; their
    evidence is gathered by the rule of their family.
    """
    out: dict[str, torch.Tensor] = {}
    named = [(f"arg{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    for name, value in named:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = torch.tensor(float(value), dtype=F64, device=mask.device)
                out[name] = torch.broadcast_to(number, shape)[mask]
            except (RuntimeError, OverflowError):
                pass
            continue
        if not isinstance(value, torch.Tensor) or value.is_complex():
            continue
        try:
            full = torch.broadcast_to(dense(value.detach()), shape)
        except RuntimeError:
            continue
        vals = full[mask]
        out[name] = vals.to(F64) if vals.is_floating_point() or vals.dtype == torch.bool else vals.to(F64)
    return out


def bad_mask(t: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(t.detach())


@dataclasses.dataclass
class Derivative:
    """The derivative of a forward op, in float64, at the inputs it ran on."""

    grads: list[tuple[str, torch.Tensor, torch.Tensor]]
    """(argument, input in float64, d(sum of output)/d(input) in float64) for each floating input."""
    error: str | None = None

    @property
    def nonfinite(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """(argument, input values, derivative values) where the derivative is not finite."""
        out = []
        for name, x, g in self.grads:
            bad = ~torch.isfinite(g)
            if bool(bad.any()):
                out.append((name, x[bad] if x.shape == g.shape else x.flatten(), g[bad]))
        return out


_ALL_OUTPUTS = frozenset({"_linalg_eigh", "linalg_eigh", "linalg_eig", "_linalg_svd", "linalg_svd", "svd", "linalg_qr",
                          "_linalg_slogdet", "linalg_slogdet", "slogdet", "linalg_lu", "lu_unpack", "linalg_lu_factor_ex"})
"""Decompositions whose every output is a result the loss may use (eigenvectors, singular vectors): their
derivative is taken through all of them. Their derivative can be infinite through one output alone (the
eigenvectors at a repeated eigenvalue) while the first output's (the eigenvalues') is finite."""


def derivative(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Derivative:
    """d(sum of the first output)/d(each floating input), evaluated in float64 (of the sum of every
    floating output for the decompositions in :data:`_ALL_OUTPUTS`)."""
    if func is None:
        return Derivative([], "the forward op was not kept")
    leaves: list[tuple[str, torch.Tensor]] = []

    def lift(name: str, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            leaf = x.detach().to(F64).requires_grad_(True)
            leaves.append((name, leaf))
            return leaf
        if isinstance(x, torch.Tensor):
            return x.detach()
        return x

    a = tuple(lift(f"arg{i}", x) for i, x in enumerate(args))
    k = {key: lift(key, v) for key, v in kwargs.items()}
    k = {key: (F64 if isinstance(v, torch.dtype) and v.is_floating_point else v) for key, v in k.items()}
    try:
        with torch.enable_grad():
            out = func(*a, **k)
            outs = [o for o in floating_outputs(out) if o.requires_grad]
            name = getattr(getattr(func, "_schema", None), "name", "").split("::")[-1]
            outs = outs if name in _ALL_OUTPUTS else outs[:1]
            if not outs or not leaves:
                return Derivative([], "no differentiable output")
            grads = torch.autograd.grad(outs, [leaf for _, leaf in leaves], grad_outputs=[torch.ones_like(o) for o in outs],
                                        allow_unused=True)
    except Exception as exc:
        return Derivative([], f"{type(exc).__name__}: {exc}")
    return Derivative([(name, leaf.detach(), g.detach()) for (name, leaf), g in zip(leaves, grads) if g is not None])


def count(values: torch.Tensor, predicate: Any) -> int:
    return int(predicate(values).sum()) if values.numel() else 0


def fmt(x: float) -> str:
    return f"{x:.4g}"
