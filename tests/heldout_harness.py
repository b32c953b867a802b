"""The training loop and the diagnosis record shared by the held-out program files
(``test_heldout_programs_r3a.py``, ``_r4.py``): a plain loop under ``nantrace.watch`` with the
hooks real scripts have (code between two steps, code between ``backward()`` and
``optimizer.step()``, gradient accumulation, an LR scheduler), and the comparison of the first
blocking incident with the expected :class:`~test_programs.Want`.

A case marks its origin line with ``# <origin:TAG>`` in its own file; the one line marked here
(``opt_step``) is the loop's ``optimizer.step()``, the line an optimizer-phase origin points at.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import nantrace
from origin_markers import origin_line
from test_programs import Want

HARNESS = os.path.abspath(__file__)


@dataclasses.dataclass
class Program:
    """A training script: the watched model, its optimizer, the batches, the per-step loss code
    ``loss(model, batch, step) -> scalar``, and optionally:

    - ``before_step(model, step)``: code between two steps (under no_grad, as the loop fetches the
      next batch: a calibration, an EMA);
    - ``between(model, optimizer, step)``: code between ``backward()`` and ``optimizer.step()``;
    - ``accum``: each batch is a list of micro-batches; ``loss`` runs on each and
      ``(loss / len).backward()`` accumulates the gradients before the one ``optimizer.step()``;
    - ``scheduler``: stepped after each ``optimizer.step()``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[Any]
    loss: Callable[[nn.Module, Any, int], torch.Tensor]
    before_step: Callable[[nn.Module, int], None] | None = None
    between: Callable[[nn.Module, torch.optim.Optimizer, int], None] | None = None
    accum: bool = False
    scheduler: Any = None


@dataclasses.dataclass
class Run:
    incidents: list[Any]
    error: BaseException | None
    error_step: int | None
    unchanged_at_incident: bool | None


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    """The trained parameters (a momentum encoder's frozen parameters change in its own forward)."""
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(torch.nan_to_num(x, 1.0, 2.0, 3.0), torch.nan_to_num(y, 1.0, 2.0, 3.0)) for x, y in zip(a, b))


def run_step(program: Program, loss_fn: Callable, batch: Any, step: int) -> torch.Tensor:
    """The step's loss code and backward (each micro-batch's under ``accum``); returns the loss(es)."""
    if not program.accum:
        loss = loss_fn(program.model, batch, step)
        loss.backward()
        return loss
    losses = []
    for micro in batch:
        loss = loss_fn(program.model, micro, step)
        (loss / len(batch)).backward()
        losses.append(loss.detach())
    return torch.stack(losses)


def train(program: Program, *, replayable: bool) -> Run:
    """The loop; an exception ends the run as it would end the script."""
    model, opt = program.model, program.optimizer
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    loss_fn = guard.replayable(program.loss) if replayable else program.loss
    error, error_step, unchanged = None, None, None
    try:
        for step, batch in enumerate(program.batches):
            if program.before_step is not None:
                with torch.no_grad():
                    program.before_step(model, step)
            before, seen = snapshot(model), _blocking(guard.incidents)
            try:
                opt.zero_grad()
                run_step(program, loss_fn, batch, step)
                if program.between is not None:
                    program.between(model, opt, step)
                opt.step()  # <origin:opt_step>
                if program.scheduler is not None:
                    program.scheduler.step()
            except Exception as exc:  # the script would have died here
                error, error_step = exc, step
                unchanged = same(before, snapshot(model)) if unchanged is None else unchanged
                break
            if _blocking(guard.incidents) > seen and unchanged is None:
                unchanged = same(before, snapshot(model))
    finally:
        guard.close()
    return Run(list(guard.incidents), error, error_step, unchanged)


def _blocking(incidents: list[Any]) -> int:
    """How many incidents blocked an update (early warnings are logged and let it land)."""
    return sum(1 for i in incidents if i.action != "logged")


def describe(inc: Any) -> str:
    return (f"step={inc.step} kind={inc.kind} phase={inc.phase} op={inc.op} module={inc.module!r} "
            f"cause={inc.cause} action={inc.action} source={inc.source}")


class Judge:
    """Reads incidents and expectations of the cases written in ``path``."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)

    def line(self, source: str | None) -> tuple[str, int] | int | None:
        """(file name, line) of ``source`` in the case file or this harness, -1 if elsewhere, None if absent."""
        if source is None:
            return None
        where, _, line = source.rpartition(":")
        for known in (self.path, HARNESS):
            if where and os.path.exists(where) and os.path.samefile(where, known):
                return os.path.basename(known), int(line)
        return -1

    def marked(self, tag: str) -> tuple[str, int]:
        """Where ``# <origin:tag>`` is: in the case file, else in this harness."""
        try:
            return os.path.basename(self.path), origin_line(self.path, tag)
        except AssertionError:  # not marked in the case file (once or at all)
            return os.path.basename(HARNESS), origin_line(HARNESS, tag)

    def got(self, incidents: list[Any]) -> dict[str, Any] | None:
        """The diagnosis fields of the first blocking incident (early warnings are logged, not blocking)."""
        main = [i for i in incidents if i.action != "logged"]
        if not main:
            return None
        inc = main[0]
        return dict(step=inc.step, kind=inc.kind, phase=inc.phase, op=inc.op, module=inc.module, cause=inc.cause,
                    action=inc.action, line=self.line(inc.source))

    def want(self, want: Want) -> dict[str, Any]:
        return dict(step=want.step, kind=want.kind, phase=want.phase, op=want.op, module=want.module,
                    cause=want.cause, action=want.action, line=self.marked(want.tag) if want.tag else None)


def sgd(model: nn.Module, lr: float = 1e-2, **kw: Any) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=lr, **kw)


def steps(normal: Callable[[int], Any], bad: Callable[[int], Any], fail_step: int, n: int) -> list[Any]:
    return [bad(s) if s == fail_step else normal(s) for s in range(n)]


def aligned(f: Callable[[torch.Tensor], torch.Tensor], d: int, sign: float, scale: float, seed: int) -> torch.Tensor:
    """A raw-unit input row ``scale * v`` whose scalar output ``f`` has the given sign (at init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(200):
            v = scale * torch.randn(d, generator=g)
            if float(f(v[None])) * sign > 0:
                return v
    raise AssertionError("no aligned input")


MODES = ("zero_intrusive", "replayable")


def case_params(cases: dict[str, Any], xfail: dict[str, str]) -> list[Any]:
    """One ``pytest.param(name, mode)`` per case and mode; ``xfail["name[mode]"]`` marks a strict xfail."""
    import pytest

    out = []
    for name in cases:
        for mode in MODES:
            key = f"{name}[{mode}]"
            marks = [pytest.mark.xfail(strict=True, reason=xfail[key])] if key in xfail else []
            out.append(pytest.param(name, mode, id=f"{name}-{mode}", marks=marks))
    return out


def assert_diagnosis(run: Run, want: Want, judge: Judge) -> None:
    """The first blocking incident is the expected one; a raising step raised the user's own error
    (not nantrace's), any other ran on; the blocked step left the weights as they were."""
    got = judge.got(run.incidents)
    assert got is not None, ("no incident", repr(run.error))
    assert got == judge.want(want), [describe(i) + " | " + i.summary for i in run.incidents]
    if want.kind == "exception":
        assert run.error is not None and run.error_step == want.step, (run.error, run.error_step)
        assert not isinstance(run.error, nantrace.NonFiniteError)
    else:
        assert run.error is None, repr(run.error)
    assert run.unchanged_at_incident is True, "the blocked step changed the weights"
