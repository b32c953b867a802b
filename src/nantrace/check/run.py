"""Run a check: train the spec a few steps on the CPU with a fixed seed under
:func:`nantrace.watch`, validating every batch, and collect a :class:`CheckResult`."""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..taxonomy import Action
from ..config import Config
from ..errors import NonFiniteError

from .spec import (
    CHECK_POLICIES,
    DEFAULT_STEPS,
    CheckResult,
    CheckSpec,
    CheckStepError,
    CheckUsageError,
    call_factory,
    describe_value,
    load_target,
    resolve_spec,
)

__all__ = ["run_check"]



def run_check(
    spec: CheckSpec | dict[str, Any] | Callable[[], Any] | str,
    *,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    on_anomaly: str = "skip",
    run_dir: str | os.PathLike[str] | None = None,
    policy: str | None = None,
) -> CheckResult:
    """Train `spec` for `steps` steps under :func:`nantrace.watch` and report every incident.

    `spec` is a `CheckSpec`, a dict with its fields, a function taking no arguments that
    returns one (called after seeding, so the model's initialisation is fixed), or a
    ``"module:function"`` / ``"path/file.py:function"`` target naming such a function.
    Python's, NumPy's and torch's RNGs are seeded with `seed` and restored afterwards.
    Every batch is validated first: NaN/Inf inputs and out-of-range labels are incidents
    (``phase="data"``) and the batch is not trained on; the other data findings are
    `CheckResult.data_warnings`. The loss function runs through ``guard.replayable`` so a
    failure inside it is localised too. ``on_anomaly`` is the guard's policy: with
    ``"skip"`` or ``"rollback"`` the check goes on and counts every incident, with
    ``"raise"`` or ``"pause"`` it stops at the first one (``policy=`` is a deprecated
    alias of ``on_anomaly=``). Raises `CheckUsageError` (contract violations) and `CheckStepError`
    (the user's code raised during a step).

    Usage::

        result = run_check("stability_check:make_check", steps=50)
        print(result.verdict)   # nantrace check: 50 steps, 1 incident: FAILED
        for inc in result.incidents:
            print(inc.step, inc.op, inc.module, inc.cause)   # 7 aten.log.default energy log_nonpositive
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise CheckUsageError(f"steps must be a positive int; got {steps!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise CheckUsageError(f"seed must be an int; got {seed!r}")
    if policy is not None:
        import warnings

        warnings.warn("run_check(policy=...) is deprecated; pass on_anomaly=... (the name nantrace.watch uses)",
                      DeprecationWarning, stacklevel=2)
        on_anomaly = policy
    if on_anomaly not in CHECK_POLICIES:
        raise CheckUsageError(f"unknown on_anomaly policy {on_anomaly!r}; expected one of {', '.join(CHECK_POLICIES)}")
    target: str | None = None
    if isinstance(spec, str):
        target = spec
        spec = load_target(spec)
    if isinstance(spec, nn.Module):
        raise CheckUsageError("run_check needs a check spec (model, data, loss_fn), not a bare model: "
                              "pass CheckSpec(model=..., data=..., loss_fn=...) or a dict with those keys")
    start = time.perf_counter()
    with _seeded(seed):
        if callable(spec) and not isinstance(spec, (CheckSpec, dict)):
            label = f"{getattr(spec, '__name__', type(spec).__name__)}()"
            target = target or getattr(spec, "__qualname__", None)
            spec = resolve_spec(call_factory(spec, label), label)
        else:
            spec = resolve_spec(spec)
        result = _train(spec, steps=steps, seed=seed, policy=on_anomaly, run_dir=run_dir)
    result.target = target
    result.seconds = time.perf_counter() - start
    return result


def _train(spec: CheckSpec, *, steps: int, seed: int, policy: str, run_dir: Any) -> CheckResult:
    import nantrace
    from ..data import GUARD_CAUSES, BatchSchema, validate_batch

    model = spec.model
    optimizer = spec.optimizer if spec.optimizer is not None else torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = (spec.config or Config()).replace(outputs={"print_incidents": False})
    stops = policy in ("raise", "pause")
    result = CheckResult(target=None, steps=steps, steps_run=0, seed=seed, on_anomaly=policy, incidents=[],
                         run_dir=os.fspath(run_dir) if run_dir is not None else None)
    try:
        guard = nantrace.watch(model, optimizer, spec.scaler, run_dir=run_dir, on_anomaly=policy, config=config)
    except (TypeError, ValueError) as exc:
        raise CheckUsageError(str(exc)) from None
    loss_fn = guard.replayable(spec.loss_fn)
    schema = BatchSchema()
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    model.train()
    try:
        for step, batch in _batches(spec.data, steps):
            result.steps_run = step + 1
            report = validate_batch(batch, num_classes=spec.num_classes, reference=schema)
            bad = [issue for issue in report.issues if issue.cause in GUARD_CAUSES]
            for issue in report.issues:
                if issue.cause not in GUARD_CAUSES:
                    result.data_warnings.append({"step": step, **issue.to_dict()})
            if bad:
                for issue in bad:
                    issue.details["action"] = {"raise": Action.RAISED, "pause": Action.PAUSED}.get(policy, Action.SKIPPED)
                    guard.record_data_incident(issue)
                if stops:
                    result.stopped = f"on_anomaly={policy}: the batch of step {step} failed validation ({bad[0].cause})"
                    break
                _empty_step(optimizer, spec.lr_scheduler)  # the batch is dropped; the step still counts
                continue
            try:
                _train_step(spec, model, optimizer, loss_fn, batch, device_type)
            except NonFiniteError as exc:
                result.stopped = (f"on_anomaly={policy}: stopped at step {step} ({exc.incident.kind}, {exc.incident.cause})"
                                  if stops else
                                  f"step {step}: {exc.incident.cause} cannot be skipped ({exc.incident.kind}); training cannot go on")
                break
            except CheckUsageError:
                raise
            except Exception as exc:
                raise CheckStepError(step, exc) from exc
        else:
            if result.steps_run == 0:
                raise CheckUsageError("data yielded no batch; it must yield at least one (or be a callable step -> batch)")
    except _DataError as exc:
        raise CheckStepError(exc.step, exc.__cause__ or exc, what="the data") from exc.__cause__
    finally:
        guard.close()
    if result.steps_run < steps and result.stopped is None:
        result.stopped = f"the data ran out after {result.steps_run} of {steps} steps"
    result.incidents = list(guard.incidents)
    return result


def _train_step(spec: CheckSpec, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., Any],
                batch: Any, device_type: str) -> None:
    optimizer.zero_grad(set_to_none=True)
    ctx = torch.autocast(device_type, dtype=spec.autocast) if spec.autocast is not None else contextlib.nullcontext()
    with ctx:
        loss = loss_fn(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else describe_value(loss)
        raise CheckUsageError(f"loss_fn(model, batch) must return a scalar tensor; got {got}")
    if not loss.requires_grad:
        raise CheckUsageError("loss_fn(model, batch) returned a loss that does not require grad "
                              "(computed under torch.no_grad(), or detached from the model)")
    if spec.scaler is not None:
        spec.scaler.scale(loss).backward()
        spec.scaler.step(optimizer)
        spec.scaler.update()
    else:
        loss.backward()
        optimizer.step()
    if spec.lr_scheduler is not None:
        spec.lr_scheduler.step()


def _empty_step(optimizer: torch.optim.Optimizer, lr_scheduler: Any) -> None:
    """A step with no gradient: nothing is updated, but the step counts (as a skipped update
    does), so incident steps stay equal to batch indices and the schedule stays aligned."""
    optimizer.zero_grad(set_to_none=True)
    optimizer.step()
    if lr_scheduler is not None:
        lr_scheduler.step()


class _DataError(Exception):
    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step


def _batches(data: Any, steps: int) -> Iterator[tuple[int, Any]]:
    """(step, batch) pairs: ``data(step)`` for a callable; passes over an iterable, again
    and again for a re-iterable one (a list, a DataLoader), once for a one-shot iterator."""
    if callable(data) and not hasattr(data, "__iter__"):
        for step in range(steps):
            try:
                batch = data(step)
            except Exception as exc:
                raise _DataError(step) from exc
            yield step, batch
        return
    step = 0
    while step < steps:
        try:
            it = iter(data)
        except Exception as exc:
            raise _DataError(step) from exc
        one_shot = it is data
        got_any = False
        while step < steps:
            try:
                batch = next(it)
            except StopIteration:
                break
            except Exception as exc:
                raise _DataError(step) from exc
            got_any = True
            yield step, batch
            step += 1
        if one_shot or not got_any:
            return


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed Python's, NumPy's and torch's (CPU) RNGs; restore their states on exit."""
    import numpy as np

    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)

