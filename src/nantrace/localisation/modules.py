"""Which module is running: a stack kept by forward pre/post hooks, installed only for a replay."""

from __future__ import annotations

from typing import Any

from torch import nn


class ModuleStack:
    """Tracks the innermost running submodule of ``root`` by its dotted path."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self._stack: list[str] = []
        self._handles: list[Any] = []

    @property
    def current(self) -> str | None:
        """Dotted path of the innermost running module (``""`` = root), ``None`` outside the model."""
        return self._stack[-1] if self._stack else None

    def __enter__(self) -> "ModuleStack":
        for name, module in self.root.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._push(name)))
            self._handles.append(module.register_forward_hook(self._pop(name), always_call=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()

    def _push(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(name)

        return hook

    def _pop(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._stack and self._stack[-1] == name:
                self._stack.pop()
            elif name in self._stack:
                del self._stack[len(self._stack) - 1 - self._stack[::-1].index(name)]

        return hook
