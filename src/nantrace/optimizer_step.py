"""Code of the user's that runs inside ``optimizer.step()``, around the update the guard checks.

- **Step pre-hooks** (``optimizer.register_step_pre_hook``): torch runs them inside ``step()``, before the update
  and after the guard's own check when they follow it. A hook may rewrite ``p.grad`` (a row normalisation, gradient
  centralisation) or the parameters (weight standardisation) in place, so the figures the check read no longer
  bound the update: the guard's hook is put first (:func:`put_first`, so that hooks registered before ``watch()``
  also run inside the optimizer phase), and while any hook follows it (:func:`pre_hooks_after_own`, a dict length
  per step) the update is copied and checked instead of proven. ``update_replay`` runs those hooks on its replica,
  so an origin in a hook is named as the hook's op, phase ``optimizer``.
- **Global step pre-hooks** (``torch.optim.optimizer.register_optimizer_step_pre_hook``, as a tooling library
  installs them): torch runs them before every optimizer's instance hooks. The guard keeps a global hook of its own
  at the front of that dict (:func:`register_first_global`); while a user's global hook follows it
  (:func:`global_hooks_after_own`), the step is decided there instead of in the instance hook, and the user's
  global hooks count among the hooks that follow the check.
- **Step post-hooks** (``optimizer.register_step_post_hook`` and torch's global ``register_optimizer_step_post_hook``):
  torch runs them inside ``step()`` after the update, the instance hooks first, then the global ones. A hook may
  write the parameters (a unit-norm projection of embedding rows, a critic's weight clip), so while any user's
  post-hook runs in the step (:func:`user_post_hooks`: a dict length or two per step) the update is copied and
  checked after every one of them: the guard's instance post-hook is kept last among the optimizer's
  (:func:`put_last_post`), and while a user's global post-hook exists the guard ends the update from a global
  post-hook of its own kept last in torch's global dict (:func:`keep_last_global_post`). ``update_replay`` runs
  the post-hooks on its replica after the step, so an origin in a hook is named as the hook's op.
- **Closures** (``optimizer.step(closure)``): an optimizer may evaluate the closure several times per step (L-BFGS'
  iterations and line search, SAM's second pass). The guard decides the step on the first evaluation as for any
  step; each later evaluation is captured like a step and checked with one host read
  (:func:`evaluation_finite`); a non-finite one is diagnosed from its own capture, and the step is ended there
  (:class:`StepAbandoned`) and undone from the copies taken at the first evaluation.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["ClosureRun", "StepAbandoned", "evaluation_finite", "global_hooks_after_own", "in_global_chain",
           "keep_last_global_post", "own_hook", "post_hooks_of_user", "pre_hooks_after_own", "put_first",
           "put_last_post", "register_first_global", "user_post_hooks"]

_global_chain_depth = 0
"""How many of nantrace's global step pre-hooks are running (:func:`in_global_chain`): torch is iterating its
global dict then, and a hook registered into it would break that iteration."""


def own_hook(hook: Any) -> bool:
    """A step hook of nantrace's own (a method of an object that says so)."""
    return bool(getattr(getattr(hook, "__self__", None), "_nantrace_step_hooks", False))


def put_first(optimizer: torch.optim.Optimizer, handle: Any) -> None:
    """Run the step pre-hook of ``handle`` before every instance pre-hook registered so far (hooks registered
    later run after it anyway): a user's hook is then code of the optimizer's step, not of the step's code
    before it."""
    hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)
    hook_id = getattr(handle, "id", None)
    if isinstance(hooks, collections.OrderedDict) and hook_id in hooks:
        hooks.move_to_end(hook_id, last=False)


_GLOBAL_PRE_HOOKS = getattr(importlib.import_module("torch.optim.optimizer"), "_global_optimizer_pre_hooks", None)
"""Torch's process-wide step pre-hooks (an ordered dict torch keeps for the life of the process)."""


def _global_pre_hooks() -> Any:
    return _GLOBAL_PRE_HOOKS


class in_global_chain:  # noqa: N801 - used as a statement: ``with in_global_chain():``
    """Marks code run from a global step pre-hook of nantrace's (AutoWatch pairing an optimizer at its step): a
    guard opened there registers its own global hook later, from its instance hook (:func:`register_first_global`)."""

    def __enter__(self) -> None:
        global _global_chain_depth
        _global_chain_depth += 1

    def __exit__(self, *exc: Any) -> None:
        global _global_chain_depth
        _global_chain_depth -= 1


def register_first_global(hook: Callable[..., Any]) -> Any:
    """Register ``hook`` as a global step pre-hook run before every other one, and return its handle; ``None``
    while torch is iterating the global hooks (:class:`in_global_chain`): the caller tries again later."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    hooks = _global_pre_hooks()
    if _global_chain_depth or not isinstance(hooks, collections.OrderedDict):
        return None
    handle = register_optimizer_step_pre_hook(hook)
    hooks.move_to_end(handle.id, last=False)
    return handle


def global_hooks_after_own(optimizer: Any) -> list[Callable[..., Any]]:
    """The user's global step pre-hooks, when a global hook of the guard watching ``optimizer`` runs before them
    (empty when the global dict holds only nantrace's hooks: one length check per own hook)."""
    hooks = _global_pre_hooks()
    if not hooks:
        return []
    values = list(hooks.values())  # a few entries: ours, AutoWatch's, a tooling library's
    first_user = next((i for i, h in enumerate(values) if not own_hook(h)), None)
    if first_user is None:
        return []
    users = [h for h in values[first_user:] if not own_hook(h)]
    if not any(getattr(h.__self__, "optimizer", None) is optimizer for h in values[:first_user]):
        return []
    return users


def pre_hooks_after_own(optimizer: Any) -> list[Callable[..., Any]]:
    """The user's step pre-hooks that run after nantrace's own check, in torch's order: global hooks after the
    guard's global hook (:func:`global_hooks_after_own`), then instance hooks after its instance hook (empty for
    an optimizer with only nantrace's hooks: a length check or two)."""
    out = global_hooks_after_own(optimizer)
    hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)
    if not hooks or len(hooks) < 2:
        return out
    seen = bool(out)  # decided in the global hook: every instance hook follows the check
    for hook in list(hooks.values()):
        if own_hook(hook):
            seen = True
        elif seen:
            out.append(hook)
    return out


_GLOBAL_POST_HOOKS = getattr(importlib.import_module("torch.optim.optimizer"), "_global_optimizer_post_hooks", None)
"""Torch's process-wide step post-hooks (an ordered dict, run after every optimizer's own post-hooks)."""
_own_global_posts: set[int] = set()
"""Ids of nantrace's own entries in :data:`_GLOBAL_POST_HOOKS` (registered only while a user's global post-hook
exists): a user's global post-hook exists while the dict is longer than this set."""


def user_post_hooks(optimizer: Any) -> tuple[list[Callable[..., Any]], list[Callable[..., Any]]]:
    """The user's step post-hooks of an optimizer a guard watches (instance ones, then global ones, each in torch's
    order); with only nantrace's hooks registered (the guard's own instance post-hook, nantrace's global ones), two
    length checks per step."""
    hooks = getattr(optimizer, "_optimizer_step_post_hooks", None)
    instance = [h for h in hooks.values() if not own_hook(h)] if hooks and len(hooks) > 1 else []
    glob = _GLOBAL_POST_HOOKS
    globals_ = [h for h in glob.values() if not own_hook(h)] if glob and len(glob) > len(_own_global_posts) else []
    return instance, globals_


def post_hooks_of_user(optimizer: Any) -> list[Callable[..., Any]]:
    """Every user's step post-hook that runs after ``optimizer``'s update, in torch's order (instance ones, then
    global ones): what a replay of the step runs after it (a full scan, for an optimizer watched or not)."""
    hooks = getattr(optimizer, "_optimizer_step_post_hooks", None) or {}
    return [h for h in (*hooks.values(), *(_GLOBAL_POST_HOOKS or {}).values()) if not own_hook(h)]


def put_last_post(optimizer: torch.optim.Optimizer, handle: Any) -> None:
    """Run the step post-hook of ``handle`` after every other instance post-hook of ``optimizer`` (called before the
    step's update, while torch iterates the pre-hooks, never the post-hooks: a no-op when it is last already)."""
    hooks = getattr(optimizer, "_optimizer_step_post_hooks", None)
    hook_id = getattr(handle, "id", None)
    if isinstance(hooks, collections.OrderedDict) and hook_id in hooks and next(reversed(hooks)) != hook_id:
        hooks.move_to_end(hook_id)


class _OwnGlobalPost:
    """The handle of a global step post-hook of nantrace's (counted in :data:`_own_global_posts`)."""

    def __init__(self, handle: Any) -> None:
        self.handle, self.id = handle, handle.id
        _own_global_posts.add(self.id)

    def remove(self) -> None:
        _own_global_posts.discard(self.id)
        self.handle.remove()


def keep_last_global_post(hook: Callable[..., Any], handle: Any) -> Any:
    """Register ``hook`` as a global step post-hook (``handle`` ``None``) or move it to the end of torch's global
    post-hooks, so that it runs after every user's one; returns its handle (``None`` when torch keeps no ordered
    dict). Called before the step's update, while torch iterates the pre-hooks, never the post-hooks."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    hooks = _GLOBAL_POST_HOOKS
    if not isinstance(hooks, collections.OrderedDict):
        return None
    if handle is None or handle.id not in hooks:
        handle = _OwnGlobalPost(register_optimizer_step_post_hook(hook))
    elif next(reversed(hooks)) != handle.id:
        hooks.move_to_end(handle.id)
    return handle


class StepAbandoned(Exception):
    """Raised by nantrace's closure wrapper inside ``optimizer.step()``: a later evaluation of the closure was
    non-finite, the step is ended there (the guard swallows it once the step is undone and booked).
    ``step_result`` is what ``step(closure)`` then returns: the first evaluation's result, as L-BFGS returns
    (a script's ``loss = optimizer.step(closure); loss.item()`` goes on)."""

    def __init__(self, message: str, step_result: Any = None) -> None:
        super().__init__(message)
        self.step_result = step_result


@dataclasses.dataclass
class ClosureRun:
    """One ``optimizer.step(closure)`` call: how often the closure ran, and whether the step was ended."""

    calls: int = 0
    stopped: bool = False
    """A blocked evaluation ended the step: later calls of the closure return ``result`` without running it."""
    result: Any = None
    first: Any = None
    """The first evaluation's result (what the step returns when a later evaluation ends it)."""
    snapshot: bool = False
    """The parameters and optimizer state were copied at the first evaluation for a blocked step (undone after it)."""


def evaluation_finite(result: Any, params: Iterable[torch.Tensor]) -> bool:
    """Are a closure evaluation's loss and gradients finite? One host read (a fused check of the loss and the
    gradients' norms); a norm that overflows reads as non-finite (the caller's full check then decides)."""
    parts: list[torch.Tensor] = []
    if isinstance(result, torch.Tensor):
        if result.is_floating_point() or result.is_complex():
            parts.append(result.detach().abs().float().sum().reshape(1))
    elif isinstance(result, (int, float)) and not math.isfinite(float(result)):
        return False
    grads = [p.grad for p in params if isinstance(p.grad, torch.Tensor)]
    dense = [g.detach() for g in grads if g.layout == torch.strided]
    if dense:
        try:
            norms = list(torch._foreach_norm(dense, 2))
        except (RuntimeError, TypeError):
            norms = [torch.linalg.vector_norm(g) for g in dense]
        parts.extend(n.float().reshape(1) for n in norms)
    parts.extend(torch.linalg.vector_norm(g.coalesce().values()).float().reshape(1) for g in grads
                 if g.layout != torch.strided)
    if not parts:
        return True
    device = parts[0].device
    return bool(torch.isfinite(torch.cat([t.to(device) for t in parts])).all())  # the evaluation's one host read
