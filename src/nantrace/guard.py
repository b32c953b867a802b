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
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from .taxonomy import DATA_INCIDENT_CAUSES, Action, is_finite_trouble
from . import console
from ._scaler_hooks import patch_scaler
from .patches import BACKWARD, EXCEPTHOOK, PatchUnit
from .capture import (
    AutocastState,
    BufferPlan,
    CallRecord,
    ForwardRecord,
    RngState,
    StepCapture,
    all_finite,
    floating_tensors,
)
from .config import Config
from .detection.divergence import DivergenceDetector
from .detection.scaler import ScalerMonitor, collapse_fields, replay_at_scale_one
from .detection.sentinel import StepHealth, finish, nonfinite_tensors, read, stage
from .detection.spikes import RobustSpikeDetector
from .diagnosis.triage import Finding, triage
from .dynamics.base import Monitor, Signal, StepContext
from .dynamics.registry import build_monitors
from .distributed import Agreement, StepRound, agree, combine_shards, install_local_grad_check, world
from .errors import NonFiniteError
from .incident import Incident
from .loss_tape import LossTape
from .response.checkpoints import CheckpointGate
from .response.escalation import EscalationLadder
from .response.policies import action_for
from .response.precision import PrecisionFallback
from .response.rollback_policy import RollbackPolicy
from .response.update_check import UpdateCheck
from .storage.runstore import RunStore

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


class _Decision:
    __slots__ = ("health", "incident", "block", "scaler_skip", "stashed", "grad_index")

    def __init__(self, health: StepHealth, incident: Incident | None, block: bool, scaler_skip: bool) -> None:
        self.health = health
        self.incident = incident
        self.block = block
        self.scaler_skip = scaler_skip
        self.stashed: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
        self.grad_index: list[int] = []


class Guard:
    """Watches one model (and its optimizer / GradScaler) for numerical failures.

    Created by :func:`nantrace.watch`. ``incidents`` lists what was found, oldest first;
    ``close()`` removes every hook and leaves model, optimizer and scaler as found.
    """

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
        self.incidents: list[Incident] = []
        self.step = 0
        self.closed = False

        self._handles: list[Any] = []
        self._patches = PatchUnit(id(self))
        """Every process-wide patch this guard holds (``nantrace.patches``), removed as a unit by ``close()``."""
        self._tape = LossTape() if config.localisation.record_loss_code else None
        self._pending_exception: BaseException | None = None
        self._capture = self._new_capture()
        self._decision: _Decision | None = None
        self._in_scaler_step = False
        self._unscaled = False
        self._replaying = False
        self._buffers = BufferPlan(self.root, config.localisation.snapshot_buffers)
        self._bundles_written = 0
        self._last_applied: int | None = None
        self._data_inbox: deque[Any] = deque()
        self._last_row: dict[str, Any] | None = None
        self.monitors: list[Monitor] = []
        self.precision = PrecisionFallback(self.root, config.response.precision_fallback_after)
        self.rollback = RollbackPolicy(self) if optimizer is not None and (
            on_anomaly == "rollback" or (on_anomaly == "skip" and config.response.skip_snapshots)) else None
        self.ladder = EscalationLadder(self)
        self.checkpoints = CheckpointGate(self)
        self._divergence = DivergenceDetector(min_steps=config.detection.divergence_steps, min_factor=config.detection.divergence_factor)
        self._owner_thread = threading.get_ident()
        self._recorder: deque[dict[str, Any]] = deque(maxlen=config.outputs.flight_recorder)
        self._loss_spikes = RobustSpikeDetector(
            window=config.detection.spike_window, warmup=config.detection.spike_warmup,
            sigma=config.detection.spike_sigma, min_ratio=config.detection.loss_spike_min_ratio,
        )
        self._grad_spikes = RobustSpikeDetector(
            window=config.detection.spike_window, warmup=config.detection.spike_warmup,
            sigma=config.detection.spike_sigma, min_ratio=config.detection.explosion_min_ratio,
        )
        self._scaler_monitor = ScalerMonitor(max_skips=config.detection.scaler_max_skips, min_scale=config.detection.scaler_min_scale,
                                             max_drop=config.detection.scaler_max_drop)

        names = {id(p): n for n, p in self.root.named_parameters()}
        params = self._optimizer_params() if optimizer is not None else [p for p in self.root.parameters()]
        self._params: list[torch.Tensor] = [p for p in params if p.requires_grad]
        self._param_names: list[str] = [names.get(id(p), f"param[{i}]") for i, p in enumerate(self._params)]
        self.sharded = any(hasattr(p, "to_local") for p in self._params)
        """Parameters are DTensor shards (FSDP2): norms are combined across ranks; no replay."""
        self.update_check = UpdateCheck(optimizer, self._params, self._param_names, enabled=config.detection.check_updates) \
            if optimizer is not None and not self.sharded else None
        """Checks the optimizer's own updates (phase ``optimizer``) and undoes a non-finite one."""
        self.store: RunStore | None = None
        try:
            if self.run_dir is not None:
                self.store = RunStore(self.run_dir)
                self._write_meta()
            self._install()
            for monitor in build_monitors(config):
                self.add_monitor(monitor)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ set-up
    def _optimizer_params(self) -> list[torch.Tensor]:
        assert self.optimizer is not None
        seen: set[int] = set()
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _install(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._forward_pre, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._forward_post, with_kwargs=True, always_call=True))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._optimizer_pre))
            self._handles.append(self.optimizer.register_step_post_hook(self._optimizer_post))
        if self.scaler is not None:
            patch_scaler(self, self._patches)
        self._patches.listen(BACKWARD, self._on_loss)
        self._patches.listen(EXCEPTHOOK, self.diagnose_exception)
        if self._tape is not None:
            self._tape.on_exception = self.note_exception
        self.checks_local_grads = self.world_size > 1 and install_local_grad_check(self)

    def _write_meta(self) -> None:
        assert self.store is not None
        from . import __version__

        self.store.set_meta("nantrace_version", __version__)
        self.store.set_meta("torch_version", torch.__version__)
        self.store.set_meta("model_class", type(self.root).__name__)
        self.store.set_meta("optimizer_class", type(self.optimizer).__name__ if self.optimizer else None)
        self.store.set_meta("scaler", self.scaler is not None)
        self.store.set_meta("policy", self.policy)
        self.store.set_meta("config", self.config.to_dict())
        self.store.set_meta("param_names", self._param_names)
        self.store.set_meta("num_parameters", sum(p.numel() for p in self._params))
        self.store.set_meta("rank", self.rank)
        self.store.set_meta("pid", os.getpid())
        self.store.set_meta("cwd", os.getcwd())  # source paths in incidents are relative to it

    # ------------------------------------------------------------ capture hooks
    def _new_capture(self) -> StepCapture:
        if self._tape is not None:
            self._tape.reset()
        return StepCapture(tape=self._tape)

    def _forward_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._tape is not None:
            self._tape.pause()  # the model's own ops are replayed from its inputs, not taped
        if self.closed or self._replaying or not torch.is_grad_enabled():
            return
        record = ForwardRecord(
            args=args,
            kwargs=kwargs,
            rng=RngState.current(),
            autocast=AutocastState.current(),
            buffers=self._snapshot_buffers(),
        )
        self._capture.forwards.append(record)
        if self.config.detection.check_inputs:
            flag = all_finite(floating_tensors((args, kwargs)))
            if flag is not None:
                self._capture.and_inputs(flag)

    def _forward_post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if output is None and sys.exc_info()[1] is not None:  # the forward raised (an always-called hook)
            self.note_exception(sys.exc_info()[1])  # type: ignore[arg-type]
            return
        if self.closed or self._replaying or not torch.is_grad_enabled() or not self._capture.forwards:
            return
        record = self._capture.forwards[-1]
        self._buffers.learn()
        outputs = floating_tensors(output)
        if self._tape is not None:
            record.outputs = [weakref.ref(t) for t in outputs]
        if self.config.detection.check_outputs:
            flag = all_finite(outputs)
            if flag is not None:
                self._capture.and_outputs(flag)
        if self.config.localisation.keep_output_grads:
            for i, t in enumerate(outputs):
                if t.requires_grad:
                    t.register_hook(functools.partial(_keep_grad, record, i))
        if self._tape is not None:
            self._tape.resume()

    def _snapshot_buffers(self) -> dict[str, torch.Tensor] | None:
        return self._buffers.snapshot()

    def _on_loss(self, loss: torch.Tensor) -> None:
        if self.closed or self._replaying:
            return
        if self._capture.forwards or self._capture.calls:
            self._record_loss(loss)

    def _record_loss(self, loss: torch.Tensor) -> None:
        if self._tape is not None:  # the loss code ends here (backward(), or GradScaler.scale)
            self._tape.note_loss(loss)
            self._tape.pause()
        if self.config.detection.check_loss and not self._replaying:
            self._capture.losses.append(loss.detach())

    def replayable(self, fn: F) -> F:
        """Wrap the loss computation (``batch -> loss``, forward only) so a failing step can be
        replayed whole, loss function included."""
        if not callable(fn):
            raise TypeError(f"guard.replayable expects a callable (batch -> loss), got {type(fn).__name__}")
        guard_ref = weakref.ref(self)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            guard = guard_ref()
            if guard is None or guard.closed or guard._replaying or not torch.is_grad_enabled():
                return fn(*args, **kwargs)
            record = CallRecord(fn=fn, args=args, kwargs=kwargs, rng=RngState.current(),
                                autocast=AutocastState.current(), buffers=guard._snapshot_buffers())
            guard._capture.calls.append(record)
            result = fn(*args, **kwargs)
            if isinstance(result, torch.Tensor):
                record.loss = result.detach()
            return result

        wrapper._nantrace_replayable = fn  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    # ------------------------------------------------------------ step hooks
    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        if self._tape is not None:
            self._tape.pause()
        if self._pending_exception is not None:  # the user caught a failure of this step and went on
            self.diagnose_exception(self._pending_exception)
        if self.closed:
            return None
        if self._in_scaler_step:
            self._prepare_update(self._decision)
            return None
        positional = len(args) > 1  # args[0] is the optimizer itself
        closure = args[1] if positional else kwargs.get("closure")
        if closure is None:
            self._prepare_update(self._decide(grads_scaled=False))
            return None
        if isinstance(optimizer, torch.optim.LBFGS):
            self._decision = None  # evaluates the closure many times per step: checked after the step only
            return None
        # Frameworks (Lightning) run forward and backward inside step(closure): decide right
        # after the closure has produced the gradients, before the update reads them.
        checked = self._checked_closure(closure)
        if positional:
            return (args[0], checked, *args[2:]), kwargs
        return args, {**kwargs, "closure": checked}

    def _checked_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with torch.enable_grad():
                result = closure()
            self._prepare_update(self._decide(grads_scaled=False))
            return result

        return run

    def _prepare_update(self, decision: _Decision | None) -> None:
        """Block the update (grads set aside) or let monitors see the parameters before it."""
        if decision is not None and decision.block:
            decision.stashed = [(p, p.grad) for p in self._params]
            for p in self._params:
                p.grad = None
            return
        if decision is not None and not decision.scaler_skip and self.update_check is not None:
            self.update_check.before_update(grad_norm=decision.health.grad_norm, param_norm=decision.health.param_norm)
        if self.monitors and not (decision is not None and decision.scaler_skip):
            for monitor in self.monitors:
                monitor.before_update(self.step, self._params)

    def _optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.closed:
            return
        if self._decision is not None and not self._decision.block and self.update_check is not None:
            self._check_update(self._decision)
        if self._in_scaler_step:
            return
        decision = self._decision
        if decision is None:
            self._decision = None
            self._finish_closure_step()
            return
        self._restore_grads(decision)
        self._finish_step(decision)

    def _check_update(self, decision: _Decision) -> None:
        """After the update: a non-finite result is undone and reported at this step (phase ``optimizer``)."""
        assert self.update_check is not None
        failure = self.update_check.after_update()
        if failure is not None:
            from .diagnosis.update_replay import optimizer_incident

            decision.incident, decision.block = optimizer_incident(self, failure), True
            self._report(decision.incident, decision)

    def _restore_grads(self, decision: _Decision) -> None:
        if decision.stashed is not None:
            for p, g in decision.stashed:
                p.grad = g
            decision.stashed = None

    # ------------------------------------------------------------ the decision
    def _grads(self) -> tuple[list[torch.Tensor], list[int]]:
        grads, index = [], []
        for i, p in enumerate(self._params):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                g = g.coalesce().values()
            grads.append(g)
            index.append(i)
        return grads, index

    def _decide(self, *, grads_scaled: bool, via_scaler: bool = False) -> _Decision:
        """Read the step's health (one host sync), find what is wrong, apply the policy."""
        with torch.no_grad():
            return self._decide_no_grad(grads_scaled=grads_scaled, via_scaler=via_scaler)

    def _decide_no_grad(self, *, grads_scaled: bool, via_scaler: bool) -> _Decision:
        grads, grad_index = self._grads()
        capture = self._capture
        staged = stage(
            grads=grads,
            params=self._params if self.config.detection.check_params else [],
            losses=capture.losses + [c.loss for c in capture.calls if c.loss is not None and not capture.losses],
            inputs_ok=capture.inputs_ok,
            outputs_ok=capture.outputs_ok,
            local_grads_ok=capture.local_grads_ok,
            scale=getattr(self.scaler, "_scale", None) if self.scaler is not None and self.scaler.is_enabled() else None,
            grads_scaled=grads_scaled and self.scaler is not None,
        )
        ranks = StepRound(self, staged, grad_index) if self.world_size > 1 else None  # agreement on the device
        local, shared = read(staged, ranks.vector if ranks is not None else None)  # the step's one host read
        health = finish(staged, local)
        if ranks is not None:
            ranks.settle(health, shared)
            if ranks.fallback and self.sharded:  # rare path: a non-finite global norm, combined from exact figures
                combine_shards(health, grad_index=grad_index, n_params=len(self._params),
                               device=grads[0].device if grads else torch.device("cpu"))
        finding = self.checkpoints.loaded_state_finding(self.step, health.params_finite) or triage(
            health,
            step=self.step,
            scaler_active=via_scaler,
            loss_spikes=self._loss_spikes if self.config.detection.detect_loss_spikes else None,
            grad_spikes=self._grad_spikes if self.config.detection.detect_grad_explosion else None,
            last_applied=self._last_applied,
            divergence=self._divergence if self.config.detection.detect_divergence else None,
            lr=next(iter(self._lrs()), None),
        )
        agreement = None
        if self.world_size > 1:
            agreement, finding = self._agree(health, finding, ranks, via_scaler=via_scaler,
                                             device=grads[0].device if grads else torch.device("cpu"))
        if finding is None and self.rollback is not None:
            self.rollback.before_healthy_update(self.step)
        scaler_skip = via_scaler and not health.grads_finite and finding is None
        incident = None
        block = False
        if finding is not None:
            incident = self._make_incident(finding, health, grads, grad_index)
            if agreement is not None and agreement.origin_ranks:
                incident.rank = agreement.origin_ranks[0]
                incident.details["origin_ranks"] = agreement.origin_ranks
                if self.rank not in agreement.origin_ranks:
                    incident.summary = (f"The non-finite values came from rank {incident.rank} (its own data or "
                                        f"gradients, before the all-reduce); this rank only received them. " + incident.summary)
            block = incident.action != Action.LOGGED
        decision = _Decision(health, incident, block, scaler_skip)
        decision.grad_index = grad_index
        self._decision = decision
        if incident is not None:
            self._report(incident, decision)
        return decision

    def _agree(self, health: StepHealth, finding: Finding | None, ranks: StepRound, *, via_scaler: bool,
               device: torch.device) -> tuple[Agreement, Finding | None]:
        """Make every rank take the same decision; name the rank the failure came from (from the
        facts every rank read in the step's one read; a second round only on the rare path)."""
        local_origin = not (health.inputs_finite and health.loss_finite and health.outputs_finite
                            and health.local_grads_finite and health.params_finite) or (
            finding is not None and finding.kind == "loss_spike")  # the loss is per rank; gradients are shared
        blocks = finding is not None and action_for(
            self.policy, finding, finite_trouble=is_finite_trouble(finding.kind),
            config=self.config) != Action.LOGGED
        if ranks.fallback:
            agreement = agree(rank=self.rank, world_size=self.world_size, local_origin=local_origin,
                              local_kind=finding.kind if blocks and finding is not None else None, device=device)
        else:
            agreement = ranks.agreement(self, scaler_active=via_scaler)
        if agreement.block and not blocks:
            finding = Finding(
                self.step, agreement.peer_kind or "nonfinite_grad", None, "unknown", None,
                f"Rank {agreement.peer_rank} reported {agreement.peer_kind} at step {self.step}; this rank skips "
                "the update too, so that every replica stays identical.",
                f"See the incident recorded by rank {agreement.peer_rank}.",
                details={"peer_rank": agreement.peer_rank},
            )
        return agreement, finding

    def _make_incident(self, finding: Finding, health: StepHealth, grads: list[torch.Tensor], grad_index: list[int]) -> Incident:
        finite_trouble = is_finite_trouble(finding.kind)
        action = action_for(self.policy, finding, finite_trouble=finite_trouble, config=self.config)
        details: dict[str, Any] = dict(finding.details)
        if not health.grads_finite:
            details["nonfinite_grads"] = nonfinite_tensors([(self._param_names[i], g) for i, g in zip(grad_index, grads)])
        module = finding.module
        if not health.params_finite:
            details["nonfinite_params"] = bad_params = nonfinite_tensors(list(zip(self._param_names, self._params)))
            if finding.kind == "nonfinite_param" and bad_params:
                module = bad_params[0]["name"].rpartition(".")[0]  # the module that owns the first bad tensor
        if not health.inputs_finite:
            details["nonfinite_inputs"] = _bad_inputs(self._capture)
        details["loss"] = health.loss
        details["grad_norm"] = health.grad_norm
        if health.scale is not None:
            details["loss_scale"] = health.scale
        return Incident(
            step=finding.step,
            kind=finding.kind,
            phase=finding.phase,
            op=None,
            module=module,
            source=None,
            rank=self.rank,
            cause=finding.cause,
            summary=finding.summary,
            fix=finding.fix,
            action=action,
            details=details,
            history=list(self._recorder),
        )

    def _report(self, incident: Incident, decision: _Decision) -> None:
        """Localise (when enabled), keep, store and print the incident; raise if the policy says so."""
        if self.ladder.absorb(incident, decision):  # a repeat of the open episode, counted on its incident
            return
        origins = incident.details.get("origin_ranks")
        here = origins is None or self.rank in origins
        if self.sharded:
            incident.details["localisation"] = ("not replayed: under FSDP2 the forward issues collectives, which a "
                                                "replay on one rank would deadlock")
        elif self.config.localisation.localise and here and incident.kind.startswith("nonfinite") and incident.kind != "nonfinite_param" \
                and "peer_rank" not in incident.details:
            from .localisation.localiser import localise_incident

            localise_incident(self, incident, self._capture)
        if incident.cause == "precision_overflow" and incident.module is not None:
            note = self.precision.record(incident.module)
            if note:
                incident.details["precision_fallback"] = note
                incident.fix = f"{incident.fix} (Done: {note}.)"
        if self.ladder.settle(incident, decision):  # localised: the same origin as the episode's incident
            return
        if not self.sharded and (incident.action in (Action.PAUSED, Action.ROLLED_BACK) or (
                self.config.outputs.save_bundle and self.store is not None and incident.kind.startswith("nonfinite"))):
            self._write_bundle(incident)  # before any rollback: the bundle holds the failing step's own state
        if incident.action == Action.ROLLED_BACK and not (self.rollback is not None and self.rollback.roll_back(incident)):
            incident.action = Action.PAUSED
        self.ladder.annotate(incident)
        self._record(incident)
        if incident.action in (Action.RAISED, Action.PAUSED):
            self._finish_step(decision, raised=True)
            raise NonFiniteError(incident)

    def _record(self, incident: Incident, *, announce: bool = True) -> None:
        """Keep, store and print one incident."""
        self.incidents.append(incident)
        if self.store is not None:
            self.store.log_incident(incident)
        if self.config.outputs.print_incidents and announce:
            console.print_incident(incident)

    def _write_bundle(self, incident: Incident) -> None:
        if self.store is None or self._bundles_written >= self.config.outputs.max_bundles:
            return
        from .storage.bundle import write_bundle

        incident.bundle = write_bundle(self, incident, self._capture)
        self._bundles_written += 1

    # ------------------------------------------------------------ failures that raise
    def note_exception(self, exc: BaseException) -> None:
        """Remember an exception the step raised, to diagnose once it has left torch's machinery.

        Called where it is raised (the model's forward, a call of the loss code): replaying there
        would register hooks on modules whose hook tables torch is iterating. The diagnosis runs at
        the next safe point: ``with guard:`` exit, an uncaught exception (``sys.excepthook``),
        ``nantrace run``, the framework callbacks, the next ``optimizer.step()`` or ``close()``.
        """
        if not self.closed and not self._replaying and isinstance(exc, Exception) and self._pending_exception is None:
            self._pending_exception = exc

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
        if self.closed or self._replaying or not isinstance(exc, Exception) or isinstance(exc, NonFiniteError):
            return None
        if getattr(exc, "_nantrace_seen", False):
            return None
        with contextlib.suppress(AttributeError, TypeError):
            exc._nantrace_seen = True  # type: ignore[attr-defined]
        if not (self._capture.forwards or self._capture.calls):
            return None
        from .localisation.exceptions import diagnose_exception, is_value_message

        incident = Incident(step=self.step, kind="exception", phase=None, op=None, module=None, source=None,
                            rank=self.rank, cause="unknown", summary="", fix="", action=Action.RAISED,
                            details={}, history=list(self._recorder))
        try:
            with torch.no_grad():
                found = diagnose_exception(self, incident, self._capture, exc)
        except Exception as err:  # never replace the user's exception with ours
            incident.details["localisation_error"] = f"{type(err).__name__}: {err}"
            found = is_value_message(str(exc))
            incident.summary = f"The step raised {type(exc).__name__}: {exc}; nantrace's replay of it failed ({err})."
            incident.fix = "Re-run with nantrace replay on the bundle to see the origin of the bad value."
        if not found:
            return None
        if self.store is not None and self.config.outputs.save_bundle and not self.sharded:
            self._write_bundle(incident)
        self._record(incident, announce=announce)
        self._capture = self._new_capture()
        return incident

    # ------------------------------------------------------------ data layer
    def record_data_incident(self, issue: Any) -> None:
        """Record a finding of the data layer (``nantrace.data.ValidatingCollate``) as an incident.

        Safe from any thread: from another thread (a DataLoader's delivery thread) the
        issue is queued and recorded at the next step by the training thread.
        """
        if self.closed:
            return
        self._data_inbox.append(issue)
        if threading.get_ident() == self._owner_thread:
            self._flush_data_incidents()

    def _flush_data_incidents(self) -> None:
        while self._data_inbox:
            issue = self._data_inbox.popleft()
            cause = issue.cause if issue.cause in DATA_INCIDENT_CAUSES else "unknown"
            action = issue.details.get("action", Action.LOGGED)
            incident = Incident(
                step=self.step, kind="nonfinite_input", phase="data", op=None, module=None, source=None,
                rank=self.rank, cause=cause, summary=issue.summary, fix=issue.fix,
                action=action if action in (Action.SKIPPED, Action.RAISED, Action.LOGGED) else Action.LOGGED,
                details={"path": issue.path, "sample_indices": list(issue.sample_indices), **issue.details},
                history=list(self._recorder),
            )
            self._record(incident)

    # ------------------------------------------------------------ bookkeeping
    def _finish_step(self, decision: _Decision, *, raised: bool = False) -> None:
        if self._data_inbox:
            self._flush_data_incidents()
        health = decision.health
        skipped = decision.block or decision.scaler_skip or raised
        if decision.incident is None or decision.incident.kind not in ("nonfinite_param", "optimizer_state"):
            if self.scaler is not None:
                collapse = self._scaler_monitor.update(
                    skipped=decision.scaler_skip, scale=health.scale,
                    probe=functools.partial(replay_at_scale_one, self, self._capture, health.scale) if self.config.localisation.localise else None)
                if collapse is not None and not raised:
                    self._report_collapse(collapse, decision)
        self.ladder.end_step(self.step, blocked=not raised and (decision.block or (
            decision.scaler_skip and self._scaler_monitor.collapsed)), troubled=decision.incident is not None)
        action = decision.incident.action if decision.incident is not None else ("scaler_skip" if decision.scaler_skip else None)
        row = {
            "step": self.step,
            "loss": health.loss,
            "grad_norm": health.grad_norm,
            "param_norm": health.param_norm,
            "scale": health.scale,
            "skipped": skipped,
            "action": action,
        }
        self._last_row = row
        if self._recorder.maxlen:
            self._recorder.append(row)
        if not skipped:
            self._last_applied = self.step
        with self.store.transaction() if self.store is not None else contextlib.nullcontext():  # one commit per step
            if self.store is not None:
                self.store.log_step(
                    step=self.step, loss=health.loss, grad_norm=health.grad_norm, param_norm=health.param_norm,
                    lr=self._lrs(), scale=health.scale, skipped=skipped, action=action,
                    incident=decision.incident.id if decision.incident is not None else None,
                )
            if self.monitors and not raised:
                self._run_monitors(decision, applied=not skipped)
        self.step += 1
        self._capture = self._new_capture()
        self._decision = None
        self._unscaled = False
        BACKWARD.ensure()  # another tool's clean-up may have dropped our layer: wrap again

    def add_scheduler(self, scheduler: Any) -> None:
        """Declare an LR scheduler for ``rollback`` to restore (those driving the optimizer are found on their own)."""
        if self.rollback is not None:
            self.rollback.add_scheduler(scheduler)

    def add_monitor(self, monitor: Monitor) -> None:
        """Attach a training-dynamics monitor (see ``nantrace.dynamics``); it is detached by ``close()``."""
        monitor.attach(self)
        self.monitors.append(monitor)

    def _run_monitors(self, decision: _Decision, *, applied: bool) -> None:
        ctx = StepContext(step=self.step, health=decision.health, grad_index=decision.grad_index,
                          param_names=self._param_names, applied=applied, lrs=self._lrs())
        for monitor in self.monitors:
            for signal in monitor.on_step(ctx):
                self._report_signal(signal)

    def _report_signal(self, signal: Signal) -> None:
        incident = Incident(
            step=self.step, kind=signal.kind, phase=signal.phase, op=None, module=signal.module, source=None,
            rank=self.rank, cause=signal.cause, summary=signal.summary, fix=signal.fix, action=Action.LOGGED,
            details=dict(signal.details), history=list(self._recorder),
        )
        self._record(incident)

    def _report_collapse(self, collapse: Any, decision: _Decision) -> None:
        from .diagnosis.patterns import explain

        summary, fix = f"The GradScaler is collapsing: {collapse.reason}.", explain("scaler_collapse")[1]
        incident = Incident(
            step=self.step, kind="scaler_collapse", phase="backward", op=None, module=None, source=None,
            rank=self.rank, cause="scaler_collapse", summary=summary, fix=fix,
            action=Action.SKIPPED if self.policy == "skip" or self.config.response.finite_anomaly_action == "log" else action_for(
                self.policy, None, finite_trouble=True, config=self.config),
            details=collapse_fields(collapse),
            history=list(self._recorder),
        )
        if self.ladder.absorb(incident, decision):  # the collapse goes on: counted on its incident
            return
        decision.incident = decision.incident or incident
        if not collapse.continuing:
            from .detection.scaler import name_collapse_origin

            name_collapse_origin(self, incident, self._capture, decision.health.scale)
        self.ladder.settle(incident, decision)  # a collapse is never a repeat here: it opens or heads its episode
        if incident.action in (Action.PAUSED, Action.ROLLED_BACK):
            self._write_bundle(incident)
        if incident.action == Action.ROLLED_BACK and not (self.rollback is not None and self.rollback.roll_back(incident)):
            incident.action = Action.PAUSED
        self.ladder.annotate(incident)
        self._record(incident)
        if incident.action in (Action.RAISED, Action.PAUSED):
            raise NonFiniteError(incident)

    def _finish_closure_step(self) -> None:
        self.step += 1
        self._capture = self._new_capture()

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
        skipped, action), e.g. for logging to a trainer's logger; ``None`` before the first step."""
        return dict(self._recorder[-1]) if self._recorder else self._last_row

    # ------------------------------------------------------------ tear-down
    def close(self) -> None:
        """Remove every hook and restore the scaler; idempotent."""
        if self.closed:
            return
        if self._pending_exception is not None:  # e.g. a try/finally that closes the guard as a failure propagates
            self.diagnose_exception(self._pending_exception)
        if self._data_inbox:
            self._flush_data_incidents()
        self.closed = True
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
        if self._tape is not None:
            self._tape.on_exception = None
            self._tape.detach()
        self._capture = StepCapture()
        if self.store is not None:
            self.store.close()

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
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<nantrace.Guard {state} step={self.step} incidents={len(self.incidents)} policy={self.policy!r}>"


def _bad_inputs(capture: StepCapture) -> list[dict[str, Any]]:
    """Which forward call, argument and samples (rows of dim 0) carried non-finite values."""
    out = []
    for call, record in enumerate(capture.forwards):
        named = [(f"args[{i}]", a) for i, a in enumerate(record.args)] + [(f"{k}=", v) for k, v in record.kwargs.items()]
        for name, value in named:
            for t in floating_tensors(value):
                bad = ~torch.isfinite(t.detach())
                if not bool(bad.any()):
                    continue
                rows = bad.reshape(bad.shape[0], -1).any(1).nonzero().flatten().tolist() if t.dim() else []
                out.append({"forward": call, "arg": name, "samples": rows[:32], "nan": int(torch.isnan(t).sum()),
                            "inf": int(torch.isinf(t).sum())})
    return out


def _keep_grad(record: ForwardRecord, index: int, grad: torch.Tensor) -> None:
    record.output_grads.append((index, grad.detach()))
