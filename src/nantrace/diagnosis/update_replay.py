"""Diagnosis of an optimizer update that went non-finite: replay the failing parameter's update
on copies, op by op, and name the op that made the first non-finite value and why.

Runs only after :class:`~nantrace.response.update_check.UpdateCheck` has caught a bad update and
undone it, so the parameter, its gradient and its optimizer state are back to their pre-update
values. A replica of the optimizer (same class, same hyper-parameters, the one parameter and
its state cloned) runs ``step`` under a dispatch mode that checks every ATen op; the first op
whose inputs were finite and whose output was not is the origin. Dataflow from the state
tensors is followed, so the diagnosis says which state tensor fed it (Adam's denominator comes
from ``exp_avg_sq``).

Usage::

    replay = replay_update(optimizer, param)       # parameter and state as before the update
    replay.op, replay.cause, replay.denominator_state   # 'aten.addcdiv_.default', 'div_by_zero', 'exp_avg_sq'
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from ..dynamics.optimizer_state import eps_problem
from ..incident import Incident
from ..localisation.tracer import op_name, tensor_stats, user_source, written_tensors
from ..response.policies import action_for
from .triage import Finding

if TYPE_CHECKING:
    from ..watched import Watched
    from ..response.update_check import UpdateFailure

__all__ = ["UpdateReplay", "optimizer_incident", "replay_update"]

_DIVISIONS = {"div": 1, "true_divide": 1, "addcdiv": 2, "reciprocal": 0, "rsqrt": 0}
"""Division-like ops and the position of their denominator."""
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_CHAIN_LIMIT = 6


@dataclasses.dataclass
class UpdateReplay:
    """What the replay of one parameter's update showed."""

    reproduced: bool
    op: str | None = None
    source: str | None = None
    cause: str = "optimizer_state"
    detail: str = ""
    denominator_state: str | None = None
    """The optimizer-state tensor the origin op's denominator was computed from, if any."""
    input_stats: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    chain: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    ops_replayed: int = 0
    float32_finite: bool | None = None
    """Low-precision state only: is the same update finite in float32?"""


def _short(op: str) -> str:
    name = op.split(".")[1] if op.count(".") >= 2 else op
    return name.removeprefix("_foreach_").rstrip("_")


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _nonfinite(t: torch.Tensor) -> tuple[bool, bool]:
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return False, False
    return bool(torch.isnan(t).any()), bool(torch.isinf(t).any())


def _zeros(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return int((x == 0).sum())
    if isinstance(x, (int, float)):
        return int(x == 0)
    if isinstance(x, (list, tuple)):
        return sum(_zeros(v) for v in x)
    return 0


class _OpWatch(TorchDispatchMode):
    """Checks every op of the replayed update; keeps the origin and the state each value came from."""

    def __init__(self, state: Callable[[], dict[Any, Any]]) -> None:
        super().__init__()
        self.state = state
        """The replica's state dict for the parameter (created by the optimizer's first step)."""
        self.sources: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        """Tensor -> names of the state tensors its value was computed from."""
        self.origin: dict[str, Any] | None = None
        self.chain: list[dict[str, Any]] = []
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        for key, value in self.state().items():  # name state tensors, also those made by this step
            if isinstance(value, torch.Tensor) and str(key) not in self.sources.get(value, frozenset()):
                self.sources[value] = frozenset({str(key)}) | self.sources.get(value, frozenset())
        inputs = _tensors((args, kwargs))
        before = [_nonfinite(t) for t in inputs] if len(self.chain) < _CHAIN_LIMIT else []
        came_from: set[str] = set()
        for t in inputs:
            came_from |= self.sources.get(t, frozenset())
        stats = [tensor_stats(t, f"input[{i}]") for i, t in enumerate(inputs)] if self.origin is None else []
        short = _short(op_name(func))
        position = _DIVISIONS.get(short)
        denominator = args[position] if position is not None and position < len(args) else None
        # read before the op: an in-place op (rsqrt_, a foreach addcdiv_) overwrites what it divided by
        zeros = _zeros(denominator) if denominator is not None and self.origin is None else 0
        denominator_sources = set().union(*(self.sources.get(t, frozenset()) for t in _tensors(denominator))) \
            if denominator is not None else set()
        written = written_tensors(func, args, kwargs)
        out = func(*args, **kwargs)
        for t in [*_tensors(out), *written]:
            self.sources[t] = frozenset(came_from | self.sources.get(t, frozenset()))
        if len(self.chain) >= _CHAIN_LIMIT:
            return out
        # what the op wrote: its outputs, and the arguments it writes in place (foreach and fused
        # optimizer kernels return nothing)
        after = [_nonfinite(t) for t in [*_tensors(out), *written]]
        nan, inf = any(a[0] for a in after), any(a[1] for a in after)
        if not (nan or inf):
            return out
        name = op_name(func)
        creates = not any(any(b) for b in before)
        item = {"op": name, "aten": name, "phase": "optimizer", "node": None, "module": None,
                "source": user_source(1), "produces": "NaN" if nan else "Inf", "origin": False}
        if self.origin is None and creates:
            item["origin"] = True
            self.origin = {"op": name, "source": item["source"], "short": short, "stats": stats,
                           "zeros": zeros, "denominator_sources": denominator_sources,
                           "negatives": sum(s.get("negatives", 0) for s in stats[:1]),
                           "dtype": next((t.dtype for t in _tensors(out)), None), "nan": nan, "inf": inf}
        if self.origin is not None:
            self.chain.append(item)
        return out


def _failed_param(watched: "Watched", failure: "UpdateFailure") -> torch.Tensor:
    """The parameter whose update failed (one added after ``watch()`` is not among the watched)."""
    if failure.param is not None:
        return failure.param
    return watched.params[failure.param_index]


def _replica(optimizer: torch.optim.Optimizer, param: torch.Tensor, dtype: torch.dtype | None = None
             ) -> tuple[torch.optim.Optimizer, torch.nn.Parameter]:
    """A shallow copy of ``optimizer`` stepping only a clone of ``param`` (and its cloned state), no hooks."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    cast = dtype or param.dtype
    clone = torch.nn.Parameter(param.detach().clone().to(cast), requires_grad=param.requires_grad)
    if param.grad is not None:
        clone.grad = param.grad.detach().clone().to(cast)
    state: dict[Any, Any] = {}
    for key, value in optimizer.state.get(param, {}).items():
        if isinstance(value, torch.Tensor):
            value = value.detach().clone()
            if value.dtype == param.dtype and dtype is not None:
                value = value.to(dtype)
        state[key] = value
    replica = object.__new__(type(optimizer))
    replica.__dict__.update(optimizer.__dict__)
    replica.param_groups = [{**group, "params": [clone]}]
    replica.state = collections.defaultdict(dict)
    if param in optimizer.state:
        replica.state[clone] = state
    replica._optimizer_step_pre_hooks = collections.OrderedDict()  # type: ignore[attr-defined]
    replica._optimizer_step_post_hooks = collections.OrderedDict()  # type: ignore[attr-defined]
    return replica, clone


def _raw_step(optimizer: torch.optim.Optimizer) -> Any:
    """The class's ``step`` without torch's hook wrapper (no hook of anyone's runs for the replica)."""
    step = type(optimizer).step
    return step.__wrapped__ if getattr(step, "hooked", False) and hasattr(step, "__wrapped__") else step


def replay_update(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> UpdateReplay:
    """Replay ``param``'s update (from its current, pre-update values) under op-level checks."""
    replica, clone = _replica(optimizer, param)
    watch = _OpWatch(lambda: replica.state.get(clone, {}))
    with watch:
        _raw_step(optimizer)(replica)
    origin = watch.origin
    after = [clone] + [v for v in replica.state.get(clone, {}).values() if isinstance(v, torch.Tensor)]
    reproduced = origin is not None or any(any(_nonfinite(t)) for t in after)
    result = UpdateReplay(reproduced=reproduced, ops_replayed=watch.ops)
    if param.dtype in _LOW_PRECISION:
        result.float32_finite = _finite_in_float32(optimizer, param)
    if origin is None:
        return result
    result.op, result.source, result.input_stats, result.chain = origin["op"], origin["source"], origin["stats"], watch.chain
    states = sorted(origin["denominator_sources"])
    result.denominator_state = states[0] if states else None
    result.cause, result.detail = _cause(origin, result.float32_finite)
    return result


def _finite_in_float32(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool | None:
    try:
        replica, clone = _replica(optimizer, param, torch.float32)
        _raw_step(optimizer)(replica)
    except Exception:  # the optimizer may insist on its own dtype: no verdict
        return None
    tensors = [clone] + [v for v in replica.state.get(clone, {}).values() if isinstance(v, torch.Tensor)]
    return not any(any(_nonfinite(t)) for t in tensors)


def _cause(origin: dict[str, Any], float32_finite: bool | None) -> tuple[str, str]:
    short = origin["short"]
    if short in _DIVISIONS and origin["zeros"]:
        n = origin["zeros"]
        return "div_by_zero", f"{n} zero{'s' if n != 1 else ''} in the denominator"
    if short in ("sqrt", "pow") and origin["negatives"]:
        return "sqrt_negative", f"{origin['negatives']} negative inputs"
    if origin["inf"] and not origin["nan"]:
        dtype = origin["dtype"]
        if dtype in _LOW_PRECISION and float32_finite:
            return "precision_overflow", f"beyond the {str(dtype).removeprefix('torch.')} range, finite in float32"
        return "overflow", "finite inputs, a result beyond the dtype's range"
    return "optimizer_state", ""


# ------------------------------------------------------------------------------ the incident
def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = float(value)
        if isinstance(value, (bool, int, float, str, type(None))) or (
                isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value)):
            out[key] = list(value) if isinstance(value, tuple) else value
    return out


def _texts(watched: "Watched", failure: "UpdateFailure", replay: UpdateReplay, state: str | None,
           group: dict[str, Any], cause: str, eps_note: str | None) -> tuple[str, str]:
    opt = type(watched.optimizer).__name__
    made = "non-finite" if failure.nonfinite_params else f"its {state or 'state'} non-finite"
    what = f"optimizer.step() ({opt}) made parameter '{failure.param_name}' {made} at step {watched.step}"
    if replay.op is None:
        how = ("; a replay of the update from the same values stayed finite" if not replay.reproduced
               else "; no single op of the replayed update could be named")
    else:
        via = f", computed from {replay.denominator_state}" if replay.denominator_state else ""
        how = f": {replay.op} made the first non-finite value ({replay.detail or 'from finite inputs'}{via})"
    bad_hyper = {k: v for k, v in _hyper(group).items() if isinstance(v, float) and not math.isfinite(v)}
    if bad_hyper:  # a scalar of the update, not a tensor: the replay's op saw only finite tensors
        named = ", ".join(f"{k} = {v}" for k, v in bad_hyper.items())
        how = f"{how}; the param group's {named}"
    eps = group.get("eps")
    dtype = _failed_param(watched, failure).dtype
    why = f"; {eps_note}" if eps_note and cause in ("div_by_zero", "optimizer_state") else ""
    spread = sorted({s["state"] for s in failure.nonfinite_state if s["param"] == failure.param_name} - {replay.denominator_state})
    also = f"; {', '.join(spread)} turned non-finite too" if spread and failure.nonfinite_params else ""
    summary = f"{what}{how}{why}{also}. The update was undone before it could land."
    if bad_hyper:
        names = " and ".join(bad_hyper)
        fix = (f"The optimizer's {names} is not finite: check what sets it (a learning-rate scheduler's formula "
               "dividing by zero, e.g. total_steps == warmup_steps in a cosine schedule, or a value read from a "
               "config or a diverged schedule) and keep it finite.")
        return summary, fix
    if eps is not None and cause in ("div_by_zero", "optimizer_state", "precision_overflow"):
        if dtype in _LOW_PRECISION:
            name = str(dtype).removeprefix("torch.")
            fix = (f"Give the optimizer an eps that {name} state can hold (at least {torch.finfo(dtype).tiny:.2g}, "
                   "e.g. eps=1e-4), or keep the optimizer state and a master copy of the weights in float32 "
                   "(torch.autocast with float32 weights instead of model.half()).")
        else:
            fix = (f"Give the optimizer a positive eps (the usual 1e-8): an entry whose "
                   f"{replay.denominator_state or 'second-moment state'} is 0 is divided by it.")
    elif cause == "optimizer_state" and replay.denominator_state:
        fix = (f"The update divides by its state {replay.denominator_state}, which reached exactly 0 (a parameter "
               "whose gradient stayed 0 long enough for the running average to decay to 0): add a small positive "
               "eps to that denominator, as Adam and RMSProp do.")
    elif cause == "div_by_zero":
        fix = ("Guard that division in the optimizer: a norm or statistic of this parameter was exactly 0 (a layer "
               "whose gradient is all zero this step). Trust-ratio optimizers (LARS, LAMB) use a ratio of 1 when "
               "either norm is 0.")
    elif cause in ("overflow", "precision_overflow"):
        fix = "Lower the learning rate or clip gradients, and keep the optimizer state in float32."
    else:
        fix = ("Check the optimizer's update rule and hyper-parameters (lr, eps, betas, momentum) for this "
               "parameter; the incident's details hold the state tensors that went non-finite.")
    return summary, fix


def optimizer_incident(watched: "Watched", failure: "UpdateFailure", history: Sequence[dict[str, Any]]) -> Incident:
    """The incident of an update that went non-finite (already undone), with the replay's verdict."""
    assert watched.optimizer is not None
    param = _failed_param(watched, failure)
    group = next(g for g in watched.optimizer.param_groups if any(p is param for p in g["params"]))
    start = time.perf_counter()
    try:
        replay = replay_update(watched.optimizer, param)
    except Exception as exc:  # a diagnosis that fails must not take the training run down
        replay = UpdateReplay(reproduced=True)
        replay_error: str | None = f"{type(exc).__name__}: {exc}"
    else:
        replay_error = None
    bad_state = [s["state"] for s in failure.nonfinite_state if s["param"] == failure.param_name]
    state = bad_state[0] if bad_state else replay.denominator_state
    kind = "nonfinite_param" if failure.nonfinite_params else "optimizer_state"
    cause = replay.cause if replay.reproduced else "optimizer_state"
    eps = group.get("eps")
    # one eps, or several (Adafactor's (eps1, eps2)): the first its dtype cannot hold
    eps_note = next((note for e in (eps if isinstance(eps, (tuple, list)) else (eps,))
                     if isinstance(e, (int, float)) and (note := eps_problem(float(e), param.dtype))), None)
    if any(isinstance(v, float) and not math.isfinite(v) for v in _hyper(group).values()):
        cause = "optimizer_state"  # a NaN/inf learning rate or weight decay: the op only met it
    elif cause == "div_by_zero" and replay.denominator_state is not None and (eps_note or "eps" not in group):
        # a denominator from the optimizer's state, with an eps its dtype cannot hold or none at all
        # (a hand-written RMSProp whose accumulator decayed to exactly 0): the state's fault
        cause = "optimizer_state"
    summary, fix = _texts(watched, failure, replay, state, group, cause, eps_note)
    module = failure.param_name.rpartition(".")[0]
    for item in replay.chain:
        item["module"] = module
    finding = Finding(watched.step, kind, "optimizer", cause, module, summary, fix)
    action = action_for(watched.policy, finding, finite_trouble=False, config=watched.config)
    details: dict[str, Any] = {
        "parameter": failure.param_name,
        "state": state,
        "optimizer": type(watched.optimizer).__name__,
        "hyperparameters": _hyper(group),
        "nonfinite_params": failure.nonfinite_params,
        "nonfinite_state": failure.nonfinite_state,
        "checked_because": failure.unproven,
        "ops_replayed": replay.ops_replayed,
        "localisation_seconds": round(time.perf_counter() - start, 4),
    }
    if replay.float32_finite is not None:
        details["float32_replay_finite"] = replay.float32_finite
    if replay_error is not None:
        details["localisation_error"] = replay_error
    from ..reporting import new_incident

    incident = new_incident(watched, kind=kind, phase="optimizer", module=module, cause=cause, summary=summary,
                            fix=fix, action=action, details=details, history=history)
    incident.op, incident.source = replay.op, replay.source
    incident.chain, incident.input_stats = replay.chain, replay.input_stats
    incident.transient = None if replay_error else not replay.reproduced
    return incident
