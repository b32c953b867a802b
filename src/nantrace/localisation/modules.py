"""Which module is running: a stack kept by process-wide forward pre/post hooks, installed only for a replay.

The hooks are torch's global module hooks (``register_module_forward_pre_hook`` /
``register_module_forward_hook``), filtered by identity to the watched model's modules: nothing is put on
a user's module that carries no forward hook, so a module that looks at its own hooks
(``nn.TransformerEncoderLayer`` leaves its fused inference path when it or a sublayer is hooked:
:mod:`nantrace.module_hooks`) computes in the replay what it computed in the real step. torch runs the global
forward hooks before a module's own: a module that already carries forward hooks (the user's: a penalty computed
on its output) gets one more, last, that ends it, so the code of its own hooks runs inside it, as it does in
``Module.__call__``. A hook more on a module that has hooks changes no fused-path decision (they ask whether
there are any).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from ..patches import patch_attribute


class ModuleStack:
    """Tracks the innermost running submodule of ``root`` by its dotted path."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self._stack: list[str] = []
        self._handles: list[Any] = []
        self._names: dict[int, tuple[nn.Module, str]] = {}
        self._hook_owners: list[str | None] = []
        self._register_hook: Any = None
        self._ended_by_own_hook: set[int] = set()
        """``id`` of the modules whose end a hook of their own, after the user's forward hooks, records."""

    @property
    def in_hook(self) -> bool:
        """Whether a tensor hook registered during the replay is running (its owner: :attr:`hook_owner`)."""
        return bool(self._hook_owners)

    @property
    def hook_owner(self) -> str | None:
        """The module that was running when the running hook was registered (``None``: the step's own code
        outside the model, e.g. a loss function hooking the model's output)."""
        return self._hook_owners[-1] if self._hook_owners else None

    def owned_hook(self, hook: Callable[..., Any], owner: str | None) -> Callable[..., Any]:
        """``hook`` marked, while it runs, as registered by ``owner``."""
        @functools.wraps(hook)
        def run(*args: Any, **kwargs: Any) -> Any:
            self._hook_owners.append(owner)
            try:
                return hook(*args, **kwargs)
            finally:
                self._hook_owners.pop()
        return run

    @property
    def current(self) -> str | None:
        """Dotted path of the innermost running module (``""`` = root), ``None`` outside the model."""
        return self._stack[-1] if self._stack else None

    def __enter__(self) -> "ModuleStack":
        # named_modules() names a module shared under two paths by its first one, as before.
        self._names = {id(module): (module, name) for name, module in self.root.named_modules()}
        self._handles = [torch_module.register_module_forward_pre_hook(self._pre),
                         torch_module.register_module_forward_hook(self._post, always_call=True)]
        for module, _ in self._names.values():
            if module._forward_hooks:  # the user's forward hooks run after the global ones: end it after them
                self._handles.append(module.register_forward_hook(self._own_post, always_call=True))
                self._ended_by_own_hook.add(id(module))
        # a tensor hook belongs to the code that registered it, not to the module whose output it hooks
        original = torch.Tensor.register_hook
        stack = self

        def register_hook(tensor: torch.Tensor, hook: Callable[..., Any]) -> Any:
            if stack._register_hook is None:  # left in another patch's chain after the replay: pass through
                return original(tensor, hook)
            return original(tensor, stack.owned_hook(hook, stack.current))

        self._register_hook = patch_attribute(torch.Tensor, "register_hook", register_hook,
                                              purpose="a replay marks each tensor hook with the module that registered it")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._register_hook is not None:
            self._register_hook.remove()
            self._register_hook = None
        self._hook_owners.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()
        self._names = {}
        self._ended_by_own_hook.clear()

    def _name(self, module: nn.Module) -> str | None:
        """The dotted path of ``module`` when it is one of the root's modules (identity, not a reused ``id``)."""
        entry = self._names.get(id(module))
        return entry[1] if entry is not None and entry[0] is module else None

    def _pre(self, module: nn.Module, args: Any) -> None:
        """A module of the root begins its forward: it is the innermost running one."""
        name = self._name(module)
        if name is not None:
            self._stack.append(name)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        """A module of the root ended its forward (or raised: the hook is always called): take it off the
        stack, from the top or, when an inner one never ended, from where it is."""
        if id(module) in self._ended_by_own_hook:  # its own forward hooks are still to run: _own_post ends it
            return
        self._end(module)

    def _own_post(self, module: nn.Module, args: Any, output: Any) -> None:
        """A module that carries forward hooks ended its forward and ran them (or raised: always called)."""
        self._end(module)

    def _end(self, module: nn.Module) -> None:
        name = self._name(module)
        if name is None:
            return
        if self._stack and self._stack[-1] == name:
            self._stack.pop()
        elif name in self._stack:
            del self._stack[len(self._stack) - 1 - self._stack[::-1].index(name)]
