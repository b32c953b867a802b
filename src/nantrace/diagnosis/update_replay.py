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
import contextlib
import copy
import dataclasses
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from ..dynamics.optimizer_state import eps_problem
from ..incident import Incident
from ..localisation.tracer import dense_parts, has_inf, has_nan, op_name, tensor_stats, user_source, written_tensors
from ..response.policies import action_for
from ..taxonomy import Action
from .triage import Finding

if TYPE_CHECKING:
    from ..watched import Watched
    from ..response.update_check import UpdateFailure

__all__ = ["UpdateReplay", "optimizer_incident", "replay_update", "step_exception_incident"]

_DIVISIONS = {"div": 1, "true_divide": 1, "addcdiv": 2, "reciprocal": 0, "rsqrt": 0}
"""Division-like ops and the position of their denominator."""
_ROOTS = frozenset({"sqrt", "pow"})
"""Ops whose (first) argument must not be negative (a fractional power)."""
_LOGS = {"log": 0.0, "log2": 0.0, "log10": 0.0, "log1p": -1.0}
"""Logarithms and the bound their argument must exceed."""
_REDUCTIONS = frozenset({"norm", "linalg_vector_norm", "linalg_matrix_norm", "frobenius_norm", "sum", "nansum", "mean",
                         "nanmean", "var", "std", "var_mean", "std_mean", "amax", "amin", "max", "min", "dot", "vdot",
                         "prod", "logsumexp"})
"""Ops that reduce a tensor to a statistic (a norm, a sum); ``max``/``min`` only in their reducing overloads."""
_ELEMENTWISE_OVERLOADS = frozenset({"other", "out", "binary_out"})
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_CHAIN_LIMIT = 6
_GRAD, _PARAM, _FOUND, _SETTING = "<grad>", "<param>", "<found>", "<setting>"
"""Dataflow tags besides the state tensors' names: this step's gradient, the parameter, a tensor kept
in the param group among its settings (a tensor learning rate, Schedule-Free's ``weight_sum``), and any
other tensor the update read that it did not make (a module's weight, activations an optimizer kept)."""
_TAGS = frozenset({_GRAD, _PARAM, _FOUND, _SETTING})
_OWN = "<own>"
"""Prefix of the tag a step post-hook's replay gives each stepped parameter as the hook finds it (one tag per
parameter): a value computed from it alone is computed from that parameter's own values."""
_SPREADS = frozenset({"norm", "linalg_vector_norm", "linalg_matrix_norm", "frobenius_norm", "std", "var", "std_mean",
                      "var_mean"})
"""Statistics that are 0 exactly where a slice is constant (all 0 for a norm)."""
_MAGNITUDES = frozenset({"abs", "square"})
"""Element-wise magnitudes: a sum, mean or maximum of them is a norm (``|w|.amax()``, ``w.pow(2).sum().sqrt()``)."""
_SUMMARIES = frozenset({"sum", "mean", "amax", "max", "nansum", "nanmean"})
_KEEPS = frozenset({"abs", "square", "add", "mul", "div", "sqrt", "clamp", "clamp_min", "clamp_max", "pow", "expand",
                    "expand_as", "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "detach", "clone", "alias",
                    "_to_copy", "to", "copy", "t", "transpose", "permute", "contiguous"})
"""Ops that keep a statistic one (scaled by a constant, an eps added, a root, a view); never a difference."""
_LIFTS = frozenset({"lift_fresh", "lift", "lift_fresh_copy"})
"""Ops that bring a constant built from Python numbers (``torch.tensor(x)``) into the dispatch."""
_LIFT_MATCH = 64
"""A lifted constant of at most this many elements inherits the dataflow of the numbers read to the host
that it holds (``torch.tensor(t.item())``); otherwise it is a plain constant, computed from no tensor."""
_SETTINGS_CANDIDATES = 16
"""At most this many numeric settings of a group are tried one by one when blaming one."""


@dataclasses.dataclass
class UpdateReplay:
    """What the replay of one parameter's update showed."""

    reproduced: bool
    op: str | None = None
    source: str | None = None
    cause: str = "optimizer_state"
    detail: str = ""
    denominator_state: str | None = None
    """The optimizer-state tensor the origin op's bad operand (a denominator, the argument of a root
    or a logarithm) was computed from, if any."""
    input_stats: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    chain: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    ops_replayed: int = 0
    float32_finite: bool | None = None
    """Low-precision state only: is the same update finite in float32?"""
    from_settings: bool = False
    """The bad operand traces to no gradient, parameter or state tensor: the group's settings made it
    (a divisor ``1 - beta2**t`` with beta2 = 1, a step size ``sqrt(2 lr / T)`` with T = 0)."""
    settings: list[str] = dataclasses.field(default_factory=list)
    """The settings (``"betas[1] = 1.0"``) that, moved off their value alone, make the update finite."""
    domain_of_state: bool = False
    """A root, power or logarithm of a value computed from the optimizer's state was out of its domain."""
    module: str | None = None
    """The watched module the optimizer's code was working on at the origin (read from its frames)."""
    hook: str | None = None
    """The user's step post-hook the origin op ran in (its qualified name), ``None`` for the update itself."""


def _named(sources: set[str] | frozenset[str]) -> set[str]:
    """The optimizer-state names among a value's sources (not the tags)."""
    return {s for s in sources if s not in _TAGS and not s.startswith(_OWN)}


def _short(op: str) -> str:
    name = op.split(".")[1] if op.count(".") >= 2 else op
    return name.removeprefix("_foreach_").rstrip("_")


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _nonfinite(t: torch.Tensor) -> tuple[bool, bool]:
    """(holds NaN, holds ±inf): of a sparse tensor (a sparse gradient, the sparse update Adagrad, SGD and
    SparseAdam build from it), the values it stores."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return False, False
    return has_nan(t), has_inf(t)


def _zeros(x: Any) -> int:
    """How many zeros ``x`` holds; of a sparse tensor, its stored zeros (an entry of the sparse gradient with
    value 0 is one the update divides; an element not stored is not read)."""
    if isinstance(x, torch.Tensor):
        return sum(int((part == 0).sum()) for part in dense_parts(x))
    if isinstance(x, (int, float)):
        return int(x == 0)
    if isinstance(x, (list, tuple)):
        return sum(_zeros(v) for v in x)
    return 0


def _below(x: Any, bound: float, strict: bool) -> int:
    """How many elements of ``x`` lie below ``bound`` (``strict``) or at or below it."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
        return 0
    return sum(int((part < bound).sum()) if strict else int((part <= bound).sum()) for part in dense_parts(x))


def _numbers(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, float]]:
    """The plain-number (not tensor) arguments of an op call, by the schema's argument names."""
    out: list[tuple[str, float]] = []
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out.append((arg.name, float(v)))
    return out


class _OpWatch(TorchDispatchMode):
    """Checks every op of the replayed update; keeps the origin, the state each value came from,
    which values are statistics (norms, sums) of this step's update, and the decompositions that failed."""

    def __init__(self, state: Callable[[], Iterable[tuple[Any, Any]]], *, params: Iterable[torch.Tensor] = (),
                 grads: Iterable[torch.Tensor] = (), module_of: Callable[[Any], str | None] | None = None,
                 groups: Callable[[], Iterable[dict[str, Any]]] | None = None) -> None:
        super().__init__()
        self.state = state
        """The replica's (state name, value) pairs (created by the optimizer's first step)."""
        self.groups = groups
        """The replica's param groups: the tensors among their settings (any key but ``params``) are settings."""
        self.sources: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        """Tensor -> names of the state tensors (and tags: gradient, parameter, setting, found) its value was computed from."""
        self.made: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        """Tensors the replay itself made (an op's output)."""
        self.reduced: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        """Statistics (a norm, a sum) over this step's update or gradient (their dataflow reaches the
        gradient or the parameter), and values computed from such statistics alone."""
        for t in params:
            self.sources[t] = frozenset({_PARAM})
        for t in grads:
            self.sources[t] = frozenset({_GRAD})
        self.read: list[tuple[float, frozenset[str]]] = []
        """Numbers read to the host (``.item()``, ``float(t)``) and what they were computed from."""
        self.module_of = module_of
        self.failed: list[dict[str, Any]] = []
        """Decompositions whose ``info`` output reported a failure (a singular, non-positive-definite matrix)."""
        self.origin: dict[str, Any] | None = None
        self.chain: list[dict[str, Any]] = []
        self.ops = 0
        self.stat: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        """``"spread"`` for a norm or spread statistic (and a constant multiple, root or view of one), ``"magnitude"``
        for an element-wise magnitude (``abs``, a square) whose sum or maximum is a norm."""
        self.values: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        """Tensor -> the sources of its values through floating-point operands only (an index or a mask selects
        values, it makes none): what :meth:`_normalises_own` reads."""
        self.hook: str | None = None
        """The user's step post-hook the replay is running, if any (``post_hook``)."""

    def post_hook(self, hook: Any, params: Iterable[torch.Tensor]) -> None:
        """A user's step post-hook starts: each stepped parameter, as the hook finds it, is that parameter's own
        values (a tag of its own), so that a division of them by a norm of them alone is told from an update."""
        self.hook = getattr(hook, "__qualname__", type(hook).__name__)
        for i, p in enumerate(params):
            self.sources[p] = self.values[p] = frozenset({f"{_OWN}{i}"})
            self.stat.pop(p, None)

    def _statistic(self, short: str, args: tuple[Any, ...], inputs: list[torch.Tensor]) -> str | None:
        """What the op's output is: a spread statistic, a magnitude, or neither (:attr:`stat`)."""
        if short in _SPREADS:
            return "spread"
        first = _tensors(args[0]) if args else []
        if short in _SUMMARIES and first and all(self.stat.get(t) is not None for t in first):
            return "spread"
        kinds = [self.stat.get(t) for t in inputs]
        if short in _KEEPS and any(kinds):
            if short == "div" and len(args) > 1 and isinstance(args[1], torch.Tensor) and self.stat.get(args[1]):
                return None  # a ratio of two statistics, or a value over one, is no statistic
            if any(k is None and t.numel() != 1 for k, t in zip(kinds, inputs)):
                return None  # combined with more than a constant (an eps, a scale)
            return "spread" if "spread" in kinds else "magnitude"
        if short in _MAGNITUDES or (short == "pow" and len(args) > 1 and isinstance(args[1], (int, float))
                                    and not isinstance(args[1], bool) and args[1] > 0 and args[1] % 2 == 0) or (
                short == "mul" and len(args) > 1 and isinstance(args[0], torch.Tensor) and args[0] is args[1]):
            return "magnitude"
        return None

    def _normalises_own(self, short: str, args: tuple[Any, ...], position: int) -> bool:
        """A division of a parameter's own values (as a step post-hook found them) by a spread statistic of those
        values alone (a row over its norm, a standardisation, a max-abs scaling): a normalisation of them."""
        divisor = _tensors(args[position])
        if not divisor or any(self.stat.get(t) != "spread" for t in divisor):
            return False
        own = set().union(*(self._values_of(t) for t in divisor))
        if len(own) != 1 or not next(iter(own)).startswith(_OWN):
            return False
        if position == 0:  # reciprocal, rsqrt: what is multiplied by it comes later
            return True
        if short not in ("div", "true_divide"):
            return False
        numerator = _tensors(args[0])
        return all(self._values_of(t) == frozenset(own) for t in numerator)

    def _values_of(self, t: torch.Tensor) -> frozenset[str]:
        found = self.values.get(t)
        return found if found is not None else self.sources.get(t, frozenset())

    def _state_pairs(self) -> list[tuple[str, torch.Tensor]]:
        return [(str(k), v) for k, v in self.state() if isinstance(v, torch.Tensor)]

    def _kind(self, denominator: Any, zeros: int, sources: set[str]) -> str:
        """What a zero divisor is: ``settings`` (no dataflow from any tensor the update found),
        ``reduction`` (a norm or sum of this step's update), ``state`` (element-wise from the
        optimizer's state) or ``step`` (element-wise from the gradient or parameter)."""
        tensors = _tensors(denominator)
        if tensors and any(self.reduced.get(t, False) for t in tensors):
            return "reduction"
        if not tensors and zeros:  # a plain number: made from a number read off a tensor, or from the settings
            sources = set().union(*(s for v, s in self.read if v == 0.0))
        if _of_settings(sources):  # plain numbers, tensors kept among the group's settings, or both
            return "settings"
        return "state" if _named(sources) else "step"

    def _setting_tensors(self) -> set[int]:
        if self.groups is None:
            return set()
        return {id(t) for g in self.groups() for k, v in g.items() if k != "params" for t in _tensors(v)}

    def _lifted(self, inputs: list[torch.Tensor]) -> frozenset[str]:
        """The dataflow of a constant ``torch.tensor(...)`` made: the numbers read to the host that it holds."""
        held: set[float] = set()
        for t in inputs:
            if t.numel() <= _LIFT_MATCH and not t.is_complex():
                held.update(float(v) for part in dense_parts(t.detach()) for v in part.reshape(-1).tolist())
        return frozenset().union(*(s for v, s in self.read if v in held))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        state = self._state_pairs()
        for key, value in state:  # name state tensors, also those made by this step
            if key not in self.sources.get(value, frozenset()):
                self.sources[value] = frozenset({key}) | self.sources.get(value, frozenset())
        inputs = _tensors((args, kwargs))
        name = op_name(func)
        short = _short(name)
        lift = short in _LIFTS
        settings = self._setting_tensors() if not lift and any(
            t not in self.sources and t not in self.made for t in inputs) else set()
        for t in inputs:  # a tensor the update found rather than made (a module's weight, kept activations)
            if t not in self.sources and t not in self.made and not lift:
                self.sources[t] = frozenset({_SETTING if id(t) in settings else _FOUND})
        before = [_nonfinite(t) for t in inputs] if len(self.chain) < _CHAIN_LIMIT else []
        came_from: set[str] = set()
        if lift:  # torch.tensor(number): made from Python numbers, not found
            came_from |= self._lifted(inputs)
        for t in inputs:
            came_from |= self.sources.get(t, frozenset())
        overload = name.rsplit(".", 1)[-1]
        reduces = short in _REDUCTIONS and not (short in ("max", "min") and overload in _ELEMENTWISE_OVERLOADS)
        of_update = False
        if reduces and inputs:  # a statistic (a norm, a sum) over this step's update or gradient
            first = _tensors(args[0]) if args else inputs[:1]
            of_update = bool(first) and all(bool(self.sources.get(t, frozenset()) & {_GRAD, _PARAM}) for t in first)
        from_reduced = bool(inputs) and all(self.reduced.get(t, False) for t in inputs)
        stats: list[dict[str, Any]] = []
        zeros, negatives, kind, bad_sources = 0, 0, None, set()
        numbers = _numbers(func, args, kwargs)
        bad_numbers = [(k, v) for k, v in numbers if not math.isfinite(v)]
        if self.origin is None:
            stats = [tensor_stats(t, f"input[{i}]") for i, t in enumerate(inputs)]
            position = _DIVISIONS.get(short)
            # read before the op: an in-place op (rsqrt_, a foreach addcdiv_) overwrites what it divided by
            if position is not None and position < len(args):
                denominator = args[position]
                zeros = _zeros(denominator)
                bad_sources = set().union(*(self.sources.get(t, frozenset()) for t in _tensors(denominator)))
                kind = None if not zeros else "normalised" if self._normalises_own(short, args, position) else \
                    self._kind(denominator, zeros, bad_sources)
                if short == "rsqrt":
                    negatives = _below(denominator, 0.0, strict=True)
            elif (short in _ROOTS or short in _LOGS) and args and isinstance(args[0], torch.Tensor):
                negatives = _below(args[0], _LOGS[short], strict=False) if short in _LOGS else \
                    _below(args[0], 0.0, strict=True)
                bad_sources = set(self.sources.get(args[0], frozenset()))
                if short == "pow" and len(args) > 1 and isinstance(args[1], (int, float)) and args[1] < 0:
                    zeros = _zeros(args[0])  # x ** -p is a division by x ** p
                    kind = self._kind(args[0], zeros, bad_sources) if zeros else None
        written = written_tensors(func, args, kwargs)
        statistic = self._statistic(short, args, inputs) if inputs else None
        written_ids = {id(t) for t in written}
        out = func(*args, **kwargs)
        outputs = _tensors(out)
        valued = frozenset().union(*(self._values_of(t) for t in inputs if t.is_floating_point() or t.is_complex()))
        for t in [*outputs, *written]:
            self.values[t] = valued | self._values_of(t) if id(t) in written_ids else valued
            if statistic is None:
                self.stat.pop(t, None)
            else:
                self.stat[t] = statistic
        for t in [*outputs, *written]:
            self.sources[t] = frozenset(came_from | self.sources.get(t, frozenset()))
        for t in outputs:
            self.made[t] = True
            if of_update or from_reduced:
                self.reduced[t] = True
        if short == "_local_scalar_dense" and isinstance(out, (int, float)):
            self.read.append((float(out), frozenset(came_from)))
        if short.endswith("_ex") and isinstance(out, tuple) and outputs and not outputs[-1].is_floating_point() \
                and bool((outputs[-1] != 0).any()):
            self.failed.append({"op": name, "source": user_source(1), "sources": sorted(_named(came_from)),
                                "index": self.ops, "finite": not any(any(_nonfinite(t)) for t in inputs),
                                "module": self.module_of(sys._getframe(1)) if self.module_of is not None else None})
        if len(self.chain) >= _CHAIN_LIMIT:
            return out
        # what the op wrote: its outputs, and the arguments it writes in place (foreach and fused
        # optimizer kernels return nothing)
        after = [_nonfinite(t) for t in [*outputs, *written]]
        nan, inf = any(a[0] for a in after), any(a[1] for a in after)
        if not (nan or inf):
            return out
        creates = not any(any(b) for b in before)
        item = {"op": name, "aten": name, "phase": "optimizer", "node": None, "module": None,
                "source": user_source(1), "produces": "NaN" if nan else "Inf", "origin": False}
        if self.origin is None and creates:
            item["origin"] = True
            self.origin = {"hook": self.hook, "op": name, "source": item["source"], "short": short, "stats": stats,
                           "zeros": zeros, "kind": kind, "bad_sources": bad_sources, "negatives": negatives,
                           "bad_numbers": bad_numbers, "dtype": next((t.dtype for t in outputs), None),
                           "nan": nan, "inf": inf, "index": self.ops,
                           "module": self.module_of(sys._getframe(1)) if self.module_of is not None else None}
        if self.origin is not None:
            self.chain.append(item)
        return out


def _failed_param(watched: "Watched", failure: "UpdateFailure") -> torch.Tensor:
    """The parameter whose update failed (one added after ``watch()`` is not among the watched)."""
    if failure.param is not None:
        return failure.param
    return watched.params[failure.param_index]


def _copy_state(value: Any, keep: set[int], dtype: torch.dtype | None, param_dtype: torch.dtype) -> Any:
    """The replica's copy of one optimizer-state value: its tensors cloned (cast to ``dtype`` where they
    are in the parameter's dtype), the containers holding them (a list of preconditioners, a dict) copied,
    and a parameter of the optimizer (``keep``) kept as itself."""
    if isinstance(value, torch.Tensor):
        if id(value) in keep:
            return value
        value = value.detach().clone()
        return value.to(dtype) if dtype is not None and value.dtype == param_dtype else value
    if isinstance(value, dict):
        copied = copy.copy(value)  # a defaultdict, an OrderedDict stays one
        for k, v in value.items():
            copied[k] = _copy_state(v, keep, dtype, param_dtype)
        return copied
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_copy_state(v, keep, dtype, param_dtype) for v in value)
    return value


def _copy_setting(value: Any) -> Any:
    """A param group's setting as the replica holds it: its containers copied (the step may append to a
    list kept there), its tensors the same (an in-place write into one is put back by the write guard)."""
    if isinstance(value, dict):
        return {k: _copy_setting(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_setting(v) for v in value]
    return value


def _replica(optimizer: torch.optim.Optimizer, param: torch.Tensor | None, dtype: torch.dtype | None = None,
             override: tuple[str, int | None, float] | None = None) -> tuple[torch.optim.Optimizer, dict[int, torch.Tensor]]:
    """A shallow copy of ``optimizer``, no hooks, with its own param groups and a copy of the state: only
    ``param``'s group and ``param`` itself, or (``param=None``) every group. It steps the optimizer's own
    parameter objects, not clones of them, so code that knows a parameter by its identity (``p is
    self.row_param``, a dict keyed by the parameter or its ``id``, a module's weight) takes the branch the
    real step took; :func:`_isolated` puts their values and gradients back (and casts them to ``dtype``
    for the length of the replay). ``override`` sets one numeric setting of the copied groups (``(key,
    index in a tuple or None, value)``). Returns the copy and ``id(parameter) -> parameter`` (what it steps)."""
    groups = [g for g in optimizer.param_groups if param is None or any(p is param for p in g["params"])][:1 if param is not None else None]
    keep = {id(p) for g in optimizer.param_groups for p in g["params"]}
    stepped: dict[int, torch.Tensor] = {}
    replica = object.__new__(type(optimizer))
    replica.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})  # not a wrapper of the real step
    replica.state = collections.defaultdict(dict)
    replica.param_groups = []
    for group in groups:
        params = [param] if param is not None else list(group["params"])
        copied = {k: [] if k == "params" else _copy_setting(v) for k, v in group.items()}
        if override is not None and override[0] in copied:
            key, index, value = override
            if isinstance(copied[key], torch.Tensor):  # a setting kept as a one-element tensor: a new one
                copied[key] = torch.full_like(copied[key], value)
            elif index is None:
                copied[key] = value
            else:
                copied[key] = type(copied[key])(value if i == index else v for i, v in enumerate(copied[key]))
        for p in params:
            if id(p) not in stepped:
                stepped[id(p)] = p
                if p in optimizer.state:
                    replica.state[p] = {k: _copy_state(v, keep, dtype, p.dtype) for k, v in optimizer.state[p].items()}
            copied["params"].append(p)
        replica.param_groups.append(copied)
    replica._optimizer_step_pre_hooks = collections.OrderedDict()  # type: ignore[attr-defined]
    replica._optimizer_step_post_hooks = collections.OrderedDict()  # type: ignore[attr-defined]
    return replica, stepped


def _raw_step(optimizer: torch.optim.Optimizer) -> Any:
    """The class's ``step`` without torch's hook wrapper (no hook of anyone's runs for the replica)."""
    step = type(optimizer).step
    return step.__wrapped__ if getattr(step, "hooked", False) and hasattr(step, "__wrapped__") else step


def _step_replica(optimizer: torch.optim.Optimizer, replica: torch.optim.Optimizer,
                  watch: "_OpWatch | None" = None) -> Any:
    """Step ``replica`` as ``optimizer.step()`` ran: first the user's step pre-hooks that run after nantrace's
    check (``optimizer_step.pre_hooks_after_own``: code of the step that may rewrite a gradient or a parameter in
    place, a row normalisation, a weight standardisation), given the replica, then the class's ``step``, then the
    user's step post-hooks (``optimizer_step.post_hooks_of_user``: they run before nantrace's check of the update
    and may write the parameters, a unit-norm projection, a weight clip), given the replica; ``watch`` is told
    where each post-hook starts (:meth:`_OpWatch.post_hook`)."""
    from ..optimizer_step import post_hooks_of_user, pre_hooks_after_own

    args: tuple[Any, ...] = (replica,)
    kwargs: dict[str, Any] = {}
    for hook in pre_hooks_after_own(optimizer):
        result = hook(replica, args, kwargs)
        if isinstance(result, tuple) and len(result) == 2:
            args, kwargs = result
    out = _raw_step(optimizer)(replica, *args[1:], **kwargs)
    post = post_hooks_of_user(optimizer)
    if post:
        stepped = list(dict.fromkeys(p for g in replica.param_groups for p in g["params"]))
        for hook in post:
            if watch is not None:
                watch.post_hook(hook, stepped)
            hook(replica, args, kwargs)
        if watch is not None:
            watch.hook = None
    return out


@contextlib.contextmanager
def _isolated(replica: torch.optim.Optimizer, stepped: dict[int, torch.Tensor],
              dtype: torch.dtype | None = None) -> Iterator[None]:
    """A replay of the update leaves nothing behind. The parameters it steps are the optimizer's own: each
    one's storage, value and gradient (the tensor and its value) are kept first and put back bit for bit
    afterwards, also when the step replaced them (``p.data = ...``, ``p.grad = None``); with ``dtype``
    they are held in that dtype for the length of the replay. The replica's state is its own copy. The RNG
    it draws from (SGLD's noise) and every other tensor it writes in place (a module's weight or buffer
    that an optimizer updates through its own reference, K-FAC's ``self.layers``) are put back; its
    warnings are not shown. Read what the replay made *inside* the block: afterwards it is gone."""
    from ..localisation.rerun import WriteGuard

    params = list(stepped.values())
    devices = sorted({t.device.index or 0 for t in params if t.device.type == "cuda"})
    kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
    guard = WriteGuard()
    try:
        with torch.no_grad():
            for p in params:
                grad = p.grad
                kept.append((p, p.data, p.detach().clone(), grad, None if grad is None else grad.detach().clone()))
                if dtype is not None and p.dtype != dtype:
                    p.data = p.data.to(dtype)
                    if grad is not None:
                        p.grad = grad.detach().to(dtype)
        for p in params:  # put back whole below: the guard need not keep them
            for t in (p, p.grad):
                if isinstance(t, torch.Tensor):
                    guard.made[t] = True
        for t in tree_leaves([dict(s) for s in replica.state.values()]):
            if isinstance(t, torch.Tensor) and id(t) not in stepped:
                guard.made[t] = True
        with torch.random.fork_rng(devices=devices), warnings.catch_warnings(), _np_errstate():
            warnings.simplefilter("ignore")
            try:
                with guard:
                    yield
            finally:
                guard.restore()
    finally:
        with torch.no_grad():
            for p, data, value, grad, grad_value in reversed(kept):
                if not _same_place(p, data):  # the step gave it other data, or the replay cast it
                    p.data = data
                data.copy_(value)
                if p.grad is not grad:
                    p.grad = grad
                if grad is not None and grad_value is not None:
                    grad.copy_(grad_value)


def _same_place(p: torch.Tensor, data: torch.Tensor) -> bool:
    """Does ``p`` still hold ``data`` (the same memory, dtype and layout)?"""
    try:
        return p.data.data_ptr() == data.data_ptr() and p.dtype == data.dtype and p.shape == data.shape \
            and p.stride() == data.stride() and p.storage_offset() == data.storage_offset()
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor subclass or layout without them
        return False


@contextlib.contextmanager
def _np_errstate() -> Iterator[None]:
    """numpy's floating-point warnings off (a setting computed in numpy that divides by zero)."""
    try:
        import numpy
    except ImportError:  # numpy is optional
        yield
        return
    with numpy.errstate(all="ignore"):
        yield


def _module_finder(watched: "Watched", clones: dict[int, torch.Tensor]) -> Callable[[Any], str | None]:
    """From a frame inside the replayed step: the watched module the optimizer's code is working on, read
    from the user's frames out to the optimizer's ``step`` (a parameter it holds, ``p``: that parameter's
    module; else a submodule it holds, K-FAC's ``m``)."""
    param_module = {id(p): n.rpartition(".")[0] for n, p in watched.root.named_parameters()}
    for original, clone in clones.items():
        if original in param_module:
            param_module[id(clone)] = param_module[original]
    modules = {id(m): n for n, m in watched.root.named_modules() if n}

    def find(frame: Any) -> str | None:
        from ..localisation.tracer import _is_library

        found_module = None
        while frame is not None:
            if not _is_library(frame.f_code.co_filename):
                values = list(frame.f_locals.values())
                for v in values:
                    if isinstance(v, torch.Tensor) and id(v) in param_module:
                        return param_module[id(v)]
                if found_module is None:
                    found_module = next((modules[id(v)] for v in values if id(v) in modules), None)
                if isinstance(frame.f_locals.get("self"), torch.optim.Optimizer):
                    break  # the optimizer's own method: the loop that called it is not its work
            frame = frame.f_back
        return found_module

    return find


def replay_update(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> UpdateReplay:
    """Replay ``param``'s update (from its current, pre-update values) under op-level checks."""
    replica, stepped = _replica(optimizer, param)
    watch = _OpWatch(lambda: replica.state.get(param, {}).items(), params=[param],
                     grads=[param.grad] if param.grad is not None else [], groups=lambda: replica.param_groups)
    with _isolated(replica, stepped):
        with watch:
            _step_replica(optimizer, replica, watch)
        made_nonfinite = _made_nonfinite(replica, param)  # read before the parameter is put back
    origin = watch.origin
    reproduced = origin is not None or made_nonfinite
    result = UpdateReplay(reproduced=reproduced, ops_replayed=watch.ops)
    if param.dtype in _LOW_PRECISION:
        result.float32_finite = _finite_in_float32(optimizer, param)
    if origin is None:
        return result
    _conclude(result, origin, watch.chain)
    if result.from_settings:
        result.settings = _blame_settings(optimizer, param)
    return result


def step_exception_incident(watched: "Watched", exc: BaseException, history: Sequence[dict[str, Any]]) -> Incident | None:
    """``optimizer.step()`` raised ``exc``: the whole step is replayed on copies (every group, its
    parameters, gradients and state cloned; anything else it writes put back) under the op checks.
    An incident (kind ``exception``, phase ``optimizer``, action ``raised``) when a value caused it:
    a decomposition whose ``info`` output reported a failure (a singular or non-positive-definite
    matrix: ``domain_error``), or a non-finite value the step made before it raised (its origin and
    cause, as for an update that went non-finite). ``None`` when the replay does not raise, or raises
    with neither (a shape, a type, a missing key: not a value's doing)."""
    optimizer = watched.optimizer
    assert optimizer is not None
    start = time.perf_counter()
    replica, stepped = _replica(optimizer, None)
    every = list(stepped.values())
    watch = _OpWatch(lambda: [(k, v) for c in every for k, v in replica.state.get(c, {}).items()],
                     params=every, grads=[p.grad for p in every if p.grad is not None],
                     module_of=_module_finder(watched, stepped), groups=lambda: replica.param_groups)
    raised: BaseException | None = None
    try:
        with _isolated(replica, stepped), watch:
            _step_replica(optimizer, replica, watch)
    except Exception as err:  # the step raising again is what the replay is for
        raised = err
    origin = watch.origin
    failed = next((f for f in watch.failed if f["finite"]), None)
    if failed is not None and origin is not None and origin["index"] < failed["index"]:
        failed = None  # a non-finite value came first: the decomposition only met it
    if raised is None or (failed is None and origin is None):
        return None
    result = UpdateReplay(reproduced=True, ops_replayed=watch.ops)
    if failed is not None:
        result.op, result.source, result.module, result.cause = failed["op"], failed["source"], failed["module"], "domain_error"
        result.denominator_state = failed["sources"][0] if failed["sources"] else None
        result.settings = _blame_settings(optimizer, None)
    else:
        _conclude(result, origin, watch.chain)  # type: ignore[arg-type]
        if result.from_settings:
            result.settings = _blame_settings(optimizer, None)
    opt = type(optimizer).__name__
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    where = f" at {result.source}" if result.source else ""
    on = f" (module '{result.module}')" if result.module else ""
    via = f", computed from the optimizer's state {result.denominator_state}" if result.denominator_state else ""
    if failed is not None:
        how = (f"{result.op}{where}{on} reported a failed decomposition (its info output is non-zero: a singular or "
               f"non-positive-definite matrix{via})")
    else:
        how = f"{result.op}{where}{on} made a non-finite value first ({result.detail or 'from finite inputs'}{via})"
    blamed = f"; moved off its value alone, {' or '.join(result.settings)} lets the step finish" if result.settings else ""
    summary = (f"optimizer.step() ({opt}) raised {type(exc).__name__} at step {watched.step}: {how}{blamed}. "
               "What the step had written was undone; the exception propagates unchanged.")
    if result.settings:
        fix = (f"The optimizer's {' and '.join(result.settings)} leaves the matrix it decomposes without "
               "regularisation: give it a positive value (damping, epsilon) at the matrix's scale, e.g. 1e-3 times "
               "its mean diagonal." if failed is not None else _settings_fix(result.settings))
    elif failed is not None:
        fix = ("Regularise the matrix before the decomposition (add damping: A + lambda*I, lambda around 1e-3 times its "
               "mean diagonal, as K-FAC and Shampoo do), or use a routine that tolerates a singular matrix "
               "(torch.linalg.pinv, lstsq, an eigendecomposition with its eigenvalues clamped): a batch with a dead "
               "(constant-zero) feature or gradient direction makes such statistics singular.")
    else:
        fix = ("Guard the operation that made the first non-finite value in the optimizer's step (an eps on its "
               "divisor, a clamp of its argument); the step raised where that value reached a check.")
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    details: dict[str, Any] = {
        "exception": f"{type(exc).__name__}: {first}",
        "optimizer": opt,
        "hyperparameters": _hyper(group),
        "ops_replayed": watch.ops,
        "localisation_seconds": round(time.perf_counter() - start, 4),
    }
    if result.settings:
        details["settings"] = result.settings
    from ..reporting import new_incident

    incident = new_incident(watched, kind="exception", phase="optimizer", module=result.module, cause=result.cause,
                            summary=summary, fix=fix, action=Action.RAISED, details=details, history=history)
    incident.op, incident.source, incident.transient = result.op, result.source, False
    incident.chain, incident.input_stats = result.chain, result.input_stats
    for item in incident.chain:
        item["module"] = result.module
    return incident


def _conclude(result: UpdateReplay, origin: dict[str, Any], chain: list[dict[str, Any]]) -> None:
    result.op, result.source, result.input_stats, result.chain = origin["op"], origin["source"], origin["stats"], chain
    states = sorted(_named(origin["bad_sources"]))
    result.denominator_state = states[0] if states else None
    result.cause, result.detail = _cause(origin, result.float32_finite)
    result.from_settings = bool(origin["bad_numbers"]) or origin["kind"] == "settings" or (
        not origin["zeros"] and bool(origin["negatives"]) and _of_settings(origin["bad_sources"]))
    result.domain_of_state = result.cause == "optimizer_state" and origin["kind"] is None and bool(origin["negatives"]) \
        and not result.from_settings
    result.module = origin.get("module")
    result.hook = origin.get("hook")


def _finite_in_float32(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool | None:
    try:
        replica, stepped = _replica(optimizer, param, torch.float32)
        with _isolated(replica, stepped, torch.float32):
            _step_replica(optimizer, replica)
            return not _made_nonfinite(replica, param)
    except Exception:  # the optimizer may insist on its own dtype: no verdict
        return None


def _made_nonfinite(replica: torch.optim.Optimizer, *params: torch.Tensor) -> bool:
    """Did the replayed step leave one of ``params`` or a tensor of its state non-finite?"""
    tensors = [t for p in params for t in (p, *tree_leaves(dict(replica.state.get(p, {})))) if isinstance(t, torch.Tensor)]
    return any(any(_nonfinite(t)) for t in tensors)


def _settings(group: dict[str, Any]) -> list[tuple[str, int | None, float]]:
    """The group's floating-point settings, one by one (``betas`` as ``betas[0]``, ``betas[1]``; one kept as
    a one-element floating-point tensor, such as a tensor learning rate, too)."""
    out: list[tuple[str, int | None, float]] = []
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, float):
            out.append((key, None, value))
        elif isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() == 1:
            out.append((key, None, float(value)))
        elif isinstance(value, tuple) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            out.extend((key, i, float(v)) for i, v in enumerate(value) if isinstance(v, float))
    return out[:_SETTINGS_CANDIDATES]


def _blame_settings(optimizer: torch.optim.Optimizer, param: torch.Tensor | None) -> list[str]:
    """The settings that alone make the update healthy when moved slightly off their value (0 to 1e-3,
    any other value by a relative 1e-3 towards 0): the replay of ``param``'s update (``None``: the whole
    step) is finite and does not raise. A counterfactual, not a guess from the names."""
    group = next((g for g in optimizer.param_groups if param is None or any(p is param for p in g["params"])), None)
    if group is None:
        return []
    blamed = []
    for key, index, value in _settings(group):
        if not math.isfinite(value):
            continue
        moved = 1e-3 if value == 0 else value * (1 - 1e-3)
        try:
            replica, stepped = _replica(optimizer, param, override=(key, index, moved))
            with _isolated(replica, stepped):
                _step_replica(optimizer, replica)
                healthy = not _made_nonfinite(replica, *stepped.values())
        except Exception:
            continue
        if healthy:
            blamed.append(f"{key}{f'[{index}]' if index is not None else ''} = {value:g}")
    return blamed


def _of_settings(sources: set[str] | frozenset[str]) -> bool:
    """A value computed from the group's settings alone: plain numbers and tensors kept among the settings."""
    return not sources - {_SETTING}


def _cause(origin: dict[str, Any], float32_finite: bool | None) -> tuple[str, str]:
    short = origin["short"]
    if origin["bad_numbers"]:  # alpha=inf: a plain number of the update, made from the settings
        named = ", ".join(f"{k} = {v:g}" for k, v in origin["bad_numbers"])
        return "optimizer_state", f"its plain-number argument {named} is not finite"
    if origin["zeros"]:
        n = origin["zeros"]
        zeros = f"{n} zero{'s' if n != 1 else ''} in the denominator"
        kind = origin["kind"]
        if kind == "normalised":
            return "zero_variance_norm", (f"{zeros}, a norm or spread of the parameter's own values over a slice where "
                                          "they are constant (all 0 for a norm)")
        if kind == "settings":
            return "optimizer_state", f"{zeros}, computed from the optimizer's settings alone (no gradient, parameter or state)"
        if kind == "state":
            return "optimizer_state", f"{zeros}, an element-wise function of the optimizer's state"
        if kind == "reduction":
            return "div_by_zero", f"{zeros}, a norm or sum of this step's update"
        return "div_by_zero", zeros
    if origin["negatives"]:
        text = f"{origin['negatives']} {'non-positive' if short in _LOGS else 'negative'} inputs"
        if _named(origin["bad_sources"]):  # a root of a statistic the optimizer keeps, left negative by rounding
            return "optimizer_state", f"{text} in a value of the optimizer's state"
        if _of_settings(origin["bad_sources"]):  # a root of a value made from the settings alone
            return "optimizer_state", f"{text}, computed from the optimizer's settings alone (no gradient, parameter or state)"
        return ("log_nonpositive" if short in _LOGS else "sqrt_negative"), text
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
        how = ("; a replay of the update from the same values stayed finite, so no op of it could be blamed"
               if not replay.reproduced
               else "; no single op of the replayed update could be named")
    else:
        via = f", computed from {replay.denominator_state}" if replay.denominator_state else ""
        where = f" in the step post-hook {replay.hook} (after the update)" if replay.hook else ""
        how = f":{where} {replay.op} made the first non-finite value ({replay.detail or 'from finite inputs'}{via})"
    bad_hyper = {k: v for k, v in _hyper(group).items() if isinstance(v, float) and not math.isfinite(v)}
    if bad_hyper:  # a scalar of the update, not a tensor: the replay's op saw only finite tensors
        named = ", ".join(f"{k} = {v}" for k, v in bad_hyper.items())
        how = f"{how}; the param group's {named}"
    eps = group.get("eps")
    dtype = _failed_param(watched, failure).dtype
    why = f"; {eps_note}" if eps_note and cause in ("div_by_zero", "optimizer_state") else ""
    spread = sorted({s["state"] for s in failure.nonfinite_state if s["param"] == failure.param_name} - {replay.denominator_state})
    also = f"; {', '.join(spread)} turned non-finite too" if spread and failure.nonfinite_params else ""
    blamed = f"; moved off its value alone, {' or '.join(replay.settings)} makes the update finite" \
        if replay.settings and not bad_hyper else ""
    summary = f"{what}{how}{blamed}{why}{also}. The update was undone before it could land."
    if bad_hyper:
        names = " and ".join(bad_hyper)
        fix = (f"The optimizer's {names} is not finite: check what sets it (a learning-rate scheduler's formula "
               "dividing by zero, e.g. total_steps == warmup_steps in a cosine schedule, or a value read from a "
               "config or a diverged schedule) and keep it finite.")
        return summary, fix
    if replay.hook and replay.op is not None:
        if cause == "zero_variance_norm":
            fix = (f"The step post-hook {replay.hook} divides the parameter by a norm or spread of its own values, "
                   "which is 0 on a slice whose values are all 0 or constant (a padding row kept at 0, a unit whose "
                   "weights are all 0): divide by the statistic clamped to a small positive floor (F.normalize's eps, "
                   "norm.clamp_min(1e-12)) or leave such slices out (the padding index).")
        else:
            fix = (f"Guard {replay.op} in the step post-hook {replay.hook} (an eps on its divisor, a clamp of its "
                   "argument): it writes the parameters after every update, so a bad value it makes lands in the "
                   "weights.")
        return summary, fix
    if replay.from_settings:
        return summary, _settings_fix(replay.settings)
    if replay.domain_of_state:
        fix = (f"The update takes a root or logarithm of a value computed from its state "
               f"{replay.denominator_state or ''} that rounding left out of the domain (the zero eigenvalues of a "
               "statistics matrix of low rank come out slightly negative): use an epsilon (damping) that dominates "
               "the rounding at the statistic's scale (e.g. 1e-6 times its largest eigenvalue, not a tiny absolute "
               "value), or clamp the values to a small positive floor before the root.")
        return summary, fix
    if eps is not None and cause in ("div_by_zero", "optimizer_state", "precision_overflow") and (
            eps_note or dtype in _LOW_PRECISION or cause == "precision_overflow"):
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


def _settings_fix(settings: list[str]) -> str:
    if settings:
        return (f"The optimizer's setting {' and '.join(settings)} makes its update non-finite (moved slightly off "
                "that value, the same update is finite): check where the value comes from (a sweep grid's end point "
                "such as beta2 = 1, an annealing schedule that reaches 0, a config) and keep it off that value.")
    return ("A value the optimizer's update computes from its settings alone (no gradient, parameter or state "
            "tensor) is 0, outside a root's domain or not finite: check the hyper-parameters for a singular value "
            "(beta2 = 1 in a bias correction 1 - beta2**t, a temperature or damping of 0) and the update rule for a "
            "guard the reference has (RAdam's rho_t > 5 before its rectification root).")


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
    # no positive cause without evidence: a replay that stayed finite (or could not run) shows no op, state
    # tensor or setting that made the update non-finite
    cause = replay.cause if replay.reproduced and replay_error is None else "unknown"
    eps = group.get("eps")
    # one eps, or several (Adafactor's (eps1, eps2)): the first its dtype cannot hold
    eps_note = next((note for e in (eps if isinstance(eps, (tuple, list)) else (eps,))
                     if isinstance(e, (int, float)) and (note := eps_problem(float(e), param.dtype))), None)
    if any(isinstance(v, float) and not math.isfinite(v) for v in _hyper(group).values()):
        cause = "optimizer_state"  # a NaN/inf learning rate or weight decay: the op only met it
    # (a zero denominator or a root's negative argument is the state's or the settings' fault by what it is
    # computed from: _OpWatch's dataflow, _cause)
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
    if cause == "unknown":
        details["missing"] = ("the replay of the update raised, so no op of it was checked" if replay_error else
                              "a replay of the update from the same parameter, gradient, state and settings stayed "
                              "finite, so no op, state tensor or setting could be shown to make it non-finite "
                              "(the real update may have read something the replay did not: another thread's or "
                              "device's write, a value changed between the step and its replay)")
    from ..reporting import new_incident

    incident = new_incident(watched, kind=kind, phase="optimizer", module=module, cause=cause, summary=summary,
                            fix=fix, action=action, details=details, history=history)
    incident.op, incident.source = replay.op, replay.source
    incident.chain, incident.input_stats = replay.chain, replay.input_stats
    incident.transient = None if replay_error else not replay.reproduced
    return incident
