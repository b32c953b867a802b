"""Precision fallback: after repeated fp16/bf16 overflows in one module, run that module
outside autocast, in float32, for the rest of the run (and say so in the incident)."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import torch
from torch import nn


def _upcast(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in (torch.float16, torch.bfloat16) else obj
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_upcast(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _upcast(v) for k, v in obj.items()}
    return obj


class PrecisionFallback:
    """Counts ``precision_overflow`` incidents per module; past ``after``, pins the module to float32.

    Only autocast regions can fall back this way: a module whose parameters are themselves
    float16/bfloat16 would need its optimizer state converted too, so it is reported, not changed.
    """

    def __init__(self, root: nn.Module, after: int) -> None:
        self.root = root
        self.after = after
        self.counts: Counter[str] = Counter()
        self.pinned: list[str] = []
        self._handles: list[Any] = []
        self._stacks: dict[int, list[contextlib.ExitStack]] = {}

    def record(self, module: str) -> str | None:
        """Count an overflow in ``module``; returns a note for the incident when it falls back now."""
        if self.after <= 0 or module in self.pinned:
            return None
        self.counts[module] += 1
        if self.counts[module] < self.after:
            return None
        target = self.root.get_submodule(module) if module else self.root
        if any(p.dtype in (torch.float16, torch.bfloat16) for p in target.parameters()):
            return (f"module '{module}' overflowed {self.counts[module]} times but holds float16/bfloat16 "
                    "parameters, so it cannot be moved to float32 automatically")
        self._pin(target)
        self.pinned.append(module)
        return (f"after {self.counts[module]} float16/bfloat16 overflows, nantrace now runs module "
                f"'{module}' in float32 outside autocast for the rest of the run")

    def _pin(self, module: nn.Module) -> None:
        key = id(module)
        self._stacks[key] = []

        def enter(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
            stack = contextlib.ExitStack()
            stack.enter_context(torch.autocast("cpu", enabled=False))
            if torch.cuda.is_available():
                stack.enter_context(torch.autocast("cuda", enabled=False))
            self._stacks[key].append(stack)
            return _upcast(args), _upcast(kwargs)

        def leave(mod: nn.Module, args: Any, output: Any) -> None:
            if self._stacks[key]:
                self._stacks[key].pop().close()

        self._handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        self._handles.append(module.register_forward_hook(leave, always_call=True))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for stacks in self._stacks.values():
            while stacks:
                stacks.pop().close()
