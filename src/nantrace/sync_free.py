"""The sync-free step: the verdict on a step stays on the device; the host learns it one step later.

In the default (synchronous) mode the guard reads the step's figures once, decides on the host,
and sets the gradients aside when the update must not land. On an accelerator that one read
drains the launch queue every step. With a *fused* optimizer (``torch.optim.Adam``/``AdamW``/
``SGD``/``Adagrad`` with ``fused=True``) there is another way, the one ``GradScaler`` uses: the
optimizer accepts a device tensor ``found_inf`` and skips its own update, step counters
included, when it is non-zero, without anything being read.

So in sync-free mode, at step *t*:

1. the step's figures are reduced on the device as usual (norms accumulated in float64, so a
   non-finite norm means a non-finite element: no recount is ever needed);
2. the verdict the synchronous mode would reach is computed on the device from them: every
   non-finite fact, and every finite anomaly that blocks under the policy, judged against
   bounds the host computed *before* the step from the run's history (the spike detectors'
   thresholds, the divergence detector's firing ranges, the largest gradient and parameter
   norms for which the optimizer's update is proven finite); under DDP the verdicts of all
   ranks are combined by the step's all-reduce;
3. the verdict goes to the optimizer as ``found_inf``, and the figures start their copy to the
   host (pinned memory, non-blocking);
4. at step *t + 1*, before its update (or at ``close()``), the host reads that copy, which
   the device finished long ago, and does everything the synchronous mode does for step *t*:
   triage, incident, localisation (the parameters are still those step *t* started from, since
   its update was skipped), bundle, escalation, store, monitors, the detectors' history. A
   stopping action (``raise``, ``pause``, the escalation ladder) raises from the optimizer step
   of *t + 1*, before its update lands.

The weights are those of the synchronous mode, bit for bit: the same verdicts (the bounds are
those the host would have used, and the host checks each device verdict against its own when
it reads it, recording any disagreement) applied to the same updates. Zero host reads per step.

A step that cannot be decided this way runs synchronously (:meth:`SyncFree.why_sync`): the
first step of the guard (until an update has landed), fp16 autocast when the precision
fallback is on, an update that cannot be proven finite from the bounds. A set-up where the
mode can never be exact is refused by :func:`ineligible` (and ``"auto"`` does not use it).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .capture import StepCapture
from .detection.divergence import DivergenceRanges
from .detection.sentinel import StagedHealth, stage
from .dynamics._readback import DeferredRead
from .taxonomy import Action

if TYPE_CHECKING:
    from .decision import Decision, StepJudge
    from .reporting import Reporter
    from .distributed import StepRound
    from .response.update_check import UpdateCheck
    from .watched import Watched

__all__ = ["Bounds", "PendingStep", "SyncFree", "device_verdict", "ineligible", "reconcile"]


def ineligible(watched: "Watched", *, scaler: Any, policy: str, skip_snapshots: bool) -> str | None:
    """Why the sync-free mode cannot give the synchronous mode's weights here (``None``: it can)."""
    opt = watched.optimizer
    if opt is None:
        return "there is no optimizer to hand the verdict to"
    if isinstance(opt, torch.optim.LBFGS):
        return "LBFGS evaluates its closure many times per step"
    groups = opt.param_groups
    if not getattr(opt, "_step_supports_amp_scaling", False) or not groups or not all(g.get("fused") for g in groups):
        return (f"{type(opt).__name__} is not a fused optimizer: only fused ones (torch.optim.Adam, AdamW, SGD or "
                "Adagrad with fused=True) can skip an update on a device verdict (found_inf)")
    if scaler is not None and getattr(scaler, "is_enabled", lambda: True)():
        return "a GradScaler already hands the optimizer its own found_inf"
    if policy == "rollback" or skip_snapshots:
        return "a rollback restores a state the next step's gradients were not computed from"
    return None


@dataclasses.dataclass(frozen=True)
class Bounds:
    """What the host decided before the step, for the device to judge it by."""

    loss_threshold: float
    """A finite loss above this is a spike (``inf``: none can be)."""
    grad_threshold: float
    """A finite gradient norm above this is an explosion."""
    divergence: DivergenceRanges | None
    finite_blocks: bool
    """A finite anomaly (spike, explosion, divergence) stops the update under the policy."""
    update_limit: float
    """Gradient and parameter norms up to which the optimizer's update is proven finite (``inf``: unchecked)."""


def device_verdict(staged: StagedHealth, bounds: Bounds,
                   norms: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The synchronous mode's "block this update", computed on the device (a 0-dim bool).

    Non-finite inputs, loss, gradients or parameters always block; a finite anomaly blocks when
    the policy says so; a step whose norms exceed the bound the update is proven finite for is
    withheld (the synchronous mode would copy the state, update and check it; see the module doc).
    ``norms``: the global gradient and parameter norms in place of the staged ones (FSDP2 shards).
    """
    v = staged.vector
    loss, g, p = v[0], v[1], v[2]
    if norms is not None:
        g, p = norms
    block = staged.local_flags[0] < 1  # the model's inputs not all finite (their extremes, or a flag)
    if staged.has_loss:
        block = block | ~torch.isfinite(loss)
    if staged.grad_norms:
        block = block | ~torch.isfinite(g)
    if staged.param_norms:
        block = block | ~torch.isfinite(p)
    if bounds.finite_blocks:
        if staged.has_loss and math.isfinite(bounds.loss_threshold):
            block = block | (loss > bounds.loss_threshold)
        if staged.grad_norms and math.isfinite(bounds.grad_threshold):
            block = block | (g > bounds.grad_threshold)
        if bounds.divergence is not None:
            block = block | bounds.divergence.fires_on_device(loss if staged.has_loss else None,
                                                             g if staged.grad_norms else None)
    if math.isfinite(bounds.update_limit):
        if staged.grad_norms:
            block = block | (g > bounds.update_limit)
        if staged.param_norms:
            block = block | (p > bounds.update_limit)
    return block


@dataclasses.dataclass(eq=False)
class PendingStep:
    """A step decided on the device, waiting for the host to read it at the next step."""

    step: int
    staged: StagedHealth
    """The step's figures on the device (its gradient and parameter lists already dropped)."""
    grad_index: list[int]
    capture: StepCapture
    """What was captured of the step (inputs, RNG, the loss code's tape), for a replay."""
    ranks: "StepRound | None"
    read: DeferredRead
    bounds: Bounds
    lrs: list[float]

    def values(self) -> tuple[list[float], bool, np.ndarray | None]:
        """(the staged figures, the device's verdict, the all-reduced agreement vector)."""
        host = self.read.get()
        n = self.staged.vector.numel()
        shared = np.asarray(host[n + 1:], dtype=np.float64) if self.ranks is not None else None
        return host[:n], host[n] != 0.0, shared


class SyncFree:
    """Stages each step's verdict on the device and hands back the previous step to decide on the host."""

    def __init__(self, watched: "Watched", judge: "StepJudge", update_check: "UpdateCheck | None") -> None:
        self.watched = watched
        self.judge = judge
        self.update_check = update_check
        self.pending: PendingStep | None = None
        self.steps = 0
        """Steps decided on the device so far."""
        self.sync_steps: dict[str, int] = {}
        """Steps that ran synchronously, by reason."""
        self._limit_cache: tuple[Any, float] | None = None

    # ------------------------------------------------------------------ per step
    def why_sync(self, capture: StepCapture) -> str | None:
        """Why this step must be decided on the host (``None``: it can be decided on the device)."""
        if self.judge.last_applied is None:
            return "no update has landed yet (the optimizer state is made by the first one)"
        cfg = self.watched.config
        if cfg.response.precision_fallback_after and any(
                (f.autocast.cuda_enabled and f.autocast.cuda_dtype == torch.float16)
                or (f.autocast.cpu_enabled and f.autocast.cpu_dtype == torch.float16) for f in capture.forwards):
            return "float16 autocast with the precision fallback on (a fallback must act before the next forward)"
        return None

    def note_sync(self, reason: str) -> None:
        self.sync_steps[reason] = self.sync_steps.get(reason, 0) + 1

    def bounds(self, *, finite_blocks: bool, health_hint: tuple[float | None, float | None]) -> Bounds | None:
        """The bounds for this step (``None``: the update cannot be proven finite; decide on the host)."""
        det = self.watched.config.detection
        limit = math.inf
        if self.update_check is not None and self.update_check.enabled:
            limit = self._update_limit(health_hint)
            if limit is None:
                return None
        return Bounds(
            loss_threshold=self.judge.loss_spikes.threshold() if det.detect_loss_spikes else math.inf,
            grad_threshold=self.judge.grad_spikes.threshold() if det.detect_grad_explosion else math.inf,
            divergence=self.judge.divergence.firing_ranges() if det.detect_divergence else None,
            finite_blocks=finite_blocks,
            update_limit=limit,
        )

    def _update_limit(self, hint: tuple[float | None, float | None]) -> float | None:
        """The largest norm X (a power of two) such that the update is proven finite with gradient
        and parameter norms up to X, searched down from well above the last step's figures."""
        assert self.update_check is not None
        floor = max((abs(h) for h in hint if h is not None and math.isfinite(h)), default=1.0)
        key = (self.update_check.proof_key(), floor)
        if self._limit_cache is not None and self._limit_cache[0] == key:
            return self._limit_cache[1]
        x = 2.0 ** math.ceil(math.log2(max(floor, 1e-30)) + 12)  # 4096× the last figures
        limit = None
        while x >= floor:
            if self.update_check.proven(grad=x, param=x):
                limit = x
                break
            x /= 2.0
        self._limit_cache = (key, limit) if limit is not None else None
        return limit

    def try_stage(self, capture: StepCapture, last: dict[str, Any] | None, lrs: Callable[[], list[float]]) -> bool:
        """Decide this step on the device if it can be (see :meth:`why_sync`, :meth:`bounds`);
        True when it was (the verdict is with the optimizer), False when the host must read it.
        ``last``: the figures of the last step the host booked (the update bound is searched from them)."""
        why = self.why_sync(capture)
        bounds = None
        if why is None:
            bounds = self.bounds(finite_blocks=blocked_by_finite_anomalies(self.watched),
                                 health_hint=(last["grad_norm"], last["param_norm"]) if last else (None, None))
            if bounds is None:
                why = "the update could not be proven finite from the run's figures (checked after it instead)"
        if bounds is None:
            self.note_sync(why or "")
            return False
        grads, grad_index = self.judge.gradients(self.watched.params)
        self.stage(capture, bounds, grads=grads, grad_index=grad_index, lrs=lrs())
        return True

    def stage(self, capture: StepCapture, bounds: Bounds, *, grads: list[torch.Tensor], grad_index: list[int],
              lrs: list[float]) -> PendingStep:
        """Reduce the step, judge it on the device, hand the verdict to the optimizer and start the copy."""
        from .distributed import StepRound

        watched = self.watched
        cfg = watched.config.detection
        staged = stage(
            grads=grads, params=watched.params if cfg.check_params else [],
            losses=capture.losses or [c.loss for c in capture.calls if c.loss is not None],
            inputs_ok=capture.inputs_flag, outputs_ok=capture.outputs_flag,
            input_extremes=capture.input_extremes, output_extremes=capture.output_extremes,
            local_grads_ok=capture.local_grads_ok, scale=None, grads_scaled=False, accumulate=torch.float64,
        )
        ranks = None
        if watched.world_size == 1:
            found_inf = device_verdict(staged, bounds).to(torch.float32)
        elif not watched.sharded:  # DDP: each rank's verdict rides in its word of the agreement vector
            ranks = StepRound(watched, self.judge, staged, grad_index, device_block=device_verdict(staged, bounds))
            found_inf = ranks.any_block().to(torch.float32)
        else:  # FSDP2: judged on the global norms the agreement's all-reduce yields, then combined (max) on the device
            ranks = StepRound(watched, self.judge, staged, grad_index)
            found_inf = device_verdict(staged, bounds, norms=ranks.global_norms()).to(torch.float32)
            torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX)
        watched.optimizer.found_inf = found_inf  # type: ignore[union-attr]  # read by the fused kernel
        parts = [staged.vector.to(torch.float64), found_inf.to(staged.vector.device, torch.float64).reshape(1)]
        if ranks is not None:
            parts.append(ranks.vector.to(staged.vector.device, torch.float64))
        read = DeferredRead(torch.cat(parts))
        kept = dataclasses.replace(staged, grads=[], params=[])  # hold no gradient beyond its step
        frozen = copy.copy(capture)
        if capture.tape is not None:  # the live tapes are reset for the next step
            # held until the next step has run its forward and backward: no model output, and no
            # gradient of one (a replay of the tape makes both again), outlives its step
            frozen.tape = capture.tape.naming_outputs(capture.forwards)
            if frozen.tape.usable and frozen.tape.loss is not None:
                frozen.forwards = [dataclasses.replace(f, output_grads=[]) for f in capture.forwards]
        if capture.prelude is not None:
            frozen.prelude = copy.copy(capture.prelude)
        self.pending = PendingStep(watched.step, kept, grad_index, frozen, ranks, read, bounds, lrs)
        self.steps += 1
        return self.pending

    def after_update(self) -> None:
        """Take the verdict back from the optimizer (anything else stepping it sees no found_inf)."""
        opt = self.watched.optimizer
        if opt is not None and hasattr(opt, "found_inf"):
            del opt.found_inf

    def take(self) -> PendingStep | None:
        """The step waiting to be decided on the host, if any (handed over once)."""
        pending, self.pending = self.pending, None
        return pending

    def summary(self) -> dict[str, Any]:
        return {"device_steps": self.steps, "host_steps": dict(self.sync_steps)}


def reconcile(decision: "Decision", device_block: bool, bounds: Bounds, reporter: "Reporter",
              peers: dict[int, str] | None = None) -> None:
    """Make the host's decision of a device-decided step say what happened to its update (the
    device's verdict is what the optimizer did). The two agree unless another rank's verdict
    withheld it (``peers``: the ranks whose own verdict blocked, and the kind their facts suggest,
    from the agreement vector; said so on this rank's incident), the update bound withheld it (the one verdict the host has no
    twin of: reported as ``grad_explosion``), or the host's own verdict differs (recorded on the
    incident as ``details["sync_free_mismatch"]``)."""
    if device_block == decision.block:
        return
    incident = decision.incident
    health, limit = decision.health, bounds.update_limit
    beyond = any(v is not None and v > limit for v in (health.grad_norm, health.param_norm))
    others = [r for r in (peers or {}) if r != reporter.watched.rank]
    if device_block and incident is None and others and not beyond:
        peer = others[0]
        decision.incident = reporter.new(
            kind=(peers or {})[peer], phase=None, cause="unknown", summary=(
                f"Rank {peer}'s own check withheld the update of step {reporter.watched.step}; this "
                "rank skips it too, so that every replica stays identical."),
            fix=f"See the incident recorded by rank {peer}.", action=Action.SKIPPED,
            details={"peer_rank": peer, "sync_free": "withheld on the device by another rank's verdict"})
    elif device_block and incident is None:
        from .diagnosis.patterns import explain

        summary, fix = explain("gradient_explosion", detail=(
            f"to a gradient norm of {health.grad_norm:.4g} (parameters {health.param_norm:.4g}), beyond "
            f"{limit:.4g}, the largest for which the optimizer's update is proven finite"))
        decision.incident = reporter.new(
            kind="grad_explosion", phase="backward", cause="gradient_explosion", summary=summary, fix=fix,
            action=Action.SKIPPED, details={"update_limit": limit, "grad_norm": health.grad_norm,
                                            "param_norm": health.param_norm, "sync_free": "withheld on the device"})
    elif incident is not None:
        incident.details["sync_free_mismatch"] = (
            "the device withheld this update" if device_block else "the update landed before the host read the step")
        if device_block:
            incident.action = Action.SKIPPED
    decision.block = device_block


def blocked_by_finite_anomalies(watched: "Watched") -> bool:
    """A finite anomaly (spike, explosion, divergence) stops the update under this guard's policy."""
    from .diagnosis.triage import Finding
    from .response.policies import action_for

    probe = Finding(0, "loss_spike", None, "loss_divergence", None, "", "")
    return action_for(watched.policy, probe, finite_trouble=True, config=watched.config) != Action.LOGGED
