"""The optimizer phase: an update that makes a parameter or the optimizer state non-finite is
caught at the step that made it, and undone bit for bit.

The guard checks gradients, loss and parameters *before* ``optimizer.step()``; this module
covers the update itself. Per parameter group, before the update:

- **proven**: the update rule is known and its interval bound stays far from the dtype's
  range (:func:`~nantrace.response.update_bounds.update_risk`, from figures the step's check
  has already read): nothing is copied, nothing is read after the update;
- **not proven** (a custom, LARS/LAMB-style optimizer, float16 state, an eps the state's dtype
  cannot hold, state loaded from elsewhere): the group's parameters and optimizer state are
  copied into reused buffers (one ``_foreach_copy_``) and, after the update, checked with one
  fused reduction and one host read. A non-finite result is undone from the copies, in place,
  state dict keys included.

The verdict right after each update (:attr:`UpdateCheck.finite_after_update`) is what tells an
optimizer-made failure (phase ``optimizer``, here) from a parameter that turned non-finite
between steps (a checkpoint loaded mid-run, an in-place write: ``nonfinite_param`` with phase
``None``, at the next step's check).

Usage::

    check = UpdateCheck(optimizer, params, names)
    check.before_update(grad_norm=9.1, param_norm=120.0)   # in the step pre-hook, update allowed
    optimizer.step()
    failure = check.after_update()                          # in the step post-hook
    if failure is not None:                                 # already undone; evidence inside
        print(failure.param_name, failure.nonfinite_state)
"""

from __future__ import annotations

import copy
import dataclasses
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .update_bounds import StateBound, next_state_bound, param_bound_after, update_risk

__all__ = ["UpdateCheck", "UpdateFailure"]


@dataclasses.dataclass
class UpdateFailure:
    """What a checked update made non-finite (already undone when this is returned)."""

    param_index: int
    """Index (in the guard's parameter list) of the first parameter whose update went bad."""
    param_name: str
    nonfinite_params: list[dict[str, Any]]
    nonfinite_state: list[dict[str, Any]]
    """``{"param", "state", "nan", "inf", "numel", "shape"}`` per non-finite state tensor."""
    unproven: list[str]
    """Why the update was checked (one reason per parameter group that was not proven)."""
    param: torch.Tensor | None = None
    """That parameter itself (also when it is not among the guard's: added by ``add_param_group``)."""


@dataclasses.dataclass
class _Saved:
    """One parameter's pre-update values: the tensor, its state dict's layout and copies."""

    param: torch.Tensor
    index: int
    state: dict[Any, Any] | None
    """The state dict's entries before the update (tensors: the live object), ``None`` if absent."""
    grad: torch.Tensor | None = None
    """Its gradient before the update, when the gradients are copied too (``before_update(grads=True)``)."""


def _counts(name: str, t: torch.Tensor) -> dict[str, Any]:
    t = t.detach()
    return {"name": name, "nan": int(torch.isnan(t).sum()), "inf": int(torch.isinf(t).sum()),
            "numel": t.numel(), "shape": list(t.shape)}


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _norms(tensors: list[torch.Tensor]) -> list[float]:
    """Per-tensor float32 L2 norms, one host read (NaN/Inf propagate)."""
    if not tensors:
        return []
    try:
        norms = list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    except (RuntimeError, TypeError):
        norms = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]
    device = norms[0].device
    return torch.stack([n.to(device) for n in norms]).tolist()  # the update check's one host read


class UpdateCheck:
    """Checks the optimizer updates that cannot be proven finite; undoes a bad one.

    ``params``/``names`` are the guard's parameter list and names (for indices and reports).
    Installs one hook (``optimizer.register_load_state_dict_post_hook``: loaded state is not
    trusted until checked once); :meth:`close` removes it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], names: list[str],
                 *, enabled: bool = True, model_names: dict[int, str] | None = None) -> None:
        self.optimizer = optimizer
        self.enabled = enabled
        self._index = {id(p): i for i, p in enumerate(params)}
        self._names = names
        self._model_names = model_names or {}
        """``id`` -> name of every parameter of the model, for one the optimizer got after ``watch()``."""
        self._unwatched: dict[tuple[int, int], bool] = {}
        """(group id, its parameter count) -> it holds a parameter the guard does not watch."""
        self.bound = StateBound.for_optimizer(optimizer)
        self._saved: list[_Saved] = []
        self._with_grads = False
        self._copies: list[torch.Tensor] = []
        self._sources: list[torch.Tensor] = []
        self._pool: dict[tuple[int, torch.Size, torch.dtype, torch.device], torch.Tensor] = {}
        self._proven: list[tuple[dict[str, Any], float, float]] = []
        self._reasons: list[str] = []
        self._armed = False
        self.finite_after_update: bool | None = None
        """Parameters and state right after the last update: True when proven or checked finite,
        False when it was undone, None before any update (or when checking is off)."""
        self.last_reasons: list[str] = []
        """Why the last update was checked (empty: every group was proven)."""
        self.param_bound: float | None = None
        """An upper bound of every parameter element right after the last update (the proven groups'
        interval bound, the checked groups' measured norms, the bound given for the parameters the
        update did not touch); ``None`` when unknown (no update yet, an undone one, checking off)."""
        self._param_in: float | None = None
        self._param_after = 0.0
        self._handle = optimizer.register_load_state_dict_post_hook(self._state_loaded) if enabled else None
        self._groups: list[tuple[dict[str, Any], dict[str, Any]]] = []
        """Each param group and its numeric settings before the update (a learned learning rate that
        ``step()`` itself writes, SGD-HD's; a step counter): undone with the parameters."""
        self.on_raise: Callable[[torch.optim.Optimizer, Exception], bool] | None = None
        """Called with an exception that escapes ``optimizer.step()`` (set by the guard); ``True``
        swallows it. The step is wrapped on the instance for this (there is no hook for a step that
        raises: torch runs the post-hooks only after a step that returned)."""
        self._step_patch = _wrap_step(self, optimizer)

    # ------------------------------------------------------------------ before
    def before_update(self, *, grad_norm: float | None, param_norm: float | None, unproven: str | None = None,
                      grads: bool = False) -> None:
        """Decide per group (proven, or copy for a check); called right before an allowed update.

        ``unproven`` (a reason) checks every group whatever the bounds say: code of the step that runs after
        this call (a user's step pre-hook, a closure the optimizer evaluates again) may change what the
        bounds were read from. ``grads`` copies the gradients too, and an undo puts them back."""
        self._armed = False
        if not self.enabled:
            return
        self._with_grads = grads
        self._saved, self._sources, self._proven, self._reasons = [], [], [], []
        self.param_bound, self._param_in, self._param_after = None, param_norm, 0.0
        state_bound = self.bound.value
        for group in self.optimizer.param_groups:
            unwatched = self._holds_unwatched(group)
            after = None if unwatched or unproven else \
                param_bound_after(self.optimizer, group, grad=grad_norm, param=param_norm, state=state_bound)
            if after is not None:
                self._proven.append((group, grad_norm or 0.0, param_norm or 0.0))
                self._param_after = max(self._param_after, after)
                continue
            reason = unproven if unproven else \
                "the group holds parameters added after watch() (add_param_group): the step's gradient " \
                "norm does not cover them" if unwatched else \
                update_risk(self.optimizer, group, grad=grad_norm, param=param_norm, state=state_bound)
            self._reasons.append(reason or "the update could not be bounded")
            for p in group["params"]:
                self._save(p)
        if self._reasons:  # a failed update is undone whole: the proven groups' parameters are copied too
            for group, _, _ in self._proven:
                for p in group["params"]:
                    self._save(p)
        self._groups = [(g, _numeric_settings(g)) for g in self.optimizer.param_groups] if self._saved else []
        pool, self._pool = self._pool, {}  # only this step's buffers stay (none when all is proven)
        self._copies = [self._buffer(pool, i, t) for i, t in enumerate(self._sources)]
        if self._copies:
            torch._foreach_copy_(self._copies, self._sources)
        self._armed = True

    def _holds_unwatched(self, group: dict[str, Any]) -> bool:
        """Whether ``group`` holds a parameter the guard did not watch (cached per group and size: one
        scan when a group appears or grows, none per step)."""
        key = (id(group), len(group["params"]))
        found = self._unwatched.get(key)
        if found is None:
            found = self._unwatched[key] = any(id(p) not in self._index for p in group["params"])
        return found

    # ------------------------------------------------------------------ sync-free mode
    def proven(self, *, grad: float, param: float) -> bool:
        """Every group's update is proven finite for gradient and parameter norms up to these
        (the bounds are monotone in both), from the state bound as it is now."""
        if not self.enabled:
            return True
        state_bound = self.bound.value
        return all(update_risk(self.optimizer, group, grad=grad, param=param, state=state_bound) is None
                   for group in self.optimizer.param_groups)

    def proof_key(self) -> tuple[Any, ...]:
        """What :meth:`proven` depends on besides the norms (a cache key)."""
        return (self.bound.value, tuple((id(g), str(g.get("lr")), str(g.get("weight_decay")), len(g["params"]))
                                        for g in self.optimizer.param_groups))

    def account(self, *, grad: float | None, param: float | None) -> None:
        """An update proven finite beforehand has landed (decided on the device): advance the state
        bound exactly as :meth:`after_update` does for proven groups, with the step's own figures."""
        if not self.enabled or grad is None or param is None:
            return
        state_bound = self.bound.value
        after = param
        for group in self.optimizer.param_groups:
            bound = param_bound_after(self.optimizer, group, grad=grad, param=param, state=state_bound)
            after = max(after, bound if bound is not None else math.inf)
            state_bound = next_state_bound(self.optimizer, group, grad=grad, param=param, state=state_bound or 0.0)
        self.bound.value = state_bound
        self.param_bound = after if math.isfinite(after) else None
        self.finite_after_update = True

    def _save(self, p: torch.Tensor) -> None:
        state = self.optimizer.state.get(p)
        saved = _Saved(p, self._index.get(id(p), -1), None if state is None else dict(state))
        self._sources.append(p.detach())
        if self._with_grads and isinstance(p.grad, torch.Tensor) and p.grad.layout == torch.strided:
            saved.grad = p.grad
            self._sources.append(p.grad.detach())
        if saved.state is not None:
            for key, value in saved.state.items():
                if isinstance(value, torch.Tensor):
                    self._sources.append(value.detach())
                else:
                    saved.state[key] = copy.deepcopy(value)
        self._saved.append(saved)

    def _buffer(self, pool: dict[Any, torch.Tensor], slot: int, t: torch.Tensor) -> torch.Tensor:
        """A copy buffer for source ``slot``, reused from the last step when its layout still fits."""
        key = (slot, t.shape, t.dtype, t.device)
        buf = pool.get(key)
        if buf is None:
            buf = torch.empty_like(t, memory_format=torch.contiguous_format)
        self._pool[key] = buf
        return buf

    # ------------------------------------------------------------------ after
    def after_update(self) -> UpdateFailure | None:
        """Check the copied groups after the update (one host read); undo and report a bad one."""
        if not self._armed:
            self.param_bound = None  # an update nothing bounded beforehand
            return None
        self._armed = False
        self.last_reasons = self._reasons
        state_bound = self.bound.value
        for group, grad, param in self._proven:
            state_bound = next_state_bound(self.optimizer, group, grad=grad, param=param, state=state_bound or 0.0)
        untouched = self._param_in if self._param_in is not None and math.isfinite(self._param_in) else None
        if not self._saved:
            self.bound.value = state_bound
            self.finite_after_update = True
            self.param_bound = None if untouched is None else max(untouched, self._param_after)
            return None
        params = [s.param.detach() for s in self._saved]
        state = [(s, key, t.detach()) for s in self._saved for key, t in self.optimizer.state.get(s.param, {}).items()
                 if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]
        norms = _norms(params + [t for _, _, t in state])
        bad = [not math.isfinite(n) and not _finite(t) for n, t in zip(norms, params + [t for _, _, t in state])]
        if not any(bad):
            self.finite_after_update = True
            self.param_bound = None if untouched is None else max([untouched, self._param_after, *norms[:len(params)]])
            measured = [n for n, (_, _, t) in zip(norms[len(params):], state) if t.dim() > 0]
            self.bound.from_norms(measured)
            if state_bound is not None and self.bound.value is not None:
                self.bound.value = max(self.bound.value, state_bound)
            return None
        failure = self._failure(bad[:len(params)], [st for st, b in zip(state, bad[len(params):]) if b])
        self.undo()
        self.finite_after_update = False
        return failure

    def _failure(self, bad_params: list[bool], bad_state: list[tuple[_Saved, Any, torch.Tensor]]) -> UpdateFailure:
        nonfinite_params = [_counts(self._name(s), s.param) for s, b in zip(self._saved, bad_params) if b]
        nonfinite_state = []
        for saved, key, t in bad_state:
            entry = _counts(self._name(saved), t)
            nonfinite_state.append({"param": entry.pop("name"), "state": str(key), **entry})
        first = next(s for s, b in zip(self._saved, bad_params) if b) if any(bad_params) else bad_state[0][0]
        return UpdateFailure(first.index, self._name(first), nonfinite_params, nonfinite_state, list(self._reasons),
                             param=first.param)

    def _name(self, saved: _Saved) -> str:
        if 0 <= saved.index < len(self._names):
            return self._names[saved.index]
        return self._model_names.get(id(saved.param), f"param[{saved.index}]")

    def undo(self) -> None:
        """Put the copied parameters, optimizer state and the groups' numeric settings back as they were
        before the update."""
        it = iter(self._copies)
        for group, settings in self._groups:
            for key, value in settings.items():
                if isinstance(value, torch.Tensor) and isinstance(group.get(key), torch.Tensor) \
                        and group[key].shape == value.shape:
                    with torch.no_grad():
                        group[key].copy_(value)
                else:
                    group[key] = value
        with torch.no_grad():
            for saved in self._saved:
                saved.param.copy_(next(it))
                if saved.grad is not None:  # the step's code may have replaced the gradient or written into it
                    if saved.param.grad is not saved.grad:
                        saved.param.grad = saved.grad
                    saved.grad.copy_(next(it))
                if saved.state is None:
                    self.optimizer.state.pop(saved.param, None)
                    continue
                restored = {}
                for key, value in saved.state.items():
                    if isinstance(value, torch.Tensor):
                        value.copy_(next(it))
                        restored[key] = value
                    else:
                        restored[key] = copy.deepcopy(value)
                self.optimizer.state[saved.param] = restored

    def abandon(self, *, undo: bool = True) -> bool:
        """``step()`` raised before it finished, or was ended: undo what it had written (when the update was
        copied beforehand); ``True`` when it was. ``undo=False`` only forgets the copies (a rollback has put
        an older state back)."""
        if not self._armed:
            return False
        self._armed = False
        self.param_bound = None
        if not self._saved or not undo:
            return False
        self.undo()
        self.finite_after_update = None
        return True

    # ------------------------------------------------------------------ housekeeping
    def _state_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        self.bound.value = None  # loaded state is trusted only after one checked update

    @property
    def held_bytes(self) -> int:
        """Memory held by the copies (0 while every update is proven)."""
        return sum(b.numel() * b.element_size() for b in self._pool.values())

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.on_raise = None
        if self._step_patch is not None:
            self._step_patch.remove()
            self._step_patch = None
        self._groups = []
        self._pool.clear()
        self._copies, self._saved, self._sources = [], [], []
        self._armed = False


def _numeric_settings(group: dict[str, Any]) -> dict[str, Any]:
    """A group's numbers (tuples of numbers, one-element tensors cloned): what a step may write into it."""
    out: dict[str, Any] = {}
    for key, value in group.items():
        if key == "params" or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) or (
                isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value)):
            out[key] = value
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = value.detach().clone()
    return out


def _wrap_step(check: UpdateCheck, optimizer: torch.optim.Optimizer) -> Any:
    """Wrap ``optimizer.step`` on the instance so that an exception escaping it reaches
    ``check.on_raise`` (which may swallow it). The wrapper passes calls through once the check is
    closed or gone; ``.remove()`` of the returned patch puts the original back while the wrapper is
    still what the optimizer holds (an LR scheduler made later wraps it in turn)."""
    from ..patches import patch_attribute

    inner = optimizer.step
    check_ref = weakref.ref(check)

    def step(*args: Any, **kwargs: Any) -> Any:
        try:
            return inner(*args, **kwargs)
        except Exception as exc:
            owner = check_ref()
            handler = owner.on_raise if owner is not None else None
            if handler is not None and handler(owner.optimizer, exc):  # type: ignore[union-attr]
                return getattr(exc, "step_result", None)  # what the step returns once ended (a closure's loss)
            raise

    step.__name__ = step.__qualname__ = "step"
    step.__doc__ = getattr(inner, "__doc__", None)
    # what others marked on the step they wrapped stays visible (an LR scheduler made before watch() checks
    # its ``_wrapped_by_lr_sched``); one made after re-binds ``optimizer.step.__func__`` (patch_track_step_called)
    step.__dict__.update(getattr(inner, "__dict__", {}))
    step.__wrapped__ = inner  # type: ignore[attr-defined]
    step.__func__ = lambda opt, *args, **kwargs: step(*args, **kwargs)  # type: ignore[attr-defined]
    from .._user_traceback import HIDDEN_CODES

    HIDDEN_CODES.add(step.__code__)  # the user's traceback and the host-read counter see the optimizer's own frames
    return patch_attribute(optimizer, "step", step, purpose="the guard sees an exception escaping optimizer.step()")
