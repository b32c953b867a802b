"""When can an optimizer update be trusted to stay finite without checking it?

Checking every update after the fact (and undoing a bad one) needs a copy of the weights and
the optimizer state before the update: a memory pass as large as the optimizer's own, every
step. For the optimizers whose update rule we know, an interval bound proves the update finite
from figures the step's one check has already read (the global gradient and parameter norms,
each an upper bound of every element) and a running bound of the optimizer state. Only updates
that are not proven are copied and checked (:mod:`nantrace.response.update_check`).

The bound covers exactly ``torch.optim.SGD``, ``Adam`` and ``AdamW`` (not subclasses: they may
override ``step``) with float32/float64 parameters. Everything else (custom optimizers, LARS,
LAMB, NAdam, float16/bfloat16 state, eps that the state's dtype cannot hold, state loaded from
elsewhere) is "not proven" and gets checked.

Usage::

    bound = StateBound.for_optimizer(optimizer)          # 0.0, or None if state already exists
    reason = update_risk(optimizer, group, grad=9.1, param=120.0, state=bound.value)
    # None: this group's update cannot create NaN/Inf; else a sentence saying why it might
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

__all__ = ["StateBound", "next_state_bound", "param_bound_after", "update_folds_params", "update_risk"]

_MARGIN = 16.0
"""Bounds must stay below ``finfo.max / _MARGIN``: room for the rounding of every op of the update."""

_ADAM = (torch.optim.Adam, torch.optim.AdamW)
_SAFE_DTYPES = (torch.float32, torch.float64)
_DTYPE = operator.attrgetter("dtype")
_LAYOUT = operator.attrgetter("layout")


class StateBound:
    """An upper bound of every element of an optimizer's state (for second moments, of their
    square roots); ``None`` when unknown (state that existed before watching, or was loaded)."""

    def __init__(self, value: float | None) -> None:
        self.value = value

    @classmethod
    def for_optimizer(cls, optimizer: torch.optim.Optimizer) -> "StateBound":
        """The bound of the state as ``watch()`` finds it: 0 for a fresh optimizer; for state that
        already exists (watching from the middle of a run) measured once, here, outside any step,
        so the first watched step needs no copy; unknown when it cannot be measured or is not finite."""
        tensors = [v for s in optimizer.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0 and v.is_floating_point()]
        if not tensors:
            return cls(0.0)
        try:
            norms = [float(n) for n in torch._foreach_norm([t.detach().double() for t in tensors])]
        except (RuntimeError, TypeError):  # sharded or exotic state: the first update is checked instead
            return cls(None)
        if not all(math.isfinite(n) for n in norms):
            return cls(None)
        bound = cls(None)
        bound.from_norms(norms)
        return bound

    def from_norms(self, norms: list[float]) -> None:
        """Seed the bound from measured L2 norms of state tensors (``max(n, √n)`` bounds both an
        element and the square root of a second-moment element)."""
        self.value = max([max(n, math.sqrt(n)) for n in norms if math.isfinite(n)], default=0.0)


def _number(x: Any) -> float | None:
    """A hyper-parameter as a float, ``None`` if it is a device tensor (reading it would sync)."""
    if isinstance(x, torch.Tensor):
        return float(x) if x.device.type == "cpu" and x.numel() == 1 else None
    if isinstance(x, (int, float)):
        return float(x)
    return None


def _dtype_problem(group: dict[str, Any]) -> tuple[str | None, torch.dtype]:
    params = group["params"]
    dtypes = set(map(_DTYPE, params))  # C-level scans: this runs before every update
    bad = [d for d in dtypes if d not in _SAFE_DTYPES]  # complex dtypes are not safe either
    if bad:
        return f"{str(bad[0]).removeprefix('torch.')} parameters and state", bad[0]
    if set(map(_LAYOUT, params)) - {torch.strided}:
        return "sparse or complex parameters", torch.float32
    return None, min(dtypes, key=lambda d: torch.finfo(d).max) if dtypes else torch.float32


def update_risk(optimizer: torch.optim.Optimizer, group: dict[str, Any], *, grad: float | None,
                param: float | None, state: float | None) -> str | None:
    """Why the update of ``group`` might create a non-finite value; ``None`` when it cannot.

    ``grad`` and ``param`` bound every gradient and parameter element of this step (the global
    L2 norms), ``state`` every optimizer-state element (:class:`StateBound`).
    """
    found = _analyse(optimizer, group, grad=grad, param=param, state=state)
    return found if isinstance(found, str) else None


def param_bound_after(optimizer: torch.optim.Optimizer, group: dict[str, Any], *, grad: float | None,
                      param: float | None, state: float | None) -> float | None:
    """An upper bound of every parameter element of ``group`` after its update, from the same interval
    arithmetic as :func:`update_risk` (``None`` when the update is not proven): what lets the next step
    trust its parameters without reading them (:mod:`nantrace.detection.param_provenance`)."""
    found = _analyse(optimizer, group, grad=grad, param=param, state=state)
    return None if isinstance(found, str) else found


def update_folds_params(optimizer: torch.optim.Optimizer) -> bool:
    """The update adds ``wd · θ`` to the gradient (L2 weight decay of SGD, or of Adam without decoupling).

    Then the update reads every parameter's value into the optimizer state, which a parameter bound
    carried from step to step (instead of read) cannot stand for: Adam's state bound, which its step
    bound divides by ``eps``, would grow by ``lr · wd / ((1 - β1) · eps)`` per step, and a non-finite
    value written where the step's figures do not show it (through ``.data``, behind a saturated
    tanh) would turn the momentum or moments non-finite before any check saw it. Decoupled decay
    (AdamW) shrinks the parameter in place and leaves the state alone."""
    kind = type(optimizer)
    if kind not in _ADAM and kind is not torch.optim.SGD:
        return False
    adamw = kind is torch.optim.AdamW
    return any(not (adamw or g.get("decoupled_weight_decay")) and (_number(g.get("weight_decay", 0.0)) or 0.0) != 0.0
               for g in optimizer.param_groups)


def _analyse(optimizer: torch.optim.Optimizer, group: dict[str, Any], *, grad: float | None,
             param: float | None, state: float | None) -> str | float:
    """Why the update might not be finite (a sentence), or the bound of the parameters after it."""
    kind = type(optimizer)
    if kind not in _ADAM and kind is not torch.optim.SGD:
        return f"{kind.__name__}'s update rule is not one nantrace can bound"
    problem, dtype = _dtype_problem(group)
    if problem is not None:
        return problem
    if state is None:
        return "the optimizer state was not produced under watch (loaded or pre-existing)"
    if grad is None or param is None or not (math.isfinite(grad) and math.isfinite(param)):
        return "no finite gradient and parameter norms to bound the update with"
    lr, wd = _number(group.get("lr")), _number(group.get("weight_decay", 0.0))
    if lr is None or wd is None or not (math.isfinite(lr) and math.isfinite(wd)):
        return "lr or weight_decay is not a finite host number"
    limit = torch.finfo(dtype).max / _MARGIN
    lr, wd = abs(lr), abs(wd)
    if kind in _ADAM:
        b1, b2 = (_number(b) for b in group["betas"])
        eps = _number(group.get("eps"))
        if b1 is None or b2 is None or not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            return f"betas={group['betas']} outside [0, 1)"
        if eps is None or not eps >= torch.finfo(dtype).tiny:
            return f"eps={group.get('eps')} is not a positive normal {str(dtype).removeprefix('torch.')}"
        g = grad + (0.0 if group.get("decoupled_weight_decay") or kind is torch.optim.AdamW else wd * param)
        b = max(state, g)                       # |m| and sqrt(v), before and after the update
        step = lr * b / ((1.0 - b1) * eps)      # |lr · m̂ / (sqrt(v̂) + eps)|
        after = step + param * (1.0 + lr * wd)
        worst = max(b * b, after)
    else:
        mu, damp = _number(group.get("momentum", 0.0)), _number(group.get("dampening", 0.0))
        if mu is None or damp is None or not (0.0 <= mu < 1.0) or not math.isfinite(damp):
            return f"momentum={group.get('momentum')} outside [0, 1)"
        g = grad + wd * param
        buf = mu * state + max(1.0, abs(1.0 - damp)) * g  # the first step copies g undamped
        direction = (g + mu * buf) if group.get("nesterov") else (buf if mu else g)
        after = param + lr * direction
        worst = max(buf, after)
    if not worst <= limit:
        return f"the update's bound ({worst:.3g}) comes near the largest {str(dtype).removeprefix('torch.')}"
    return after


def next_state_bound(optimizer: torch.optim.Optimizer, group: dict[str, Any], *, grad: float, param: float,
                     state: float) -> float:
    """The state bound after a proven update of ``group`` (:func:`update_risk` returned ``None``)."""
    wd = abs(_number(group.get("weight_decay", 0.0)) or 0.0)
    if type(optimizer) in _ADAM:
        adamw = group.get("decoupled_weight_decay") or type(optimizer) is torch.optim.AdamW
        return max(state, grad + (0.0 if adamw else wd * param))
    mu, damp = _number(group.get("momentum", 0.0)) or 0.0, _number(group.get("dampening", 0.0)) or 0.0
    return mu * state + max(1.0, abs(1.0 - damp)) * (grad + wd * param) if mu else state
