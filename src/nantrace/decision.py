"""The step's decision: measure (one host read) → triage → agree across ranks → action.

:class:`StepJudge` keeps what the decision learns from the run (the spike and divergence
detectors, the last applied step) and returns one :class:`Decision` per step. It decides; it
does not report: the guard hands a decision carrying an incident to its reporter.

Usage (inside the guard)::

    decision = judge.decide(watched, capture, grads_scaled=False, via_scaler=False,
                            loaded_state=checkpoints.loaded_state_finding, lrs=lrs,
                            history=recorder)
    if decision.incident is not None:
        reporter.report(decision.incident, decision)
"""

from __future__ import annotations

import dataclasses
import math
import operator
from itertools import compress
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .capture import StepCapture, floating_tensors
from .detection.divergence import DivergenceDetector
from .detection.param_provenance import ParamProvenance
from .detection.sentinel import StagedHealth, StepHealth, finish, nonfinite_tensors, read, stage
from .detection.spikes import RobustSpikeDetector
from .diagnosis.triage import Finding, triage
from .distributed import Agreement, StepRound, agree, combine_shards
from .incident import Incident
from .loss_tape import unread_nograd_forwards
from .response.policies import action_for
from .response.update_bounds import update_folds_params
from .taxonomy import Action, is_finite_trouble
from .watched import Watched

__all__ = ["Decision", "StepJudge", "incident_from_finding"]


@dataclasses.dataclass(eq=False)
class Decision:
    """What the check of one step decided."""

    health: StepHealth
    """The step's figures, from its one host read."""
    incident: Incident | None
    """What was found (``None``: a healthy step); the reporter may replace it (an optimizer failure, a collapse)."""
    block: bool
    """The update must not land (the gradients are set aside while ``optimizer.step()`` runs)."""
    scaler_skip: bool
    """The GradScaler skips this step itself (scaled gradients overflowed: calibration, not an incident)."""
    grad_index: list[int] = dataclasses.field(default_factory=list)
    """For each gradient in the step's figures, the index of its parameter in ``Watched.params``."""
    stashed: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
    """The gradients set aside while a blocked update runs; put back after it."""
    agreement: Agreement | None = None
    """What the ranks agreed on (``None`` on one process): the same on every rank."""
    param_bound: float | None = None
    """An upper bound of every parameter element before the update (the update's proof uses it):
    the measured norm, or the bound carried by :class:`~nantrace.detection.param_provenance.ParamProvenance`
    on steps whose check did not read every parameter (``health.param_norm`` is ``None`` there)."""


class StepJudge:
    """Decides each step; keeps the run's history that the decision needs."""

    def __init__(self, watched: Watched) -> None:
        det = watched.config.detection
        self.loss_spikes = RobustSpikeDetector(window=det.spike_window, warmup=det.spike_warmup,
                                               sigma=det.spike_sigma, min_ratio=det.loss_spike_min_ratio)
        self.grad_spikes = RobustSpikeDetector(window=det.spike_window, warmup=det.spike_warmup,
                                               sigma=det.spike_sigma, min_ratio=det.explosion_min_ratio)
        self.divergence = DivergenceDetector(min_steps=det.divergence_steps, min_factor=det.divergence_factor)
        self.last_applied: int | None = None
        """The last step whose update landed."""
        self._unmarked_since: int | None = None
        """This step: the last full read of the parameters, when a non-finite one was found that no
        mark announced (for the diagnosis' wording); ``None`` otherwise."""
        self._full_index: list[int] = []
        """``[0, 1, ..., n - 1]`` for the watched parameters: the gradient index of a step where every
        parameter has a gradient, made once and handed out again (never mutated by its readers)."""
        opt = watched.optimizer
        self.provenance = ParamProvenance(
            watched.params, every=det.param_check_every,
            usable=(det.check_params and det.check_updates and opt is not None and not watched.sharded
                    and not update_folds_params(opt)))
        """Which parameters each check reads (all of them every ``param_check_every`` steps; between,
        only those written outside the optimizer: :mod:`~nantrace.detection.param_provenance`)."""

    def gradients(self, params: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
        """The step's gradients and their parameters' indices (:func:`gradients`, its index list cached)."""
        if len(self._full_index) != len(params):
            self._full_index = list(range(len(params)))
        return gradients(params, self._full_index)

    def decide(self, watched: Watched, capture: StepCapture, *, grads_scaled: bool, via_scaler: bool,
               loaded_state: Callable[[bool], Finding | None], lrs: list[float],
               history: Sequence[dict[str, Any]]) -> Decision:
        """Read the step's health (one host sync), find what is wrong, agree with the other ranks,
        and decide the action. ``loaded_state(params_finite)``: a finding about the state the run
        started from (``CheckpointGate.loaded_state_finding``), told whether this step's parameters are finite."""
        with torch.no_grad():
            return self._decide(watched, capture, grads_scaled=grads_scaled, via_scaler=via_scaler,
                                loaded_state=loaded_state, lrs=lrs, history=history)

    def _decide(self, watched: Watched, capture: StepCapture, *, grads_scaled: bool, via_scaler: bool,
                loaded_state: Callable[[bool], Finding | None], lrs: list[float],
                history: Sequence[dict[str, Any]]) -> Decision:
        cfg = watched.config.detection
        scaler = watched.scaler
        grads, grad_index = self.gradients(watched.params)
        which = self.provenance.plan() if cfg.check_params else None
        params = watched.params if which is None else [watched.params[i] for i in which]
        inputs = capture.take_inputs()  # judged in the step's own pass (stage reduces them where it cannot)
        staged = stage(
            grads=grads,
            params=params if cfg.check_params else [],
            losses=capture.losses or [c.loss for c in capture.calls if c.loss is not None],
            inputs_ok=capture.inputs_flag,
            outputs_ok=capture.outputs_flag,
            input_tensors=inputs,
            input_policy=capture.input_policy,
            input_extremes=capture.input_extremes,
            output_extremes=capture.output_extremes,
            local_grads_ok=capture.local_grads_ok,
            scale=getattr(scaler, "_scale", None) if scaler is not None and scaler.is_enabled() else None,
            grads_scaled=grads_scaled and scaler is not None,
            host_totals=watched.world_size == 1,  # read at once; nothing of the vector is needed on the device
        )
        ranks = StepRound(watched, self, staged, grad_index) if watched.world_size > 1 else None  # on the device
        local, shared = read(staged, ranks.vector if ranks is not None else None)  # the step's one host read
        return self.conclude(watched, capture, staged, local, shared, ranks, grads, grad_index, via_scaler=via_scaler,
                             loaded_state=loaded_state, lrs=lrs, history=history,
                             read_params=which, track_params=cfg.check_params)

    def conclude(self, watched: Watched, capture: StepCapture, staged: StagedHealth, local: list[float], shared: Any,
                 ranks: StepRound | None, grads: list[torch.Tensor], grad_index: list[int], *, via_scaler: bool,
                 loaded_state: Callable[[bool], Finding | None], lrs: list[float],
                 history: Sequence[dict[str, Any]], read_params: list[int] | None = None,
                 track_params: bool = False) -> Decision:
        """The decision from the step's figures as read on the host (``local``, and the agreement
        vector ``shared`` of ``ranks``): triage, agreement across ranks, the incident. Called right
        after the read, or one step later in sync-free mode (``grads`` empty then: the gradients
        of that step are gone; the per-tensor norms name the non-finite ones). ``read_params``: the
        parameters the check read when it did not read them all (their indices); ``track_params``: the
        figures are this step's own, read before its update (not a step the device decided earlier)."""
        cfg = watched.config.detection
        device = staged.vector.device
        health = finish(staged, local)
        if ranks is not None:
            ranks.settle(health, shared)
            if ranks.fallback and watched.sharded:  # rare path: a non-finite global norm, combined from exact figures
                combine_shards(health, grad_index=grad_index, n_params=len(watched.params), device=device)
        param_bound = self._params_known(watched, health, read_params) if track_params else health.param_norm
        finding = loaded_state(health.params_finite) or triage(
            health,
            step=watched.step,
            scaler_active=via_scaler,
            loss_spikes=self.loss_spikes if cfg.detect_loss_spikes else None,
            grad_spikes=self.grad_spikes if cfg.detect_grad_explosion else None,
            last_applied=self.last_applied,
            params_read=self._unmarked_since,
            divergence=self.divergence if cfg.detect_divergence else None,
            lr=next(iter(lrs), None),
        )
        if capture.abandoned and (finding is None or finding.kind == "nonfinite_activation"):
            finding = abandoned_loss_finding(watched, capture, watched.step) or finding
        agreement = None
        if ranks is not None:
            agreement, finding = self._agree(watched, health, finding, ranks, via_scaler=via_scaler, device=device)
        scaler_skip = via_scaler and not health.grads_finite and finding is None
        incident = None
        if finding is not None:
            incident = incident_from_finding(watched, finding, health, grads, grad_index, capture, history)
            if agreement is not None and agreement.origin_ranks:
                incident.rank = agreement.origin_ranks[0]
                incident.details["origin_ranks"] = agreement.origin_ranks
                if watched.rank not in agreement.origin_ranks:
                    reduction = "reduce-scatter" if watched.sharded else "all-reduce"
                    if incident.kind.startswith("nonfinite"):
                        origin = (f"The non-finite values came from rank {incident.rank} (its own data or gradients, "
                                  f"before the {reduction}); this rank only received them. ")
                    else:  # a finite anomaly of that rank's own loss (a spike, a divergence)
                        origin = f"The anomaly is rank {incident.rank}'s own (its loss); this rank did not see it. "
                    incident.summary = origin + incident.summary
        return Decision(health, incident, block=incident is not None and incident.action != Action.LOGGED,
                        scaler_skip=scaler_skip, grad_index=grad_index, agreement=agreement, param_bound=param_bound)

    def _params_known(self, watched: Watched, health: StepHealth, read_params: list[int] | None) -> float | None:
        """Settle what the step knows of its parameters; returns the bound of their elements for the
        update's proof. A check that read only some of them (or none) reads them all after all when
        anything in the step is non-finite, so the triage sees what an every-step read would."""
        prov = self.provenance
        self._unmarked_since = None
        if read_params is not None:
            troubled = not (health.loss_finite and health.grads_finite and health.params_finite
                            and health.inputs_finite and health.outputs_finite and health.local_grads_finite)
            if troubled:
                norms = param_norms(watched.params)  # the rare path: a second read, only in a troubled step
                health.param_norms = norms
                health.param_norm = math.sqrt(math.fsum(n * n for n in norms)) if all(map(math.isfinite, norms)) \
                    else (math.nan if any(map(math.isnan, norms)) else math.inf)
                read_params = None
            else:
                prov.measured(read_params, health.param_norms, step=watched.step)
                health.param_norm, health.param_norms = None, []  # not this step's figures: none were read in full
                return prov.bound
        if prov.enabled:
            marked = prov.marked
            if not health.params_finite and marked is not None and prov.last_read is not None:
                bad = [i for i, n in enumerate(health.param_norms) if not math.isfinite(n)]
                if any(i not in marked for i in bad):  # a bad value no mark announced: since when were they known?
                    self._unmarked_since = prov.last_read
            prov.measured(None, health.param_norms, step=watched.step)
            return prov.bound if prov.bound is not None else health.param_norm
        return health.param_norm

    def _agree(self, watched: Watched, health: StepHealth, finding: Finding | None, ranks: StepRound, *,
               via_scaler: bool, device: torch.device) -> tuple[Agreement, Finding | None]:
        """Make every rank take the same decision; name the rank the failure came from (from the
        facts every rank read in the step's one read; a second round only on the rare path)."""
        local_origin = not (health.inputs_finite and health.loss_finite and health.outputs_finite
                            and health.local_grads_finite and health.params_finite) or (
            finding is not None and finding.kind == "loss_spike")  # the loss is per rank; gradients are shared
        blocks = finding is not None and action_for(
            watched.policy, finding, finite_trouble=is_finite_trouble(finding.kind),
            config=watched.config) != Action.LOGGED
        if ranks.fallback:
            agreement = agree(rank=watched.rank, world_size=watched.world_size, local_origin=local_origin,
                              local_kind=finding.kind if blocks and finding is not None else None, device=device)
        else:
            agreement = ranks.agreement(watched, self, scaler_active=via_scaler)
        if agreement.block and not blocks:
            finding = Finding(
                watched.step, agreement.peer_kind or "nonfinite_grad", None, "unknown", None,
                f"Rank {agreement.peer_rank} reported {agreement.peer_kind} at step {watched.step}; this rank skips "
                "the update too, so that every replica stays identical.",
                f"See the incident recorded by rank {agreement.peer_rank}.",
                details={"peer_rank": agreement.peer_rank},
            )
        return agreement, finding


def gradients(params: Sequence[torch.Tensor], full_index: list[int] | None = None) -> tuple[list[torch.Tensor], list[int]]:
    """The step's gradients (sparse ones as their values) and the index of each one's parameter.

    The common step (every parameter has a dense gradient) is read with C-level scans (``map``
    over the parameters, no Python loop body) and returns ``full_index`` itself when given
    (``list(range(len(params)))``, cached by the caller), so nothing is built per parameter
    beyond the list of gradients. Missing or sparse gradients take the per-parameter path.
    """
    grads = list(map(_GRAD, params))
    missing = any(map(_IS_NONE, grads))
    if not missing and not any(map(_IS_SPARSE, grads)):
        return grads, full_index if full_index is not None else list(range(len(grads)))
    if missing:  # frozen or unused parameters: C-level filters, still no Python loop body
        index = list(compress(range(len(grads)), map(_IS_NOT_NONE, grads)))
        present = [grads[i] for i in index]
        if not any(map(_IS_SPARSE, present)):
            return present, index
    grads, index = [], []
    for i, p in enumerate(params):
        g = p.grad
        if g is None:
            continue
        if g.is_sparse:
            g = g.coalesce().values()
        grads.append(g)
        index.append(i)
    return grads, index


_GRAD = operator.attrgetter("grad")
_IS_SPARSE = operator.attrgetter("is_sparse")


def _IS_NONE(x: object) -> bool:  # noqa: N802 - used as a map function, like the getters above
    return x is None


def _IS_NOT_NONE(x: object) -> bool:  # noqa: N802
    return x is not None


ABANDONED = "abandoned_forward"
"""``Finding.details`` key: the index of the step's forward whose loss the step's code left non-finite without
``backward()`` (:func:`abandoned_loss_finding`); localisation replays that sub-step (``StepCapture.abandoned_sub_step``)."""


def abandoned_loss_finding(watched: Any, capture: StepCapture, step: int) -> Finding | None:
    """A sub-step the training loop abandoned: a forward whose outputs no gradient reached, whose loss (the last
    scalar the step's code made from it before the next forward, ``ForwardRecord.abandoned_loss``) is non-finite.
    A loop that skips a non-finite loss (``if not torch.isfinite(loss): continue``, Lightning's ``return None``)
    goes on to the next batch in the same step: the update is that batch's and may be healthy, but the skipped
    loss is the failure to report. Its value is read only for a forward that kept such a loss and received no
    gradient (a rare step: the read is not one of a healthy step's). ``None`` without output gradients to tell
    (``keep_output_grads=False``) or when every such loss is finite."""
    if not watched.config.localisation.keep_output_grads:
        return None
    for k, record in enumerate(capture.forwards):
        kept = record.abandoned_loss
        if kept is None or not record.grad_enabled or record.output_grads:
            continue
        value = float(kept[1])  # a rare path: an abandoned forward's loss
        if math.isfinite(value):
            continue
        return Finding(step, "nonfinite_loss", "forward", "unknown", None,
                       f"The loss of a batch in step {step} was {value:g}; the training loop left it without "
                       "backward() and went on to another batch, whose update is the step's.",
                       "The loop skipped the batch, so no update used it; the batch or the code that made its loss "
                       "still needs fixing (the origin below).",
                       details={ABANDONED: k, "abandoned_loss": value}, benign=True)
    return None


def incident_from_finding(watched: Watched, finding: Finding, health: StepHealth, grads: list[torch.Tensor],
                          grad_index: list[int], capture: StepCapture, history: Sequence[dict[str, Any]]) -> Incident:
    """The incident of a finding of the step check, with the evidence the check has (which tensors
    are non-finite, the step's figures); its action is the policy's."""
    from .reporting import new_incident

    action = action_for(watched.policy, finding, finite_trouble=is_finite_trouble(finding.kind), config=watched.config)
    details: dict[str, Any] = dict(finding.details)
    if not health.grads_finite:
        details["nonfinite_grads"] = nonfinite_tensors([(watched.param_names[i], g) for i, g in zip(grad_index, grads)]) \
            if grads else nonfinite_from_norms([watched.param_names[i] for i in grad_index], health.grad_norms)
    module = finding.module
    if not health.params_finite:
        details["nonfinite_params"] = bad_params = nonfinite_tensors(list(zip(watched.param_names, watched.params)))
        if finding.kind == "nonfinite_param" and bad_params:
            module = bad_params[0]["name"].rpartition(".")[0]  # the module that owns the first bad tensor
    if not health.inputs_finite:
        details["nonfinite_inputs"] = bad_inputs(capture)
    details["loss"] = health.loss
    details["grad_norm"] = health.grad_norm
    if health.scale is not None:
        details["loss_scale"] = health.scale
    return new_incident(watched, step=finding.step, kind=finding.kind, phase=finding.phase, module=module,
                        cause=finding.cause, summary=finding.summary, fix=finding.fix, action=action,
                        details=details, history=history)


def param_norms(params: Sequence[torch.Tensor]) -> list[float]:
    """Every parameter's L2 norm accumulated in float64 (exact about finiteness), one host read."""
    if not params:
        return []
    from .detection.sentinel import local

    flat = [local(p.detach()) for p in params]
    try:
        norms = torch._foreach_norm(flat, 2, dtype=torch.float64)
    except (RuntimeError, TypeError):
        norms = [torch.linalg.vector_norm(t, dtype=torch.float64) for t in flat]
    return torch.stack([n.to(flat[0].device) for n in norms]).tolist()


def nonfinite_from_norms(names: Sequence[str], norms: Sequence[float]) -> list[dict[str, Any]]:
    """The tensors whose (float64-accumulated) norm is non-finite, when the tensors themselves are
    gone: a NaN norm means at least one NaN, an infinite one at least one infinity and no NaN
    (the counts are unknown: ``None``)."""
    return [{"name": n, "nan": None, "inf": None, "norm": "nan" if math.isnan(v) else "inf"}
            for n, v in zip(names, norms) if not math.isfinite(v)]


def bad_inputs(capture: StepCapture) -> list[dict[str, Any]]:
    """Which forward call, argument and samples (rows of dim 0) carried non-finite values."""
    out = []
    unread = unread_nograd_forwards(capture.tape, capture.prelude, capture.forwards)
    for call, record in enumerate(capture.forwards):
        if call in unread:  # an evaluation pass between steps: its data is not the step's
            continue
        named = [(f"args[{i}]", a) for i, a in enumerate(record.args)] + [(f"{k}=", v) for k, v in record.kwargs.items()]
        for name, value in named:
            for t in floating_tensors(value):
                values, rows_of = _stored(t.detach())
                bad = ~torch.isfinite(values)
                if not bool(bad.any()):
                    continue
                rows = rows_of(bad) if t.dim() else []
                out.append({"forward": call, "arg": name, "samples": rows[:32], "nan": int(torch.isnan(values).sum()),
                            "inf": int(torch.isinf(values).sum())})
    return out


def _stored(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], list[int]]]:
    """The values ``t`` stores, and how a mask over them maps to rows of dim 0 (a sparse input, a graph's
    adjacency, is read through its stored values: never densified)."""
    if t.layout == torch.sparse_coo:
        t = t.coalesce()
        indices = t._indices()
        return t._values(), lambda bad: indices[0][bad.reshape(bad.shape[0], -1).any(1)].unique().tolist()
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        crow = t.crow_indices()
        counts = crow[1:] - crow[:-1]
        rows = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        scale = t.values().shape[1] if t.layout == torch.sparse_bsr else 1
        return t.values(), lambda bad: (rows[bad.reshape(bad.shape[0], -1).any(1)] * scale).unique().tolist()
    if t.layout != torch.strided or t.is_nested:
        values = t.values() if t.layout != torch.strided else torch.cat([p.reshape(-1) for p in t.unbind()])
        return values, lambda bad: []
    return t, lambda bad: bad.reshape(bad.shape[0], -1).any(1).nonzero().flatten().tolist()
