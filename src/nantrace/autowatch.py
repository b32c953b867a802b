"""Zero-code mode: watch every model/optimizer pair that unmodified code creates.

:class:`AutoWatch` installs process-wide hooks (module forward pre/post hooks and an
optimizer step pre-hook) and a class-level wrapper of ``torch.amp.GradScaler.step``. It
remembers the *top-level* module calls (a module called while no other module is
running: the model, the loss module), and the optimizers the code creates (a class-level
wrapper of ``torch.optim.Optimizer.__init__``). When a training module's forward begins
under grad and an optimizer created earlier steps only parameters of it, it opens
``nantrace.watch(model, optimizer)`` right there, so the first step is captured and
localised like any other (:meth:`AutoWatch._attach_at_forward`). Otherwise, at an
optimizer's first step it finds the root module that owns the optimizer's parameters and
opens the guard on the spot; that guard's own step pre-hook still runs for this first step
(torch reads the optimizer's hooks after the global ones), so the first step is checked
too, but not localised (its forward ran before the guard existed). A first
``optimizer.step(closure)`` met before any model was called (Lightning, an L-BFGS script: the model runs
inside the closure) has its closure wrapped, so that the pairing happens inside it
(:meth:`AutoWatch._closure_pairing`). Steps through a GradScaler (``scaler.step(optimizer)``) give the guard
the scaler as well.

:func:`run_script` runs a script as ``python SCRIPT ARGS...`` would, under an AutoWatch;
``nantrace run`` (``nantrace.cli.run``) is the command-line glue around it.

Usage::

    from nantrace.autowatch import AutoWatch
    with AutoWatch(run_dir="runs/auto") as auto:
        runpy.run_path("train.py", run_name="__main__")
    auto.incidents      # [Incident(step=3, kind='nonfinite_loss', op='aten.div.Tensor', module='pool', ...)]
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import runpy
import sys
import threading
import time
import traceback
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import Config
from .errors import NonFiniteError
from .integrations import GuardSession, check_watch_kwargs
from .optimizer_step import in_global_chain
from .patches import AttributePatch, patch_attribute

__all__ = ["AutoWatch", "ScriptResult", "default_run_dir", "run_script"]


class AutoWatch:
    """Watches every (model, optimizer[, GradScaler]) pair that code run inside it steps.

    ``run_dir``: the first pair writes there, later pairs to ``RUN_DIR/<n>-<ModelClass>``
    (``None``: nothing is written). ``on_anomaly`` and ``config`` are those of
    :func:`nantrace.watch`. ``close()`` (or leaving the ``with`` block) closes every guard
    and removes every global hook.
    """

    _nantrace_step_hooks = True
    """Its global step pre-hook is nantrace's own (``optimizer_step.own_hook``): not the user's code."""

    def __init__(self, *, run_dir: str | os.PathLike[str] | None = None, on_anomaly: str = "skip",
                 config: Config | None = None) -> None:
        self.watch_kwargs = check_watch_kwargs(dict(on_anomaly=on_anomaly, config=config, run_dir=run_dir), "AutoWatch")
        self.run_dir = os.fspath(run_dir) if run_dir is not None else None
        self.sessions: list[GuardSession] = []
        self.own_guards: list[Any] = []
        """Guards the code opened itself with ``nantrace.watch`` (left to it: not closed here)."""
        self.notes: list[str] = []
        self.closed = False
        self._handles: list[Any] = []
        self._top_level: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
        self._order = itertools.count()
        self._seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._created: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        """Optimizers the code created since this started and that have not stepped yet."""
        self._first_calls: dict[int, tuple[nn.Module, list[dict[str, Any]]]] = {}
        """A model whose guard opened as its forward began: the keyword arguments its recorders await."""
        self._local = threading.local()
        self._scaler_patch: AttributePatch | None = None
        self._optimizer_patch: AttributePatch | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "AutoWatch":
        """Install the global hooks (done by ``with``)."""
        if self.closed:
            raise RuntimeError("AutoWatch: a closed AutoWatch cannot be started again; create a new one")
        if self._handles:
            return self
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._handles = [
            register_module_forward_pre_hook(self._forward_pre),
            register_module_forward_hook(self._forward_post, with_kwargs=True, always_call=True),
            register_optimizer_step_pre_hook(self._optimizer_pre),
        ]
        self._patch_scaler_class()
        self._patch_optimizer_class()
        return self

    def close(self) -> None:
        """Close every guard and remove every global hook; idempotent."""
        if self.closed:
            return
        self.closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for patch in (self._scaler_patch, self._optimizer_patch):
            if patch is not None:
                patch.remove()
        self._scaler_patch = self._optimizer_patch = None
        self._first_calls.clear()
        for session in self.sessions:
            session.close()

    def __enter__(self) -> "AutoWatch":
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if isinstance(exc, Exception):  # the script crashed: diagnose it while the step is still in memory
            for guard in self.guards:
                guard.diagnose_exception(exc)
        self.close()

    @property
    def guards(self) -> list[Any]:
        """The guards opened so far, in the order their optimizers first stepped."""
        return [s.guard for s in self.sessions]

    @property
    def incidents(self) -> list[Any]:
        """Every guard's incidents, in the order they happened."""
        return sorted((i for g in self.guards for i in g.incidents), key=lambda i: i.time)

    # ------------------------------------------------------------------ global hooks
    def _forward_pre(self, module: nn.Module, args: Any) -> None:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            self._top_level[module] = next(self._order)
            if self._created and not self.closed and module.training and torch.is_grad_enabled():
                self._attach_at_forward(module, args)
        self._local.depth = depth + 1

    def _forward_post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        depth = self._local.depth = max(getattr(self._local, "depth", 1) - 1, 0)
        if depth == 0 and self._first_calls:
            first = self._first_calls.pop(id(module), None)
            if first is not None and first[0] is module:
                for awaited in first[1]:  # before the guard's own hook ends the record (global hooks run first)
                    awaited.update(kwargs or {})

    def _attach_at_forward(self, module: nn.Module, args: Any) -> None:
        """The forward of a training module begins under grad, and an optimizer created earlier steps only
        parameters of it (all of them: a partial owner is left to the first step, which sees every module
        the step called): open the guard now, so that this forward, the loss code after it and so the
        first step are captured and localised like any other. The guard's hooks, put on the module inside
        torch's own pre-hooks, miss this one call: its recorder begins it here, and takes its keyword
        arguments when it ends (a global pre-hook is not given them).

        A float16 model or forward is left to the first step too: a GradScaler it will likely step through
        is known only there (``scaler.step``), and a guard opened without it would take the scaled loss for
        the loss."""
        own: set[int] | None = None
        for optimizer in list(self._created):
            if optimizer in self._seen:
                self._created.discard(optimizer)
                continue
            wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
            if own is None:
                own = {id(p) for p in module.parameters()}
            if not wanted or not wanted <= own:
                continue
            if _half_precision(module):
                self._created.discard(optimizer)
                return
            self._created.discard(optimizer)
            opened = len(self.sessions)
            self._attach(optimizer, None, model=module)
            if len(self.sessions) == opened:
                continue
            guard = self.sessions[-1].guard
            if guard.model is module:  # a wrapper's inner module (DDP, compiled) has its own call: hooked as usual
                awaited: dict[str, Any] = {}
                guard.recorder.forward_pre(module, args, awaited)
                self._first_calls.setdefault(id(module), (module, []))[1].append(awaited)

    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        if self.closed or optimizer in self._seen:
            return None
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if callable(closure) and _own_guard(optimizer) is None and self.owner(optimizer) is None:
            # no model called yet, but the step evaluates a closure: its model may run inside it (Lightning's
            # automatic optimisation, an L-BFGS script): pair there rather than give up on the optimizer
            paired = self._closure_pairing(optimizer, closure)
            if len(args) > 1:
                return (args[0], paired, *args[2:]), kwargs
            return args, {**kwargs, "closure": paired}
        with in_global_chain():  # a guard opened here registers its global hook at its own instance hook
            self._attach(optimizer, None)
        return None

    def _closure_pairing(self, optimizer: torch.optim.Optimizer, closure: Any) -> Any:
        """The closure of the first step of an optimizer that steps parameters of no module called so far (the
        model runs only inside the closure, after torch's step pre-hooks). The optimizer waits in ``_created``,
        so the first training forward in the closure opens its guard as at any first forward
        (:meth:`_attach_at_forward`: captured and localised); once the closure returns, a guard opened in it,
        whose step pre-hook this step never ran, takes the step (its closure check decides it on this evaluation
        and checks every later one, before the update); without a guard then, the modules the evaluation called
        decide as at any first step (:meth:`_attach`: a partial owner, a float16 model; or the note that the
        optimizer steps no model's parameters)."""
        self._created.add(optimizer)
        checked: list[Any] = []
        evaluated = [False]

        def evaluate() -> Any:
            if checked:
                return checked[0]()
            if evaluated[0]:  # nothing was paired at the first evaluation: the script's closure as it is
                return closure()
            try:
                result = closure()
            finally:
                evaluated[0] = True
                self._created.discard(optimizer)
            if self.closed:
                return result
            guard = self._guard_of(optimizer)
            if guard is None and optimizer not in self._seen:
                self._attach(optimizer, None)
                guard = self._guard_of(optimizer)
            if guard is None:
                return result
            first = [result]

            def again() -> Any:  # the evaluation already made, then the script's closure
                return first.pop() if first else closure()

            taken = guard.join_step(optimizer, (optimizer, again), {})
            if taken is None:  # the guard takes no step (closed)
                return result
            checked.append(taken[0][1])
            return checked[0]()

        return evaluate

    def _guard_of(self, optimizer: torch.optim.Optimizer) -> Any:
        """The open guard of ``optimizer`` (a session of this AutoWatch), or ``None``."""
        return next((s.guard for s in self.sessions if s.optimizer is optimizer and not s.closed), None)

    def _patch_optimizer_class(self) -> None:
        original = torch.optim.Optimizer.__init__
        auto_ref = weakref.ref(self)

        @functools.wraps(original)
        def __init__(optimizer: Any, *args: Any, **kwargs: Any) -> None:
            original(optimizer, *args, **kwargs)
            auto = auto_ref()
            if auto is not None and not auto.closed:
                auto._created.add(optimizer)

        self._optimizer_patch = patch_attribute(torch.optim.Optimizer, "__init__", __init__,
                                                purpose="nantrace run learns of each optimizer the script creates")

    def _patch_scaler_class(self) -> None:
        scaler_cls = torch.amp.GradScaler
        original = scaler_cls.step
        auto_ref = weakref.ref(self)

        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            auto = auto_ref()
            if auto is None or auto.closed or not isinstance(optimizer, torch.optim.Optimizer):
                return original(scaler, optimizer, *args, **kwargs)
            if optimizer in auto._seen:
                if not auto._reopen_with(optimizer, scaler):
                    return original(scaler, optimizer, *args, **kwargs)
            else:
                auto._attach(optimizer, scaler)
            if getattr(scaler.__dict__.get("step"), "_nantrace_guard", False):
                return scaler.step(optimizer, *args, **kwargs)  # the guard's own wrapper on the instance
            return original(scaler, optimizer, *args, **kwargs)

        step._nantrace_autowatch = True  # type: ignore[attr-defined]
        self._scaler_patch = patch_attribute(scaler_cls, "step", step, purpose="nantrace run finds the scaler")

    # ------------------------------------------------------------------ pairing
    def _reopen_with(self, optimizer: torch.optim.Optimizer, scaler: Any) -> bool:
        """A guard opened at the model's forward, without a scaler, meets ``scaler.step(optimizer)``: it is
        closed and a guard given the scaler opens for the pair. Returns whether that happened."""
        for i, session in enumerate(self.sessions):
            if session.optimizer is optimizer and session.guard.scaler is None and not session.closed:
                model = session.guard.model
                session.close()
                del self.sessions[i]
                self._attach(optimizer, scaler, model=model)
                return True
        return False

    def _attach(self, optimizer: torch.optim.Optimizer, scaler: Any, model: nn.Module | None = None) -> None:
        """Open a guard for ``optimizer`` and the model that owns its parameters; never raises
        into the script (a failure to watch is noted and the script goes on)."""
        self._seen.add(optimizer)
        name = type(optimizer).__name__
        own = _own_guard(optimizer)
        if own is not None:
            if own not in self.own_guards:
                self.own_guards.append(own)
            self.notes.append(f"{name} is already watched by the script's own nantrace.watch")
            return
        model = model if model is not None else self.owner(optimizer)
        if model is None:
            self._note(f"a {name} optimizer steps parameters of no model the script called; it is not watched")
            return
        kwargs = dict(self.watch_kwargs)
        if self.run_dir is not None and self.sessions:
            kwargs["run_dir"] = os.path.join(self.run_dir, f"{len(self.sessions) + 1}-{type(model).__name__}")
        try:
            self.sessions.append(GuardSession(model, optimizer, scaler, **kwargs))
        except Exception as exc:  # our failure must not stop the user's training
            self._note(f"could not watch {type(model).__name__} with {name}: {type(exc).__name__}: {exc}")

    def owner(self, optimizer: torch.optim.Optimizer) -> nn.Module | None:
        """The top-level module called so far that holds most of ``optimizer``'s parameters
        (ties: the one with fewer parameters, then the one called last); ``None`` if none does."""
        wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
        best: tuple[int, int, int] | None = None
        found: nn.Module | None = None
        for module, order in list(self._top_level.items()):
            params = list(module.parameters())
            covered = sum(1 for p in params if id(p) in wanted)
            if covered == 0:
                continue
            key = (covered, -len(params), order)
            if best is None or key > best:
                best, found = key, module
        return found

    def _note(self, message: str) -> None:
        from .console import note

        self.notes.append(message)
        note(message)

    def end_runs_as(self, status: str, reason: str | None) -> None:
        """Record in every run store opened here that the run ended as ``status`` (the
        script failed or was interrupted), before :meth:`close` closes the stores."""
        for guard in self.guards:
            store = getattr(guard, "store", None)
            if store is not None:
                store.end_as(status, reason)


def _half_precision(module: nn.Module) -> bool:
    """float16 parameters, or a float16 autocast running: the training likely steps through a GradScaler."""
    if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16:
        return True
    if torch.cuda.is_available() and torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.float16:
        return True
    return any(p.dtype == torch.float16 for p in itertools.islice(module.parameters(), 64))


def _own_guard(optimizer: torch.optim.Optimizer) -> Any:
    """The guard the code itself opened on ``optimizer`` with ``nantrace.watch``, if any."""
    from .guard import Guard

    hooks = getattr(optimizer, "_optimizer_step_pre_hooks", {})
    return next((h.__self__ for h in hooks.values() if isinstance(getattr(h, "__self__", None), Guard)), None)


# ---------------------------------------------------------------------- scripts
@dataclasses.dataclass
class ScriptResult:
    """How a script run under :func:`run_script` ended."""

    exit_code: int
    """What ``python SCRIPT`` would have exited with: the ``SystemExit`` code, 1 after an
    uncaught exception, 130 after Ctrl-C, else 0."""
    watch: AutoWatch
    """The AutoWatch it ran under (closed): guards, incidents, notes."""
    error: BaseException | None = None
    """The uncaught exception, if any (not ``SystemExit``)."""
    message: str | None = None
    """What Python prints for a ``SystemExit`` with a non-integer code (``sys.exit("msg")``)."""
    traceback: str | None = None
    """The uncaught exception's traceback, starting at the script's own frames."""
    diagnosed: list[Any] = dataclasses.field(default_factory=list)
    """Incidents of kind ``exception``: the uncaught exception was caused by a bad value (printed after the traceback)."""


def default_run_dir(script: str | os.PathLike[str], root: str | os.PathLike[str] = "nantrace-runs") -> Path:
    """``nantrace-runs/<script-stem>-<YYYYmmdd-HHMMSS>`` (with ``-2``, ``-3``... if taken)."""
    base = Path(root) / f"{Path(script).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def run_script(script: str | os.PathLike[str], args: list[str] | tuple[str, ...] = (), *,
               run_dir: str | os.PathLike[str] | None = None, on_anomaly: str = "skip",
               config: Config | None = None) -> ScriptResult:
    """Run ``script`` as ``python SCRIPT ARGS...`` would (``__name__ == "__main__"``,
    ``sys.argv``, ``sys.path[0]``) with every model/optimizer pair it steps watched.

    Never raises for what the script does: the outcome, exit code included, is returned.
    ``sys.argv`` and ``sys.path`` are restored and every hook is removed afterwards.
    """
    path = os.path.abspath(os.fspath(script))
    auto = AutoWatch(run_dir=run_dir, on_anomaly=on_anomaly, config=config)
    result = ScriptResult(exit_code=0, watch=auto)
    problem = _compile_error(path)
    if problem is not None:  # as `python SCRIPT` does: the error alone, exit code 1, nothing run
        result.exit_code, result.error = 1, problem
        result.traceback = "".join(traceback.format_exception_only(type(problem), problem))
        auto.close()
        return result
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [os.fspath(script), *args]
    sys.path.insert(0, os.path.dirname(path))
    try:
        with auto:
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as exc:
                result.exit_code, result.message = _exit_status(exc.code)
                if result.exit_code:
                    auto.end_runs_as("failed", f"the script exited with code {result.exit_code}")
            except KeyboardInterrupt as exc:
                result.exit_code, result.error = 130, exc
                result.traceback = _script_traceback(exc, path)
                auto.end_runs_as("interrupted", "stopped with Ctrl-C (KeyboardInterrupt)")
            except BaseException as exc:  # the script's uncaught exception: report it as Python would
                result.exit_code, result.error = 1, exc
                result.traceback = _script_traceback(exc, path)
                for guard in auto.guards:  # diagnosed while the step is still in memory; shown after the traceback
                    found = guard.diagnose_exception(exc, announce=False)
                    if found is not None:
                        result.diagnosed.append(found)
                auto.end_runs_as("failed", f"the script raised {type(exc).__name__}: {exc}")
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        auto.close()
    return result


def _compile_error(path: str) -> BaseException | None:
    """The error ``python SCRIPT`` would stop on before running a line (a syntax error, an
    unreadable file, a null byte), or ``None``."""
    try:
        with open(path, "rb") as fh:
            source = fh.read()
        compile(source, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError, OSError) as exc:
        return exc
    return None


def _exit_status(code: Any) -> tuple[int, str | None]:
    if code is None:
        return 0, None
    if isinstance(code, bool) or not isinstance(code, int):
        return 1, str(code)
    return code & 0xFF, None  # what the OS keeps of it, as for `python SCRIPT`


def _script_traceback(exc: BaseException, script: str) -> str:
    """The traceback as Python prints it, without the frames of nantrace and runpy above the script."""
    tb = exc.__traceback__
    first = tb
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) == script:
            first = tb
            break
        tb = tb.tb_next
    if isinstance(exc, NonFiniteError):  # ends in the script's frames, followed by the diagnosis
        from ._user_traceback import diagnosis_lines, user_traceback

        first = user_traceback(first)
        return "".join(traceback.format_exception(type(exc), exc, first)) + "\n" + "\n".join(
            diagnosis_lines(exc.incident)) + "\n"
    from ._user_traceback import without_wrappers

    return "".join(traceback.format_exception(type(exc), exc, without_wrappers(first)))
