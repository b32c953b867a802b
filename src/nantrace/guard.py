"""The always-on guard: hooks a model, optimizer and GradScaler without changing the
user's loop, checks every optimizer step with one fused reduction, and applies the
response policy before a corrupted update can land.

Usage::

    guard = nantrace.watch(model, optimizer, run_dir="runs/exp1")
    for batch in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(batch.x), batch.y)
        loss.backward()
        optimizer.step()          # skipped (and reported) if anything is non-finite
    guard.close()

    # stderr, when step 812 goes wrong:
    # ╭─ nantrace · step 812 · nonfinite_loss · skipped ─────────────────╮
    # │ what    log of an argument outside its domain in module 'head' … │

The guard is the orchestrator; each job lives in its own module (docs/architecture.md):
step capture (``step_capture.py``), the decision (``decision.py``), reporting (``reporting.py``),
the process-wide patches (``patches.py``), and the read-only view of what is watched that the
monitors, the bundle writer, the TensorBoard writer and the localiser receive (``watched.py``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from ._scaler_hooks import patch_scaler
from .config import Config
from .capture import RunningStatistics
from .decision import Decision, StepJudge
from .detection.scaler import ScalerMonitor, replay_at_scale_one
from .distributed import install_local_grad_check, world
from .dynamics.base import Monitor, StepContext
from .dynamics.registry import build_monitors
from .errors import NonFiniteError
from .fsdp_grad_check import watch_fsdp_local_grads
from .incident import Incident
from .optimizer_step import (ClosureRun, StepAbandoned, evaluation_finite, global_hooks_after_own,
                             keep_last_global_post, pre_hooks_after_own, put_first, put_last_post,
                             register_first_global, user_post_hooks)
from .patches import BACKWARD, DATA_LOADER_NEXT, EXCEPTHOOK, FUNCTION_APPLY, VALUE_CHECK_FUNCTIONS, PatchUnit
from .reporting import Reporter
from .response.checkpoints import CheckpointGate
from .response.escalation import EscalationLadder
from .response.precision import PrecisionFallback
from .response.rollback_policy import RollbackPolicy
from .response.update_check import UpdateCheck
from .step_capture import StepRecorder
from .sync_free import SyncFree, ineligible, reconcile
from .storage.runstore import RunStore
from .taxonomy import Action
from .watched import GuardState, Watched

F = TypeVar("F", bound=Callable[..., Any])


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's own module inside DDP/FSDP/``torch.compile`` wrappers."""
    seen = 0
    while seen < 8:
        seen += 1
        if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        elif type(model).__name__ in ("DistributedDataParallel", "DataParallel") and isinstance(
            getattr(model, "module", None), nn.Module
        ):
            model = model.module
        else:
            break
    return model


class Guard:
    """Watches one model (and its optimizer / GradScaler) for numerical failures.

    Created by :func:`nantrace.watch`. ``incidents`` lists what was found, oldest first;
    ``close()`` removes every hook and leaves model, optimizer and scaler as found.
    """

    _nantrace_step_hooks = True
    """Its optimizer step hooks are nantrace's own (``optimizer_step.own_hook``): not the user's code."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scaler: Any,
        *,
        run_dir: str | os.PathLike[str] | None,
        on_anomaly: str,
        config: Config,
    ) -> None:
        self.model = model
        self.root = unwrap_model(model)
        self.optimizer = optimizer
        self.scaler = scaler
        self.policy = on_anomaly
        self.config = config
        self.rank, self.world_size = world()
        self.run_dir = os.fspath(run_dir) if run_dir is not None else None
        if self.run_dir is not None and self.rank != 0:
            self.run_dir = os.path.join(self.run_dir, f"rank{self.rank}")  # every rank keeps its own store and bundles
        self.state = GuardState()
        """The step, closed and replaying flags (shared with the read-only view)."""

        names = {id(p): n for n, p in self.root.named_parameters()}
        # Every parameter the optimizer steps, frozen ones included: a layer unfrozen later (LoRA, a
        # fine-tune's gradual unfreezing) must be checked from its first gradient on. A parameter
        # without a gradient in a step is skipped by that step's check.
        params = _optimizer_params(optimizer) if optimizer is not None else \
            [p for p in self.root.parameters() if p.requires_grad]
        param_names = [names.get(id(p), f"param[{i}]") for i, p in enumerate(params)]
        self.sharded = any(hasattr(p, "to_local") for p in params)
        """Parameters are DTensor shards (FSDP2): norms are combined across ranks; every rank replays together."""
        self.store: RunStore | None = RunStore(self.run_dir) if self.run_dir is not None else None
        self.watched = Watched(model=model, root=self.root, optimizer=optimizer, scaler=scaler, params=params,
                               param_names=param_names, run_dir=self.run_dir, store=self.store, config=config,
                               policy=on_anomaly, rank=self.rank, world_size=self.world_size, sharded=self.sharded,
                               _state=self.state)
        """What this guard watches, as the read-only view its components receive."""
        self._param_names = list(param_names)
        """The names as the list every step's :class:`StepContext` shares (made once, not per step)."""

        self._handles: list[Any] = []
        self._patches = PatchUnit(id(self))
        """Every process-wide patch this guard holds (``nantrace.patches``), removed as a unit by ``close()``."""
        self._pending_exception: BaseException | None = None
        self._decision: Decision | None = None
        self._closure_run: ClosureRun | None = None
        """The ``optimizer.step(closure)`` in progress: its evaluations so far."""
        self._global_handle: Any = None
        """The guard's global step pre-hook (``_register_global_pre``), ``None`` until registered."""
        self._decided_globally = False
        """This step was decided in the global pre-hook (a user's global hook follows it): the instance hook passes."""
        self._post_handle: Any = None
        """The guard's instance step post-hook (kept last among the optimizer's while a user's one is there)."""
        self._global_post_handle: Any = None
        """The guard's global step post-hook, registered the first time a user's global post-hook is seen."""
        self._post_reason: str | None = None
        """This step runs user step post-hooks after the update (``_post_hooks_follow``): why it is not proven."""
        self._post_deferred = False
        """A user's global post-hook runs after the guard's instance post-hook: the global one ends the update."""
        self._blocked_snapshot = False
        """A blocked step with user post-hooks: what the step wrote (the hooks' writes) is undone after it."""
        self.in_scaler_step = False
        """``scaler.step(optimizer)`` is running: the optimizer's own hooks leave the step to the scaler's."""
        self._last_row: dict[str, Any] | None = None
        self._param_read: tuple[float, int] | None = None
        """The last read parameter norm and its step (``last_step`` gives it to loggers)."""
        self.monitors: list[Monitor] = []
        self.recorder = StepRecorder(self.watched, on_exception=self.note_exception)
        """Step capture: the model's forwards, the loss code's tape and the loss of the step in progress."""
        self.judge = StepJudge(self.watched)
        """The decision: one read per step, triage, agreement across ranks, the action."""
        self.precision = PrecisionFallback(self.root, config.response.precision_fallback_after)
        self.rollback = RollbackPolicy(self) if optimizer is not None and (
            on_anomaly == "rollback" or (on_anomaly == "skip" and config.response.skip_snapshots)) else None
        self.ladder = EscalationLadder(self)
        self.reporter = Reporter(self.watched, ladder=self.ladder, precision=self.precision, rollback=self.rollback,
                                 capture=functools.partial(getattr, self.recorder, "capture"),  # no cycle via the guard
                                 history=deque(maxlen=config.outputs.flight_recorder))
        """Where incidents go: localisation, bundle, response, store, console."""
        self.checkpoints = CheckpointGate(self)
        self.scaler_monitor = ScalerMonitor(max_skips=config.detection.scaler_max_skips,
                                            min_scale=config.detection.scaler_min_scale,
                                            max_drop=config.detection.scaler_max_drop)
        self.update_check = UpdateCheck(optimizer, params, param_names, enabled=config.detection.check_updates,
                                        model_names=names) \
            if optimizer is not None and not self.sharded else None
        """Checks the optimizer's own updates (phase ``optimizer``) and undoes a non-finite one."""
        self._device_step = False
        self._stop_next_step: NonFiniteError | None = None
        """Sync-free mode: a stopping action found by a read between steps, raised before the next update."""
        self.sync_free: SyncFree | None = None
        """Steps decided on the device (``Config.detection.sync_free``), or ``None``: every step reads the host."""
        self.running_stats: RunningStatistics | None = None
        """The norm layers' running statistics as the last applied step left them (a blocked step puts back those
        its forward left non-finite); ``None`` without such buffers, under FSDP2 and in the sync-free mode."""
        try:
            self.sync_free = self._sync_free_mode()
            if self.sync_free is None and not self.sharded:
                self.running_stats = RunningStatistics(self.root) or None
                if self.running_stats is not None:
                    self.running_stats.keep()
            if self.store is not None:
                self._write_meta()
            self._install()
            for monitor in build_monitors(config):
                self.add_monitor(monitor)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ state
    @property
    def step(self) -> int:
        """Index of the step in progress (each ``optimizer.step()`` counts, applied or not)."""
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:  # a framework resuming from a checkpoint counts on from its step
        self.state.step = int(value)

    @property
    def closed(self) -> bool:
        return self.state.closed

    @property
    def incidents(self) -> list[Incident]:
        """Every incident so far, oldest first."""
        return self.reporter.incidents

    # ------------------------------------------------------------------ set-up
    def _install(self) -> None:
        rec = self.recorder
        if rec.prelude is not None:
            for owner in dict.fromkeys(o for o in (self.optimizer, self.model, self.root) if o is not None):
                self._handles.append(rec.quiet(owner))
        self._handles.append(self.model.register_forward_pre_hook(rec.forward_pre, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(rec.forward_post, with_kwargs=True, always_call=True))
        if not self.sharded and not hasattr(self.model, "_orig_mod"):  # a compiled graph would trace the parts' hooks
            rec.watch_parts(self.root)
        if self.update_check is not None:
            self.update_check.on_raise = self._optimizer_raised
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._instance_pre))
            put_first(self.optimizer, self._handles[-1])  # a user's pre-hook is the optimizer's code, checked as such
            self._register_global_pre()
            self._handles.append(self.optimizer.register_step_post_hook(self._optimizer_post))
            self._post_handle = self._handles[-1]
        if self.scaler is not None:
            patch_scaler(self, self._patches)
        self._patches.listen(BACKWARD, rec.on_loss)
        self._patches.listen(EXCEPTHOOK, self.diagnose_exception)
        self._patches.listen(VALUE_CHECK_FUNCTIONS, self.note_exception)
        if rec.tape is not None:
            self._patches.listen(FUNCTION_APPLY, _no_listener)
            self._patches.listen(DATA_LOADER_NEXT, _no_listener)
        fsdp_check = watch_fsdp_local_grads(self) if self.sharded and self.world_size > 1 else None
        if fsdp_check is not None:
            self._handles.append(fsdp_check)  # removed by close()
        self.checks_local_grads = fsdp_check is not None or (self.world_size > 1 and install_local_grad_check(self))

    def _sync_free_mode(self) -> SyncFree | None:
        choice = self.config.detection.sync_free
        if choice is False:
            return None
        why = ineligible(self.watched, scaler=self.scaler, policy=self.policy,
                         skip_snapshots=self.config.response.skip_snapshots)
        if why is not None:
            if choice is True:
                raise ValueError(f"Config.detection.sync_free=True, but {why}. Use sync_free='auto' (decided "
                                 "per set-up) or False (the synchronous check).")
            return None
        if choice == "auto" and all(p.device.type == "cpu" for p in self.watched.params):
            return None  # on the CPU a read drains no queue: the device-side verdict would cost more than it saves
        return SyncFree(self.watched, self.judge, self.update_check)

    def _write_meta(self) -> None:
        assert self.store is not None
        from . import __version__

        watched = self.watched
        for key, value in (("nantrace_version", __version__), ("torch_version", torch.__version__),
                           ("model_class", type(self.root).__name__),
                           ("optimizer_class", type(self.optimizer).__name__ if self.optimizer else None),
                           ("scaler", self.scaler is not None), ("policy", self.policy),
                           ("config", self.config.to_dict()), ("param_names", list(watched.param_names)),
                           ("num_parameters", sum(p.numel() for p in watched.params)), ("rank", self.rank),
                           ("pid", os.getpid()),
                           ("cwd", os.getcwd())):  # source paths in incidents are relative to the cwd
            self.store.set_meta(key, value)

    def replayable(self, fn: F) -> F:
        """Wrap the loss computation (``batch -> loss``, forward only) so a failing step can be
        replayed whole, loss function included."""
        if not callable(fn):
            raise TypeError(f"guard.replayable expects a callable (batch -> loss), got {type(fn).__name__}")
        return self.recorder.replayable(fn)

    # ------------------------------------------------------------ the optimizer's step
    def _register_global_pre(self) -> None:
        """The guard's global step pre-hook, first of all (``optimizer_step.register_first_global``); deferred to
        the first step when the guard opens inside torch's global hook chain (AutoWatch pairing at a step)."""
        if self._global_handle is None:
            self._global_handle = register_first_global(self._global_pre)
            if self._global_handle is not None:
                self._handles.append(self._global_handle)

    def _global_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        """Torch's global step pre-hooks run before the instance hooks: while a user's global hook follows this
        one, the step is decided here, so that the hook is code of the optimizer's step, checked as such."""
        if optimizer is not self.optimizer:
            return None
        self._decided_globally = bool(global_hooks_after_own(optimizer))
        return self._optimizer_pre(optimizer, args, kwargs) if self._decided_globally else None

    def join_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        """A step already inside ``optimizer.step()`` when this guard opened (``nantrace run`` pairing inside the
        first step's closure): do what the guard's step pre-hook does, now. Returns the ``(args, kwargs)`` the step
        goes on with (its closure checked), or ``None``."""
        return self._instance_pre(optimizer, args, kwargs)

    def _instance_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        if self._global_handle is None:
            self._register_global_pre()
        if self._decided_globally:
            self._decided_globally = False
            return None
        return self._optimizer_pre(optimizer, args, kwargs)

    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        self.recorder.end_step_code()
        if self._pending_exception is not None:  # the user caught a failure of this step and went on
            self.diagnose_exception(self._pending_exception)
        if self.closed:
            return None
        self._closure_run = None
        self._post_reason = self._post_hooks_follow()
        if self.in_scaler_step:
            hooks = self._hooks_follow()
            self._prepare_update(self._decision, unproven=hooks, grads=hooks is not None)
            return None
        if self._stop_next_step is not None:  # a stopping action found when the host read the last step
            err, self._stop_next_step = self._stop_next_step, None
            self.recorder.reset()
            raise err
        if self.sync_free is not None:
            self.settle_device_step()  # the previous step, decided on the device: reported before this update
        positional = len(args) > 1  # args[0] is the optimizer itself
        closure = args[1] if positional else kwargs.get("closure")
        if closure is None:
            hooks = self._hooks_follow()
            # a user's pre- or post-hook runs after this check: decided on the host, the update copied and checked
            self._prepare_update(self.decide(grads_scaled=False) if hooks or self._post_reason else self._check_step(),
                                 unproven=hooks, grads=hooks is not None)
            return None
        # Frameworks (Lightning) run forward and backward inside step(closure), and an optimizer may evaluate
        # the closure several times (L-BFGS): decide right after its first evaluation has produced the
        # gradients, before the update reads them; check each later evaluation (_checked_closure).
        checked = self._checked_closure(closure)
        if positional:
            return (args[0], checked, *args[2:]), kwargs
        return args, {**kwargs, "closure": checked}

    def _optimizer_raised(self, optimizer: torch.optim.Optimizer, exc: Exception) -> bool:
        """An exception escaped ``optimizer.step()`` (the post-hook never ran); ``True`` swallows it.

        The guard had blocked the update (gradients set aside) and the optimizer's code failed for
        want of them (SGD-HD reads every ``p.grad``): the update did not happen, as decided, so the
        step ends as a blocked one and training goes on. Otherwise the step is replayed on copies
        (``update_replay.step_exception_incident``): when a value caused it (a decomposition of a
        singular matrix, a NaN the step made) it is an incident of kind ``exception``, what the
        update had written is undone, and the user's exception propagates unchanged."""
        decision = self._decision
        self._post_deferred = False  # the post-hooks did not all run: the step ends here
        if isinstance(exc, StepAbandoned):  # a later evaluation of the closure was non-finite: ended and undone
            self._closure_run = None
            if decision is not None and not self.closed:
                self.restore_grads(decision)
                self.finish_step(decision)
            return True
        if self.closed or self.state.replaying or decision is None or isinstance(exc, NonFiniteError):
            return False
        if decision.block and decision.stashed is not None:
            self._end_update()
            return True
        if self.sharded or getattr(exc, "_nantrace_seen", False) or self.update_check is None:
            return False
        from .diagnosis.update_replay import step_exception_incident

        self._blocked_snapshot = False
        self.update_check.abandon()
        try:
            with torch.no_grad():
                incident = step_exception_incident(self.watched, exc, self.reporter.history)
        except Exception:  # evidence, not the user's failure: without it, nothing is recorded
            return False
        if incident is None:
            return False
        with contextlib.suppress(AttributeError, TypeError):
            exc._nantrace_seen = True  # type: ignore[attr-defined]
        decision.incident = incident
        if self.store is not None and self.config.outputs.save_bundle:
            self.reporter.write_bundle(incident)
        self.reporter.record(incident)
        self.restore_grads(decision)
        self.finish_step(decision, raised=True)
        return False

    def _hooks_follow(self) -> str | None:
        """Why the update cannot be proven from this check's figures: user step pre-hooks run after it
        (``optimizer_step.pre_hooks_after_own``: a dict length per step), or ``None``."""
        hooks = pre_hooks_after_own(self.optimizer)
        if not hooks:
            return None
        names = ", ".join(getattr(h, "__qualname__", type(h).__name__) for h in hooks[:3])
        return (f"step pre-hooks of the user's ({names}) run inside optimizer.step() after nantrace's check and may "
                "rewrite the gradients or parameters it read")

    def _post_hooks_follow(self) -> str | None:
        """Why the update cannot be proven from this check's figures: user step post-hooks run inside
        ``optimizer.step()`` after the update (``optimizer_step.user_post_hooks``: a dict length or two per step),
        or ``None``. Puts the guard's post-hooks after them: its instance post-hook last among the optimizer's,
        and, while a user's global post-hook exists, a global post-hook of its own last among torch's (the update
        is then ended there: ``_post_deferred``)."""
        self._post_deferred = False
        instance, globals_ = user_post_hooks(self.optimizer)
        if not instance and not globals_:
            return None
        put_last_post(self.optimizer, self._post_handle)  # type: ignore[arg-type]
        if globals_:
            handle = keep_last_global_post(self._global_post, self._global_post_handle)
            if handle is not None and handle is not self._global_post_handle:
                self._global_post_handle = handle
                self._handles.append(handle)  # removed by close()
            self._post_deferred = handle is not None
        hooks = instance + globals_
        names = ", ".join(getattr(h, "__qualname__", type(h).__name__) for h in hooks[:3])
        return (f"step post-hooks of the user's ({names}) run inside optimizer.step() after the update and may write "
                "the parameters")

    def _checked_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The closure as the optimizer calls it: the first evaluation is checked as the step (decided, the
        update prepared); each later one (L-BFGS' iterations and line search) is captured like a step and checked
        with one host read, and a non-finite one is diagnosed from its own capture and ends the step, undone.
        After a blocked evaluation the closure no longer runs (the optimizer gets the same loss, no gradients)."""
        run = self._closure_run = ClosureRun()
        once = type(self.optimizer).__module__.startswith("torch.optim.") and \
            not isinstance(self.optimizer, torch.optim.LBFGS)  # torch's own optimizers but L-BFGS evaluate it once

        def evaluate() -> Any:
            if run.stopped:
                return run.result
            run.calls += 1
            later = run.calls > 1
            # a later evaluation of a step decided on the host, whose update the copies can undo
            checked = later and self._decision is not None and not self._decision.block \
                and self.update_check is not None and not self.closed
            if checked:  # captured as a step of its own: a failing evaluation is localised from its own capture
                self.recorder.reset()
                self.recorder.start_prelude()
            with torch.enable_grad():
                result = closure()
            self.recorder.end_step_code()  # the closure's code has ended (a training_step that returned None too)
            if not later:
                run.first = result
                self._first_evaluation(run, result, once=once)
            elif checked and not evaluation_finite(result, self.watched.params):
                self._later_evaluation(run, result)
            return result

        return evaluate

    def _first_evaluation(self, run: ClosureRun, result: Any, *, once: bool) -> None:
        decision = self._check_step()
        if decision is not None and decision.block:
            run.stopped, run.result = True, result
            if self.update_check is not None:  # what the optimizer does without the gradients is undone after it
                self.update_check.before_update(grad_norm=None, param_norm=None, unproven="the step is blocked")
                run.snapshot = True
        self._prepare_update(decision, unproven=None if once else (
            f"{type(self.optimizer).__name__} may evaluate the closure again after this check"))

    def _later_evaluation(self, run: ClosureRun, result: Any) -> None:
        """A later evaluation of the closure was non-finite (one read): decide it as the step, from its own
        capture; a blocked one ends the step (``StepAbandoned``) and what the step wrote is undone."""
        assert self.update_check is not None
        first = self._decision
        try:
            decision = self.decide(grads_scaled=False)
        except NonFiniteError:  # the policy stops the run: nothing of this step's update stays
            self.update_check.abandon()
            raise
        if decision.incident is None or not decision.block:
            self._decision = first  # the full check blocks nothing (a norm that overflowed): the step goes on
            return
        run.stopped, run.result = True, result
        self.update_check.abandon(undo=decision.incident.action != Action.ROLLED_BACK)
        raise StepAbandoned(f"nantrace: evaluation {run.calls} of the closure is non-finite at step {self.step}",
                            step_result=run.first)

    def _prepare_update(self, decision: Decision | None, *, unproven: str | None = None, grads: bool = False) -> None:
        """Block the update (grads set aside) or let monitors see the parameters before it. ``unproven``:
        why the update must be copied and checked rather than proven (code of the step runs after this check);
        ``grads``: that code may write the gradients, copied too and put back with an undone update."""
        params = self.watched.params
        if decision is not None and decision.block:
            decision.stashed = [(p, p.grad) for p in params]
            for p in params:
                p.grad = None
            if self._post_reason and self.update_check is not None and self._closure_run is None:
                # the user's post-hooks still run (a renormalisation, a clip): what they write is undone after them
                self.update_check.before_update(grad_norm=None, param_norm=None, unproven="the step is blocked")
                self._blocked_snapshot = True
            return
        if unproven is None:
            unproven = self._post_reason
        if decision is not None and not decision.scaler_skip and self.update_check is not None:
            self.update_check.before_update(grad_norm=decision.health.grad_norm, param_norm=decision.param_bound,
                                            unproven=unproven, grads=grads)
        if self.monitors and not (decision is not None and decision.scaler_skip):
            for monitor in self.monitors:
                monitor.before_update(self.step, params)

    def _optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._post_deferred:  # else a user's global post-hook follows: the guard's global post-hook ends it
            self._end_update()

    def _global_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Torch's global step post-hooks run after the instance ones: while a user's global post-hook runs in
        this optimizer's step, the update is checked here, after it (this hook is kept last)."""
        if optimizer is self.optimizer and self._post_deferred:
            self._post_deferred = False
            self._end_update()

    def _end_update(self) -> None:
        """After the update and every user's post-hook: check it, then book the step."""
        if self.closed:
            return
        if self._device_step:  # decided on the device: the host books it at the next step
            self._device_step = False
            self.judge.provenance.forget()  # an update no host bound covers: the next host check reads every parameter
            assert self.sync_free is not None
            self.sync_free.after_update()
            self._next_step()
            return
        run, self._closure_run = self._closure_run, None
        snapshot, self._blocked_snapshot = self._blocked_snapshot or (run is not None and run.snapshot), False
        if snapshot and self.update_check is not None:
            self.update_check.abandon()  # a blocked step: what the optimizer and hooks did without gradients is undone
        if self._decision is not None and not self._decision.block and self.update_check is not None:
            self._check_update(self._decision)
            self.judge.provenance.updated(None if self._decision.block else self.update_check.param_bound)
        elif self._decision is None:
            self.judge.provenance.forget()  # an update that was not checked
        if self.in_scaler_step:
            return
        decision = self._decision
        if decision is None:
            self.state.step += 1  # a step nothing decided (a guard opened inside it): not checked
            self.recorder.reset()
            return
        self.restore_grads(decision)
        self.finish_step(decision)

    def _check_update(self, decision: Decision) -> None:
        """After the update: a non-finite result is undone and reported at this step (phase ``optimizer``)."""
        assert self.update_check is not None
        failure = self.update_check.after_update()
        if failure is not None:
            from .diagnosis.update_replay import optimizer_incident

            decision.incident, decision.block = optimizer_incident(self.watched, failure, self.reporter.history), True
            self._report(decision.incident, decision)

    def restore_grads(self, decision: Decision) -> None:
        """Put back the gradients a blocked update set aside."""
        if decision.stashed is not None:
            for p, g in decision.stashed:
                p.grad = g
            decision.stashed = None

    # ------------------------------------------------------------ the decision
    def _check_step(self) -> Decision | None:
        """Decide this step: on the device when the sync-free mode can (``None`` then: the verdict
        is with the optimizer), otherwise with the step's one host read."""
        if self.sync_free is not None and self._post_reason is None:  # post-hooks: decided and checked on the host
            last = self.reporter.history[-1] if self.reporter.history else self._last_row
            with torch.no_grad():
                staged = self.sync_free.try_stage(self.recorder.capture, last, self._lrs)
            if staged:
                self._device_step = True
                self._decision = None
                return None
        return self.decide(grads_scaled=False)

    def settle_device_step(self, *, stop: bool = True) -> Incident | None:
        """Decide on the host the step the device decided (sync-free mode): read its figures (copied
        long ago), then triage, report, localise and book it exactly as the synchronous mode would
        have at its own step. Runs before the next update; a stopping action raises from there
        (``stop=False``: recorded now, raised by the next ``optimizer.step()`` before its update, as
        when ``guard.last_step`` asks for the figures). Returns the step's incident."""
        sf = self.sync_free
        pending = sf.take() if sf is not None else None
        if pending is None:
            return None
        local, device_block, shared = pending.values()
        now = self.state.step
        self.state.step = pending.step
        live = self.recorder.swap(pending.capture)
        raised = False
        try:
            with torch.no_grad():
                decision = self.judge.conclude(
                    self.watched, pending.capture, pending.staged, local, shared, pending.ranks, [], pending.grad_index,
                    via_scaler=False, loaded_state=lambda finite: self.checkpoints.loaded_state_finding(self.step, finite),
                    lrs=pending.lrs, history=self.reporter.history)
            reconcile(decision, device_block, pending.bounds, self.reporter,
                      peers=pending.ranks.device_blockers() if pending.ranks is not None and not self.sharded else None)
            if decision.incident is not None:
                try:
                    self._report(decision.incident, decision)
                except NonFiniteError as err:
                    raised = True
                    if stop:
                        raise
                    self._stop_next_step = err
            if not raised:
                if not decision.block and self.update_check is not None:
                    self.update_check.account(grad=decision.health.grad_norm, param=decision.health.param_norm)
                self._book(decision)
            return decision.incident
        finally:
            self.state.step = now
            self.recorder.swap(live)
            if raised:
                self.recorder.reset()  # the step in progress is abandoned with the exception

    def decide(self, *, grads_scaled: bool, via_scaler: bool = False) -> Decision:
        """Check the step (one host sync) and decide; an incident goes to the reporter."""
        decision = self.judge.decide(self.watched, self.recorder.capture, grads_scaled=grads_scaled,
                                     via_scaler=via_scaler,
                                     loaded_state=lambda finite: self.checkpoints.loaded_state_finding(self.step, finite),
                                     lrs=self._lrs(), history=self.reporter.history)
        if decision.incident is None and self.rollback is not None:
            self.rollback.before_healthy_update(self.step)
        self._decision = decision
        if decision.incident is not None:
            self._report(decision.incident, decision)
        return decision

    def _report(self, incident: Incident, decision: Decision) -> None:
        self.reporter.report(incident, decision, on_stop=lambda: self.finish_step(decision, raised=True))

    # ------------------------------------------------------------ failures that raise
    def note_exception(self, exc: BaseException) -> None:
        """Remember an exception the step raised, to diagnose once it has left torch's machinery.

        Called where it is raised (the model's forward, a call of the loss code): replaying there
        would register hooks on modules whose hook tables torch is iterating. The diagnosis runs at
        the next safe point: ``with guard:`` exit, an uncaught exception (``sys.excepthook``),
        ``nantrace run``, the framework callbacks, the next ``optimizer.step()`` or ``close()``.
        """
        if not self.closed and not self.state.replaying and isinstance(exc, Exception) and self._pending_exception is None:
            self._pending_exception = exc
            gradient_tape = self.recorder.gradient_tape
            if getattr(exc, "_nantrace_backward", False) and self._decision is None:
                # raised by backward() (anomaly mode's check): the engine has stopped, no forward runs, and a
                # loop that catches it zeroes the gradients before any later safe point
                self.diagnose_exception(exc)
            elif self.recorder.prelude_failed and not self.recorder.in_forward and self._decision is None \
                    and not self.recorder.active:
                # raised by the step's code before the model's forward (an index past a replay buffer's end, a
                # sampler on NaN probabilities): nothing of the step runs yet, and a loop that catches it and goes
                # on to the next batch would start that batch's prelude over the kept call
                self.diagnose_exception(exc)
            elif gradient_tape is not None and gradient_tape.recording and self._decision is None:
                # raised between backward() and optimizer.step() (clip_grad_norm_'s error_if_nonfinite), outside any
                # forward: safe to replay now, while the gradients are still the step's (a loop that catches it
                # zeroes them before any later safe point)
                self.diagnose_exception(exc)

    def diagnose_exception(self, exc: BaseException, *, announce: bool = True) -> Incident | None:
        """Diagnose an exception the current step raised (called by nantrace's own hooks: the
        model's forward, the loss code, ``with guard:`` and an uncaught exception).

        When a value caused it (a NaN reaching an op that validates its input, an index out of
        range, an argument outside an op's domain) an incident of kind ``exception`` is recorded,
        printed and bundled, and returned; the exception itself is left to propagate unchanged.
        Anything else returns ``None``. Each exception is diagnosed once. ``announce=False``
        keeps it from being printed (the caller prints it, e.g. after the traceback).
        """
        if exc is self._pending_exception:
            self._pending_exception = None
        if self.closed or self.state.replaying or not isinstance(exc, Exception) or isinstance(exc, NonFiniteError):
            return None
        if getattr(exc, "_nantrace_seen", False):
            return None
        with contextlib.suppress(AttributeError, TypeError):
            exc._nantrace_seen = True  # type: ignore[attr-defined]
        if not (self.recorder.active or self.recorder.prelude_failed):
            return None
        from .localisation.exceptions import diagnose_exception, is_value_message

        incident = self.reporter.new(kind="exception", cause="unknown", summary="", fix="", action=Action.RAISED)
        if self.sharded and self.world_size > 1:  # one rank raised: the others wait in collectives of their own
            if not is_value_message(str(exc)):
                return None
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            incident.details["exception"] = f"{type(exc).__name__}: {first}"
            incident.details["localisation"] = ("not replayed: under FSDP2 a replay issues collectives, and the other "
                                                "ranks are not in them when one rank raises")
            incident.summary = f"The step raised {type(exc).__name__}: {first}"
            incident.fix = "Re-run the failing batch on one process (or under DDP) to localise the value that raised."
            self.reporter.record(incident, announce=announce)
            self.recorder.reset()
            return incident
        try:
            with torch.no_grad():
                found = diagnose_exception(self.watched, incident, self.recorder.capture, exc,
                                           judged=self._decision is not None)
        except Exception as err:  # never replace the user's exception with ours
            incident.details["localisation_error"] = f"{type(err).__name__}: {err}"
            found = is_value_message(str(exc))
            incident.summary = f"The step raised {type(exc).__name__}: {exc}; nantrace's replay of it failed ({err})."
            incident.fix = "Re-run with nantrace replay on the bundle to see the origin of the bad value."
        if not found:
            return None
        if self.store is not None and self.config.outputs.save_bundle and not self.sharded:
            self.reporter.write_bundle(incident)
        self.reporter.record(incident, announce=announce)
        self.recorder.reset()
        return incident

    def record_data_incident(self, issue: Any) -> None:
        """Record a finding of the data layer (``nantrace.data.ValidatingCollate``) as an incident.

        Safe from any thread: from another thread (a DataLoader's delivery thread) the
        issue is queued and recorded at the next step by the training thread.
        """
        if not self.closed:
            self.reporter.queue_data_issue(issue)

    # ------------------------------------------------------------ the end of a step
    def finish_step(self, decision: Decision, *, raised: bool = False) -> None:
        """Book the step: the scaler's collapse check, the episode, the flight recorder, the store,
        the monitors; then start the next step."""
        self._book(decision, raised=raised)
        self._next_step()

    def _book(self, decision: Decision, *, raised: bool = False) -> None:
        if self.reporter.data_pending:
            self.reporter.flush_data_issues()
        health = decision.health
        skipped = decision.block or decision.scaler_skip or raised
        if decision.incident is None or decision.incident.kind not in ("nonfinite_param", "optimizer_state"):
            if self.scaler is not None:
                collapse = self.scaler_monitor.update(
                    skipped=decision.scaler_skip, scale=health.scale,
                    probe=functools.partial(replay_at_scale_one, self.watched, self.recorder.capture, health.scale)
                    if self.config.localisation.localise else None)
                if collapse is not None and not raised:
                    self.reporter.report_collapse(collapse, decision)
        self.ladder.end_step(self.step, blocked=not raised and (decision.block or (
            decision.scaler_skip and self.scaler_monitor.collapsed)), troubled=decision.incident is not None)
        action = decision.incident.action if decision.incident is not None else ("scaler_skip" if decision.scaler_skip else None)
        row = {"step": self.step, "loss": health.loss, "grad_norm": health.grad_norm, "param_norm": health.param_norm,
               "scale": health.scale, "skipped": skipped, "action": action}
        self._last_row = row
        if health.param_norm is not None:
            self._param_read = (health.param_norm, self.step)
        history = self.reporter.history
        if history.maxlen:
            history.append(row)
        if not skipped:
            self.judge.last_applied = self.step
        if self.running_stats is not None and not raised:
            if not skipped:
                self.running_stats.keep()
            elif decision.block and decision.incident is not None:
                put_back = self.running_stats.put_back_nonfinite()
                if put_back:
                    decision.incident.details["running_statistics_restored"] = put_back
        lrs = self._lrs() if self.store is not None or self.monitors else []  # once per step, after the update
        with self.store.transaction() if self.store is not None else contextlib.nullcontext():  # one commit per step
            if self.store is not None:
                self.store.log_step(
                    step=self.step, loss=health.loss, grad_norm=health.grad_norm, param_norm=health.param_norm,
                    lr=lrs, scale=health.scale, skipped=skipped, action=action,
                    incident=decision.incident.id if decision.incident is not None else None,
                )
            if self.monitors and not raised:
                self._run_monitors(decision, applied=not skipped, lrs=lrs)

    def _next_step(self) -> None:
        self.state.step += 1
        self.recorder.reset()
        self.recorder.start_prelude()
        self._decision = None
        self.state.unscaled = False
        BACKWARD.ensure()  # another tool's clean-up may have dropped our layer: wrap again

    def _run_monitors(self, decision: Decision, *, applied: bool, lrs: list[float] | None = None) -> None:
        ctx = StepContext(step=self.step, health=decision.health, grad_index=decision.grad_index,
                          param_names=self._param_names, applied=applied, lrs=self._lrs() if lrs is None else lrs)
        for monitor in self.monitors:
            for signal in monitor.on_step(ctx):
                self.reporter.report_signal(signal)

    def _lrs(self) -> list[float]:
        if self.optimizer is None:
            return []
        out = []
        for g in self.optimizer.param_groups:
            lr = g.get("lr")
            if isinstance(lr, torch.Tensor):
                lr = float(lr) if lr.device.type == "cpu" else float("nan")
            out.append(float(lr) if lr is not None else float("nan"))
        return out

    # ------------------------------------------------------------ the user's extras
    def add_scheduler(self, scheduler: Any) -> None:
        """Declare an LR scheduler for ``rollback`` to restore (those driving the optimizer are found on their own)."""
        if self.rollback is not None:
            self.rollback.add_scheduler(scheduler)

    def add_monitor(self, monitor: Monitor) -> None:
        """Attach a training-dynamics monitor (see ``nantrace.dynamics``); it receives the guard's
        read-only view (:class:`~nantrace.watched.Watched`) and is detached by ``close()``."""
        monitor.attach(self.watched)
        self.monitors.append(monitor)

    def checkpoint_ok(self) -> bool:
        """True when now is a safe moment to save a checkpoint: every parameter and buffer of the
        model is finite and no incident episode is unresolved. ``guard.checkpoints.reason`` says
        why not. One fused check per step (cached), so it is cheap to ask before every save::

            if guard.checkpoint_ok():
                torch.save(model.state_dict(), path)
        """
        return self.checkpoints.verdict()

    @property
    def last_step(self) -> dict[str, Any] | None:
        """Health figures of the last finished step (step, loss, grad_norm, param_norm, scale,
        skipped, action), e.g. for logging to a trainer's logger; ``None`` before the first step.
        ``param_norm`` is the last one read (every parameter is read every
        ``Config.detection.param_check_every`` steps) and ``param_norm_step`` the step it was read at.
        In sync-free mode asking reads the step the device decided last (a logged value is a
        natural read): its incident is reported now, a stopping action raises at the next step."""
        if self.sync_free is not None and not self.closed:
            self.settle_device_step(stop=False)
        history = self.reporter.history
        row = dict(history[-1]) if history else (dict(self._last_row) if self._last_row is not None else None)
        if row is not None and self._param_read is not None:
            row["param_norm"], row["param_norm_step"] = self._param_read
        return row

    # ------------------------------------------------------------ tear-down
    def close(self) -> None:
        """Remove every hook and restore the scaler; idempotent."""
        if self.closed:
            return
        self._diagnose_unfinished_step()
        if self.sync_free is not None:
            self.settle_device_step(stop=False)  # the last step: recorded, never raised from close()
            self._stop_next_step = None
        if self.reporter.data_pending:
            self.reporter.flush_data_issues()
        self.state.closed = True
        for monitor in self.monitors:
            monitor.detach()
        self.precision.close()
        if self.rollback is not None:
            self.rollback.close()
        if self.update_check is not None:
            self.update_check.close()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._patches.remove()
        self.recorder.close()
        if self.store is not None:
            self.store.close()

    def _diagnose_unfinished_step(self) -> None:
        """Diagnose a failure of the step in progress that no other safe point has seen: one noted
        where it was raised (the loop caught it and went on), or one still propagating as the guard
        closes (``close()`` in a ``finally``, where ``sys.exc_info()`` is that exception). Each
        exception is diagnosed once, and left to propagate unchanged."""
        self.recorder.pause_tape()  # what close() itself runs is not the step's code
        seen = self._pending_exception is not None
        if self._pending_exception is not None:
            self.diagnose_exception(self._pending_exception)
        in_flight = sys.exc_info()[1]
        if isinstance(in_flight, Exception) and self.recorder.active:
            self.diagnose_exception(in_flight)
        if not seen and not isinstance(in_flight, Exception):  # an exception nantrace never saw
            self._diagnose_abandoned_step()

    def _diagnose_abandoned_step(self) -> Incident | None:
        """The run ends (``close()``) inside a training step that ran the model's forward (grad on, model
        in training mode) and never reached ``optimizer.step()``: a check written in Python (torch.distributions'
        validation, the user's own check of the losses after ``backward()``) raised outside any hook of
        nantrace's, and the loop caught it. Before ``backward()``, replayed once, here: an incident (kind
        ``exception``) only when the replay shows the bad value (a non-finite value created, a decomposition of
        a singular matrix); after it, only when the step's loss or gradients are non-finite (then localised as
        the step's check would). A healthy step records nothing."""
        capture, rec = self.recorder.capture, self.recorder
        if (not rec.active or not self.root.training or self.sharded or self.closed or self.state.replaying
                or self._decision is not None):  # the step's own check has judged it (a pause raised in its step)
            return None  # a step past backward() is judged by its real loss and gradients (diagnose_exception)
        from .localisation.exceptions import diagnose_exception

        incident = self.reporter.new(kind="exception", cause="unknown", summary="", fix="", action=Action.RAISED)
        try:
            with torch.no_grad():
                found = diagnose_exception(self.watched, incident, capture, None, abandoned=True)
        except Exception:  # evidence, not the user's failure: without it, nothing is recorded
            return None
        if not found:
            return None
        if self.store is not None and self.config.outputs.save_bundle:
            self.reporter.write_bundle(incident)
        self.reporter.record(incident)
        self.recorder.reset()
        return incident

    def __enter__(self) -> "Guard":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if isinstance(exc, Exception):
            self.diagnose_exception(exc)
        self.close()

    def __del__(self) -> None:  # a forgotten guard must not leave the backward patch behind
        try:
            if not self.closed:
                self._patches.remove()
                self.recorder.close()  # and its tapes off the mode stack
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<nantrace.Guard {state} step={self.step} incidents={len(self.incidents)} policy={self.policy!r}>"


def _no_listener(*args: Any) -> None:
    """A patch that only needs to be on while the guard is open (``patches.FUNCTION_APPLY``)."""


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out
