"""A slow, obviously-correct reference for the localiser, sharing no code with it.

It trains a scenario without nantrace and, for every step, records in execution order:

* every forward ATen op (a small ``TorchDispatchMode``): its name, the innermost module
  running (forward pre/post hooks), the user's source line, whether all its floating-point
  inputs were finite, whether its output was, and whether it had an explicit non-finite
  Python scalar argument (``masked_fill(mask, -inf)``);
* every autograd node run by ``backward()`` (``Node.register_hook``): whether the gradients
  it received were finite and whether those it produced were, attributed to the forward op
  whose output carries that node as ``grad_fn``.

At the first step whose loss or gradients are non-finite it applies the textbook rule: the
origin is the first event whose inputs were all finite and whose output was not, skipping
explicit fills (an op whose only non-finite output came from an inf scalar argument, without
NaN). No provenance, no dataflow, no precision re-run: where an intentional mask feeds a later
NaN (a fully masked softmax) the rule finds nothing, and the scenarios say so.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import scenarios

_TORCH = os.path.dirname(torch.__file__) + os.sep
_THIS = os.path.abspath(__file__)


@dataclasses.dataclass
class Event:
    phase: str
    op: str
    module: str | None
    source: str | None
    inputs_finite: bool
    output_finite: bool
    output_nan: bool
    inf_scalar: bool


@dataclasses.dataclass
class Finding:
    step: int
    event: Event | None
    """``None``: the step failed but no event satisfies the textbook rule."""


def _floats(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]


def _finite(ts: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


def _source() -> str | None:
    frame = sys._getframe(2)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(_TORCH) and name != _THIS and "nantrace" not in name.split(os.sep) and not name.startswith("<"):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return None


class _Modules:
    """Innermost running module of ``root``, by hooks installed for one step."""

    def __init__(self, root: nn.Module) -> None:
        self.stack: list[str] = []
        self.handles = []
        for name, m in root.named_modules():
            self.handles.append(m.register_forward_pre_hook(self._enter(name)))
            self.handles.append(m.register_forward_hook(self._exit, always_call=True))

    def _enter(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self.stack.append(name)

        return hook

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.stack.pop()

    def current(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _ForwardRecorder(TorchDispatchMode):
    def __init__(self, modules: _Modules) -> None:
        super().__init__()
        self.modules = modules
        self.events: list[Event] = []
        self.outputs: list[tuple[torch.Tensor, Event]] = []
        self.node_event: dict[Any, Event] = {}
        self._unresolved: list[tuple[torch.Tensor, Event]] = []

    def resolve(self) -> None:
        # grad_fn is attached after the kernel returns, so outputs are linked at the next op.
        for t, event in self._unresolved:
            if t.grad_fn is not None and t.grad_fn not in self.node_event:
                self.node_event[t.grad_fn] = event
        self._unresolved = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.resolve()
        out = func(*args, **kwargs)
        outs = _floats(out)
        if not outs:
            return out
        event = Event(
            phase="forward",
            op=f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}",
            module=self.modules.current(),
            source=_source(),
            inputs_finite=_finite(_floats((args, kwargs))),
            output_finite=_finite(outs),
            output_nan=any(bool(torch.isnan(t).any()) for t in outs),
            inf_scalar=any(isinstance(a, (int, float)) and not isinstance(a, bool) and not math.isfinite(a)
                           for a in tree_leaves((args, kwargs))),
        )
        self.events.append(event)
        self._unresolved.extend((t, event) for t in outs)
        return out


def _graph_nodes(roots: list[Any]) -> list[Any]:
    seen, out, todo = set(), [], list(roots)
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        out.append(node)
        todo.extend(n for n, _ in node.next_functions)
    return out


def _backward_events(loss: torch.Tensor, node_event: dict[Any, Event], scaler: Any) -> tuple[list[Event], list[Any]]:
    events: list[Event] = []
    handles = []

    def hook_for(node: Any) -> Any:
        def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
            fwd = node_event.get(node)
            received = [g for g in grad_outputs if g is not None and g.is_floating_point()]
            produced = [g for g in grad_inputs if g is not None and g.is_floating_point()]
            events.append(Event(
                phase="backward",
                op=fwd.op if fwd else node.name(),
                module=fwd.module if fwd else None,
                source=fwd.source if fwd else None,
                inputs_finite=_finite(received),
                output_finite=_finite(produced),
                output_nan=any(bool(torch.isnan(g).any()) for g in produced),
                inf_scalar=False,
            ))

        return hook

    for node in _graph_nodes([loss.grad_fn]):
        handles.append(node.register_hook(hook_for(node)))
    try:
        (scaler.scale(loss) if scaler is not None else loss).backward()
    finally:
        for h in handles:
            h.remove()
    return events, handles


def textbook_origin(events: list[Event]) -> Event | None:
    """The first event whose inputs were all finite and whose output was not (fills skipped)."""
    for e in events:
        if e.inputs_finite and not e.output_finite:
            if e.inf_scalar and not e.output_nan:
                continue  # an explicit -inf/inf fill: a mask, made on purpose
            return e
    return None


def find(scn: scenarios.Scenario) -> Finding | None:
    """Train ``scn`` without nantrace; at its first failing step, the textbook origin."""
    setup = scenarios.build(scn)
    root = getattr(setup.model, "_orig_mod", setup.model)
    params = [p for p in root.parameters() if p.requires_grad]
    with torch.compiler.set_stance("force_eager"):
        for step, batch in enumerate(setup.batches):
            setup.optimizer.zero_grad()
            if not _finite([p.detach() for p in params]):
                return Finding(step, None)
            modules = _Modules(root)
            recorder = _ForwardRecorder(modules)
            try:
                with recorder, scenarios._autocast(setup.autocast):
                    loss = setup.loss_fn(setup.model, batch)
                recorder.resolve()
            finally:
                modules.remove()
            backward, _ = _backward_events(loss, recorder.node_event, setup.scaler)
            events = recorder.events + backward
            grads = [p.grad for p in params if p.grad is not None]
            if setup.scaler is not None:
                setup.scaler.unscale_(setup.optimizer)
            if not _finite([loss.detach()]) or not _finite(grads):
                return Finding(step, textbook_origin(events))
            if setup.scaler is not None:
                setup.scaler.step(setup.optimizer)
                setup.scaler.update()
            else:
                setup.optimizer.step()
    return None
