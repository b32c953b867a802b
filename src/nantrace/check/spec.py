"""The check's contract: what a *check spec* is (:class:`CheckSpec`, or a dict, or a
``module:function`` target returning one), how it is found and validated, and what a check
returns (:class:`CheckResult`). The run itself is :mod:`nantrace.check.run`."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import Config
from ..incident import Incident
from ..response.policies import POLICIES
__all__ = [
    "CHECK_POLICIES",
    "CheckResult",
    "CheckSpec",
    "CheckStepError",
    "CheckUsageError",
    "load_target",
    "resolve_spec",
    "user_traceback",
]

CHECK_POLICIES = POLICIES
"""The ``on_anomaly`` policies of :func:`nantrace.watch`, the same four everywhere:
``skip`` (drop each bad update or bad batch, go on, count every incident), ``raise`` (stop
at the first incident), ``rollback`` (restore the last good state, go on), ``pause``
(write the bundle, then stop)."""

DEFAULT_STEPS = 50
"""Steps ``nantrace check`` runs unless told otherwise."""

_REQUIRED = ("model", "data", "loss_fn")
_OPTIONAL = ("optimizer", "num_classes", "scaler", "autocast", "lr_scheduler", "config")
_KEYS = f"keys {', '.join(_REQUIRED)} (optional: {', '.join(_OPTIONAL)})"
_EXPECTED_KEYS = f"expected {_KEYS}"


class CheckUsageError(ValueError):
    """The check could not start: a bad target, an import error or a spec that breaks the
    contract. The message says what was expected; ``detail`` holds a traceback when the
    user's own code raised (``nantrace check`` exits with code 2)."""

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail


class CheckStepError(RuntimeError):
    """The user's code (loss function, optimizer, scheduler, or the data) raised during the check;
    the original exception is ``__cause__`` and the step is ``step``."""

    def __init__(self, step: int, exc: BaseException, what: str = "the training step") -> None:
        super().__init__(f"{what} raised at step {step}: {type(exc).__name__}: {exc}")
        self.step = step


@dataclasses.dataclass(kw_only=True)
class CheckSpec:
    """What ``nantrace check`` trains: return one from your check function.

    Usage::

        CheckSpec(model=net, data=loader, loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]))
    """

    model: nn.Module
    """The model to train (build it inside the check function, so the seed fixes its init)."""

    data: Any
    """An iterable of batches (a list, a ``DataLoader``: re-iterated when a pass ends, a
    one-shot iterator: the check stops when it runs out), or a callable ``step -> batch``."""

    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    """``(model, batch) -> scalar loss``, forward only (the check runs backward and the step)."""

    optimizer: torch.optim.Optimizer | None = None
    """The optimizer; ``None``: ``torch.optim.AdamW(model.parameters(), lr=1e-3)``."""

    num_classes: int | None = None
    """Number of classes, to check integer labels against ``[0, num_classes)``."""

    scaler: Any = None
    """A ``torch.amp.GradScaler``: backward runs on ``scaler.scale(loss)``, then ``scaler.step``/``update``."""

    autocast: torch.dtype | None = None
    """Run ``loss_fn`` under ``torch.autocast`` with this dtype (e.g. ``torch.bfloat16``); ``None``: no autocast."""

    lr_scheduler: Any = None
    """An LR scheduler, stepped once after every optimizer step."""

    config: Config | None = None
    """A ``nantrace.Config`` for the guard (its ``print_incidents`` is ignored: the check prints)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise TypeError(f"CheckSpec.model must be a torch.nn.Module; got {_type(self.model)}")
        if isinstance(self.data, torch.Tensor):
            raise TypeError("CheckSpec.data must be an iterable of batches, a DataLoader or a callable step -> batch; "
                            "got a Tensor (wrap a single batch in a list: [batch])")
        if isinstance(self.data, (str, bytes)) or not (callable(self.data) or hasattr(self.data, "__iter__")):
            raise TypeError("CheckSpec.data must be an iterable of batches, a DataLoader or a callable step -> batch; "
                            f"got {_type(self.data)}")
        if not callable(self.loss_fn):
            raise TypeError(f"CheckSpec.loss_fn must be a callable (model, batch) -> scalar loss; got {_type(self.loss_fn)}")
        try:
            inspect.signature(self.loss_fn).bind(self.model, None)
        except TypeError:
            raise TypeError(f"CheckSpec.loss_fn must accept two arguments (model, batch); "
                            f"its signature is {inspect.signature(self.loss_fn)}") from None
        except ValueError:  # no signature (a builtin): find out when it is called
            pass
        if self.optimizer is not None and not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"CheckSpec.optimizer must be a torch.optim.Optimizer or None; got {_type(self.optimizer)}")
        if self.num_classes is not None and (
                not isinstance(self.num_classes, int) or isinstance(self.num_classes, bool) or self.num_classes < 1):
            raise ValueError(f"CheckSpec.num_classes must be a positive int or None; got {self.num_classes!r}")
        if self.scaler is not None and not all(callable(getattr(self.scaler, n, None)) for n in ("scale", "step", "update")):
            raise TypeError(f"CheckSpec.scaler must be a torch.amp.GradScaler or None; got {_type(self.scaler)}")
        if self.autocast is not None and not (isinstance(self.autocast, torch.dtype) and self.autocast.is_floating_point):
            raise TypeError(f"CheckSpec.autocast must be a floating torch.dtype (torch.bfloat16, torch.float16) "
                            f"or None; got {self.autocast!r}")
        if self.lr_scheduler is not None and not callable(getattr(self.lr_scheduler, "step", None)):
            raise TypeError(f"CheckSpec.lr_scheduler must have a step() method (a torch LR scheduler) or be None; "
                            f"got {_type(self.lr_scheduler)}")
        if self.config is not None and not isinstance(self.config, Config):
            raise TypeError(f"CheckSpec.config must be a nantrace.Config or None; got {_type(self.config)}")


@dataclasses.dataclass
class CheckResult:
    """The outcome of a check: the incidents (oldest first), data warnings and the verdict.

    Usage::

        result = run_check(make_check, steps=20)
        if not result.ok:
            print(result.report_text())     # every diagnosis, then the verdict line
        sys.exit(result.exit_code)          # 0 clean, 1 on any incident
    """

    target: str | None
    """What was checked (``module:function``, a function's qualified name, or ``None``)."""

    steps: int
    """Steps asked for."""

    steps_run: int
    """Steps that ran (fewer when ``raise`` stopped the check or one-shot data ran out)."""

    seed: int
    on_anomaly: str
    """The policy the guard ran with (``skip``, ``raise``, ``rollback`` or ``pause``)."""
    incidents: list[Incident]
    """Every incident, numerical and data (``phase="data"``), oldest first."""

    data_warnings: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Data findings that do not fail the check (degenerate normalisation, shape changes...):
    ``DataIssue.to_dict()`` plus ``step``."""

    stopped: str | None = None
    """Why the check ended before ``steps`` steps, or ``None``."""

    run_dir: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when no incident happened."""
        return not self.incidents

    @property
    def exit_code(self) -> int:
        """0 when clean, 1 on any incident."""
        return 0 if self.ok else 1

    @property
    def verdict(self) -> str:
        """The one-line verdict, e.g. ``nantrace check: 50 steps, 0 incidents: OK``."""
        n = len(self.incidents)
        return f"nantrace check: {self.steps_run} steps, {n} incident{'' if n == 1 else 's'}: {'OK' if self.ok else 'FAILED'}"

    def groups(self) -> list[tuple[Incident, list[int]]]:
        """Incidents grouped by diagnosis (kind, cause, phase, op, module, source, data path):
        the first of each group and the steps where it happened, in order of first occurrence."""
        out: dict[tuple[Any, ...], tuple[Incident, list[int]]] = {}
        for inc in self.incidents:
            key = (inc.kind, inc.cause, inc.phase, inc.op, inc.module, inc.source, inc.details.get("path"))
            out.setdefault(key, (inc, []))[1].append(inc.step)
        return list(out.values())

    def print_report(self, console: Any = None) -> None:
        """Print every distinct diagnosis (a rich panel), the data warnings and the verdict
        (on ``console``, default stdout: they are the check's result)."""
        from rich.text import Text

        from ..console import OUT, render_incident

        console = console or OUT
        for first, steps in self.groups():
            console.print(render_incident(first))
            if len(steps) > 1:
                console.print(f"  the same diagnosis at {len(steps) - 1} more step(s): {step_ranges(steps[1:])}",
                              soft_wrap=True, highlight=False, markup=False)
        warnings: dict[tuple[str, str], tuple[dict[str, Any], list[int]]] = {}
        for w in self.data_warnings:
            warnings.setdefault((w["cause"], w.get("path") or w["summary"]), (w, []))[1].append(w["step"])
        for w, steps in warnings.values():
            console.print(f"data warning (does not fail the check) at step {step_ranges(steps)}: [{w['cause']}] {w['summary']}",
                          soft_wrap=True, highlight=False, markup=False)
        if self.stopped:
            console.print(f"stopped early: {self.stopped}", soft_wrap=True, highlight=False, markup=False)
        if self.run_dir and self.incidents:
            console.print(f"run directory {self.run_dir}; report: nantrace report {self.run_dir}",
                          soft_wrap=True, highlight=False, markup=False)
        console.print(Text(self.verdict, style="bold green" if self.ok else "bold red"), soft_wrap=True)

    def report_text(self, width: int = 100) -> str:
        """`print_report` as plain text (for a failing test's message or a log)."""
        from rich.console import Console

        with open(os.devnull, "w") as sink:
            console = Console(width=width, record=True, file=sink, color_system=None)
            self.print_report(console)
            return console.export_text()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy (incidents as ``Incident.to_dict()``)."""
        from ..data.issues import jsonable

        return {
            "target": self.target, "ok": self.ok, "exit_code": self.exit_code, "verdict": self.verdict,
            "steps": self.steps, "steps_run": self.steps_run, "seed": self.seed, "on_anomaly": self.on_anomaly,
            "stopped": self.stopped, "run_dir": self.run_dir, "seconds": round(self.seconds, 3),
            "incidents": [i.to_dict() for i in self.incidents],
            "data_warnings": jsonable(self.data_warnings),
        }


# ---------------------------------------------------------------------- the target


def load_target(target: str) -> Callable[..., Any]:
    """Import ``module:function`` (the current directory first on ``sys.path``, as with
    ``python -m``) or ``path/to/file.py:function`` and return the function.

    Raises `CheckUsageError` with what was expected when the target is malformed, cannot
    be imported, or names something that is not a function taking no required arguments.
    """
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise CheckUsageError(f"TARGET must be module:function; got {target!r} (a file works too: path/to/file.py:function)")
    if not name.isidentifier():
        raise CheckUsageError(f"TARGET must be module:function; {name!r} in {target!r} is not a function name")
    if where.endswith(".py") or "/" in where or os.sep in where:
        module = _import_file(Path(where), target)
    else:
        if not all(part.isidentifier() for part in where.split(".")):
            raise CheckUsageError(f"TARGET must be module:function; {where!r} in {target!r} is not a module name "
                                  "(use path/to/file.py:function for a file)")
        cwd = os.getcwd()
        if cwd not in sys.path and "" not in sys.path:
            sys.path.insert(0, cwd)
        importlib.invalidate_caches()
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            if exc.name is not None and where.startswith(exc.name):
                raise CheckUsageError(f"cannot import module {where!r} from TARGET {target!r}: no module named "
                                      f"{exc.name!r} (run from the directory that holds it, or set PYTHONPATH)") from None
            raise CheckUsageError(f"importing {where!r} failed: {type(exc).__name__}: {exc}", user_traceback(exc)) from None
        except Exception as exc:
            raise CheckUsageError(f"importing {where!r} failed: {type(exc).__name__}: {exc}", user_traceback(exc)) from None
    fn = getattr(module, name, None)
    if fn is None:
        raise CheckUsageError(f"{where!r} has no attribute {name!r} (TARGET {target!r})")
    if not callable(fn):
        raise CheckUsageError(f"{target} is a {_type(fn)}, not a function; it must be a function that returns the check spec")
    return fn


def _import_file(path: Path, target: str) -> Any:
    if not path.is_file():
        raise CheckUsageError(f"no such file: {path} (TARGET {target!r})")
    path = path.resolve()
    name = "_nantrace_target_" + re.sub(r"\W", "_", path.stem)  # private: never shadows an importable module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CheckUsageError(f"cannot import {path} (TARGET {target!r}): not a Python source file")
    module = importlib.util.module_from_spec(spec)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # its siblings importable, as with `python path/to/file.py`
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise CheckUsageError(f"importing {path} failed: {type(exc).__name__}: {exc}", user_traceback(exc)) from None
    return module


def resolve_spec(obj: Any, source: str | None = None) -> CheckSpec:
    """Turn a check spec (a `CheckSpec`, a dict, or any object with the same attributes)
    into a validated `CheckSpec`. `source` names the function that returned it
    (``"make_check()"``) in error messages."""
    if isinstance(obj, CheckSpec):
        return obj
    returned = f"{source} returned" if source else "the check spec is"
    if isinstance(obj, dict):
        missing = [k for k in _REQUIRED if k not in obj]
        if missing:
            without = " or ".join(repr(k) for k in missing)
            raise CheckUsageError(f"{returned} a dict without {without}; {_EXPECTED_KEYS}")
        unknown = sorted(set(map(str, obj)) - set(_REQUIRED) - set(_OPTIONAL))
        if unknown:
            raise CheckUsageError(f"{returned} a dict with unknown key(s) {', '.join(map(repr, unknown))}; {_EXPECTED_KEYS}")
        fields = dict(obj)
    elif all(hasattr(obj, k) for k in _REQUIRED):
        fields = {k: getattr(obj, k) for k in _REQUIRED + _OPTIONAL if hasattr(obj, k)}
    else:
        raise CheckUsageError(f"{returned} {describe_value(obj)}; expected a nantrace.check.CheckSpec or a dict with {_KEYS}")
    try:
        return CheckSpec(**fields)
    except (TypeError, ValueError) as exc:
        raise CheckUsageError(f"{source} returned an invalid spec: {exc}" if source else f"invalid check spec: {exc}") from None


def call_factory(fn: Callable[..., Any], label: str) -> Any:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        required = [p.name for p in sig.parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if required:
            raise CheckUsageError(f"{label} must take no required arguments; it requires {', '.join(map(repr, required))}")
    try:
        return fn()
    except Exception as exc:
        raise CheckUsageError(f"{label} raised {type(exc).__name__}: {exc}", user_traceback(exc)) from None


# ---------------------------------------------------------------------- helpers


def _type(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def describe_value(value: Any) -> str:
    """``None``, ``a list``, ``an int``: a value's type for a sentence."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # nantrace/


def user_traceback(exc: BaseException) -> str:
    """The traceback as Python prints it, from the first frame outside nantrace (the user's
    code: a check function, an imported module) on; nantrace's own frames above it say nothing."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and _ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _ours(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path == _PACKAGE_DIR or path.startswith(_PACKAGE_DIR + os.sep) or "importlib._bootstrap" in filename


def step_ranges(steps: Iterable[int]) -> str:
    """``[1, 2, 3, 7, 9, 10]`` -> ``"1-3, 7, 9-10"``."""
    out: list[str] = []
    run: list[int] = []
    for s in steps:
        if run and s == run[-1] + 1:
            run.append(s)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [s]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)
