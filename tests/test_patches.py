"""nantrace.patches: every process-wide patch declared in one place, installed and removed as a
unit, tolerant of other tools patching the same functions (stacked in any order, closed in any
order). Regression for issue 10: a tool that wraps ``torch.autograd.backward`` after ``watch()``
made every backward recurse forever once the guard closed."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch
from torch import nn

import nantrace
from nantrace import patches
from nantrace.patches import BACKWARD, CLIP_FUNCTIONS, EXCEPTHOOK, FunctionPatch

REAL_BACKWARD = torch.autograd.backward
REAL_CLIP = torch.nn.utils.clip_grad_norm_


class OtherTool:
    """Another tool that wraps a module function the naive way: it saves what it finds and puts
    it back when it closes (with or without ``functools.wraps``)."""

    def __init__(self, owner: object, attr: str, *, wraps: bool) -> None:
        self.owner, self.attr, self.wraps = owner, attr, wraps
        self.calls = 0
        self.saved = None

    def open(self) -> None:
        self.saved = inner = getattr(self.owner, self.attr)

        def wrapper(*args, **kwargs):
            self.calls += 1
            return inner(*args, **kwargs)

        if self.wraps:
            wrapper.__wrapped__ = inner  # type: ignore[attr-defined]
        setattr(self.owner, self.attr, wrapper)

    def close(self) -> None:
        setattr(self.owner, self.attr, self.saved)


@pytest.fixture(autouse=True)
def _clean_chain():
    yield
    torch.autograd.backward = REAL_BACKWARD
    torch.nn.utils.clip_grad_norm_ = REAL_CLIP
    BACKWARD._layers.clear()


def _guard() -> tuple[nantrace.Guard, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    return guard, model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()


def test_a_tool_wrapping_backward_after_watch_then_the_guard_closes_no_recursion() -> None:
    guard, model, opt = _guard()
    tool = OtherTool(torch.autograd, "backward", wraps=False)
    tool.open()
    _step(model, opt)
    guard.close()
    for _ in range(3):
        _step(model, opt)  # recursed forever before the fix
    assert tool.calls == 4
    tool.close()  # puts back what it found: our idle layer, which leaves at its next call
    _step(model, opt)
    assert torch.autograd.backward is REAL_BACKWARD and not BACKWARD.installed


EVENTS = ("guard_open", "tool_open", "guard_close", "tool_close")


def _orders() -> list[tuple[str, ...]]:
    """Every order of opening and closing a guard and a tool (each opened before it is closed)."""
    out = []
    for order in itertools.permutations(EVENTS):
        if order.index("guard_open") < order.index("guard_close") and order.index("tool_open") < order.index("tool_close"):
            out.append(order)
    return out


@pytest.mark.parametrize("wraps", [True, False], ids=["functools-wraps", "naive"])
@pytest.mark.parametrize("order", _orders(), ids=lambda o: "-".join(o))
def test_stacked_and_closed_in_every_order(order: tuple[str, ...], wraps: bool) -> None:
    seen: list[float] = []
    tool = OtherTool(torch.autograd, "backward", wraps=wraps)
    x = torch.ones(2, requires_grad=True)
    guard_open = tool_open = False
    for event in order:
        if event == "guard_open":
            BACKWARD.add("test", lambda loss: seen.append(float(loss)))
            guard_open = True
        elif event == "guard_close":
            BACKWARD.remove("test")
            guard_open = False
        elif event == "tool_open":
            tool.open()
            tool_open = True
        else:
            tool.close()
            tool_open = False
        BACKWARD.ensure()  # what the guard does at each step
        before, calls = len(seen), tool.calls
        (x * 2).sum().backward()  # every backward works, whatever is stacked
        assert len(seen) - before == (1 if guard_open else 0)  # seen exactly once while listening
        assert tool.calls - calls <= (1 if tool_open else 0)
    assert x.grad is not None and x.grad.tolist() == [2.0 * len(order)] * 2
    # the guard can come back whatever the chain looks like now, and sees each loss once
    BACKWARD.add("again", lambda loss: seen.append(float(loss)))
    before = len(seen)
    (x * 3).sum().backward()
    assert len(seen) - before == 1
    BACKWARD.remove("again")
    (x * 3).sum().backward()
    (x * 3).sum().backward()
    assert len(seen) - before == 1
    assert not BACKWARD.installed
    if not tool_open:
        assert torch.autograd.backward is REAL_BACKWARD  # nothing of ours or the tool's is left


def test_two_tools_around_two_guards_any_close_order() -> None:
    for closes in itertools.permutations(("a", "b", "t1", "t2")):
        torch.autograd.backward = REAL_BACKWARD
        BACKWARD._layers.clear()
        t1, t2 = OtherTool(torch.autograd, "backward", wraps=False), OtherTool(torch.autograd, "backward", wraps=True)
        seen: list[str] = []
        t1.open()
        BACKWARD.add("a", lambda loss: seen.append("a"))
        t2.open()
        BACKWARD.add("b", lambda loss: seen.append("b"))
        x = torch.ones(1, requires_grad=True)
        for name in closes:
            {"a": lambda: BACKWARD.remove("a"), "b": lambda: BACKWARD.remove("b"), "t1": t1.close, "t2": t2.close}[name]()
            x.sum().backward()
        assert x.grad is not None and float(x.grad) == 4.0
        x.sum().backward()
        if closes.index("t1") > closes.index("t2"):  # the tools closed in the order they should
            assert torch.autograd.backward is REAL_BACKWARD


def test_a_patch_restores_the_function_only_while_it_is_on_top() -> None:
    BACKWARD.add("k", lambda loss: None)
    ours = torch.autograd.backward
    assert getattr(ours, "_nantrace_patch", None) == "torch.autograd.backward"
    BACKWARD.remove("k")
    assert torch.autograd.backward is REAL_BACKWARD


def test_clipping_functions_stack_too() -> None:
    seen: list[float] = []
    tool = OtherTool(torch.nn.utils, "clip_grad_norm_", wraps=False)
    for p in CLIP_FUNCTIONS:
        p.add("clip", lambda params, max_norm, norm_type, total: seen.append(max_norm))
    tool.open()
    for p in CLIP_FUNCTIONS:
        p.remove("clip")
    w = torch.ones(3, requires_grad=True)
    w.grad = torch.ones(3)
    torch.nn.utils.clip_grad_norm_([w], 0.5)
    assert seen == [] and tool.calls == 1
    tool.close()
    torch.nn.utils.clip_grad_norm_([w], 0.5)
    assert torch.nn.utils.clip_grad_norm_ is REAL_CLIP


def test_one_excepthook_for_diagnosis_and_the_nonfinite_error_display(capsys) -> None:
    sticky = EXCEPTHOOK.has(patches._USER_TRACEBACK)  # an earlier watch(on_anomaly="raise") turned it on
    EXCEPTHOOK.remove(patches._USER_TRACEBACK)
    previous = sys.excepthook
    got: list[BaseException] = []
    try:
        EXCEPTHOOK.add("diag", got.append)
        hook = sys.excepthook
        assert getattr(hook, "_nantrace_patch", None) == "sys.excepthook"
        patches.install_user_traceback()
        assert sys.excepthook is hook  # one hook, not a second chained one
        err = ValueError("boom")
        sys.excepthook(ValueError, err, None)
        assert got == [err] and "ValueError: boom" in capsys.readouterr().err
        EXCEPTHOOK.remove("diag")
        assert sys.excepthook is hook  # the NonFiniteError display stays for the process
    finally:
        EXCEPTHOOK.remove("diag")
        EXCEPTHOOK.remove(patches._USER_TRACEBACK)
    assert sys.excepthook is previous
    if sticky:
        patches.install_user_traceback()


def test_a_guard_installs_and_removes_its_patches_as_a_unit_and_they_are_listed() -> None:
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nantrace.watch(model, opt, scaler, config=nantrace.Config(outputs={"print_incidents": False}))
    listed = patches.installed()
    assert any(line.startswith("torch.autograd.backward (1 listener)") for line in listed)
    assert any(line.startswith("sys.excepthook") for line in listed)
    assert any(line.startswith("torch.nn.utils.clip_grad_norm_") for line in listed)
    assert {line.split(" ")[0] for line in listed} >= {"GradScaler.scale", "GradScaler.unscale_", "GradScaler.step"}
    guard.close()
    assert not any(line.startswith(("torch.", "GradScaler.")) for line in patches.installed())
    assert set(vars(scaler)) == set(vars(torch.amp.GradScaler("cpu", enabled=True)))


def test_every_patch_is_declared() -> None:
    declared = " ".join(d.target for d in patches.DECLARED)
    for p in (BACKWARD, EXCEPTHOOK, *CLIP_FUNCTIONS):
        assert p.target in declared, p.target
    assert "GradScaler" in declared and "gc.get_referrers" in declared and "marker attributes" in declared
    assert isinstance(BACKWARD, FunctionPatch)


def test_watch_leaves_the_users_python_random_stream_alone() -> None:
    """A fresh process (nothing of rich imported yet): the first ``watch()`` imports nantrace's console, whose
    dependency draws from Python's global RNG at import; the user's stream must not move."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import random, torch
        from torch import nn
        import nantrace
        random.seed(0); expected = [random.random() for _ in range(3)]; random.seed(0)
        model = nn.Linear(2, 1)
        guard = nantrace.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
        got = [random.random() for _ in range(3)]
        guard.close()
        print(got == expected)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "True", out.stdout + out.stderr
