"""Data-parallel awareness: which rank a failure came from, and one decision for all ranks.

NaNs cross ranks only through collectives. A DDP communication hook checks each bucket of
*local* gradients before the all-reduce (no host sync: the flag joins the step's fused
read), so the incident names the rank whose data produced the failure.

One decision for all ranks, in the step's single host read (:class:`StepRound`): before
anything is read, each rank turns its own figures into a word of facts on the device (which
of its inputs, loss, outputs, local gradients, gradients, parameters are non-finite; whether
its loss or gradient norm exceeds its spike detector's threshold, computed beforehand on the
host), writes it into its slot of a ``world_size`` vector and all-reduces it, together with
the squared shard norms under FSDP2. That vector is read in the same transfer as the local
figures. Every rank then holds every rank's facts, runs the same triage on them, and so
reaches the same decision (skip / raise / pause) without a second collective or read: no
rank steps while another skips, and replicas neither deadlock nor diverge.

Rare path: when some rank's gradient or parameter norm is non-finite, a float32 norm may
have overflowed over finite elements (the host recounts those in float64), so the facts are
settled by the original two-round protocol (:func:`agree`, and under FSDP2
:func:`combine_shards`): an incident step may take up to three reads, a healthy step one.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from .capture import finite_flag
from .taxonomy import KINDS, Action, is_finite_trouble

if TYPE_CHECKING:
    from .detection.sentinel import StagedHealth, StepHealth
    from .diagnosis.triage import Finding
    from .decision import StepJudge
    from .guard import Guard
    from .watched import Watched


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) when torch.distributed is not initialised."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def install_local_grad_check(guard: "Guard") -> bool:
    """Register a DDP comm hook that records local-gradient finiteness, then all-reduces as DDP does.

    Returns False when the model is not DDP or already has a comm hook of its own (DDP allows
    one). A DDP hook cannot be unregistered: after ``guard.close()`` it only all-reduces, and
    a later guard on the same DDP model takes the hook over instead of losing the check.
    """
    model = guard.model
    if type(model).__name__ != "DistributedDataParallel" or not hasattr(model, "register_comm_hook"):
        return False
    target = getattr(model, _HOOK_TARGET, None)
    if target is not None:  # our hook, left by an earlier guard
        target[0] = weakref.ref(guard)
        return True
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    target = [weakref.ref(guard)]

    def check_then_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # DDP inspects real annotations
        g = target[0]()
        if g is not None and not g.closed and not g.state.replaying:
            g.recorder.capture.and_local_grads(finite_flag(bucket.buffer()))
        return default_hooks.allreduce_hook(state, bucket)

    try:
        model.register_comm_hook(state=None, hook=check_then_allreduce)
    except RuntimeError:
        return False
    setattr(model, _HOOK_TARGET, target)
    return True


_HOOK_TARGET = "_nantrace_grad_check_target"
"""Attribute of a DDP model holding the guard its nantrace comm hook reports to."""


@dataclasses.dataclass
class Agreement:
    """What all ranks agreed on for one step."""

    origin_ranks: list[int]
    """Ranks whose own data/loss/gradients were non-finite (before any collective)."""
    block: bool
    """Some rank blocks this update: every rank must."""
    peer_kind: str | None
    """The kind reported by the lowest rank that blocks (for ranks that saw nothing themselves)."""
    peer_rank: int | None
    kinds: dict[int, str] = dataclasses.field(default_factory=dict)
    """The kind each blocking rank reported: the same on every rank."""

    @property
    def replay_together(self) -> bool:
        """Some rank's incident is one localisation replays (a non-finite value made by the step):
        under FSDP2 every rank then replays together (``localisation/lockstep.py``)."""
        return self.block and any(localisable(kind) for kind in self.kinds.values())


def localisable(kind: str) -> bool:
    """An incident kind that a replay of the step can localise."""
    return kind.startswith("nonfinite") and kind != "nonfinite_param"


def agree(*, rank: int, world_size: int, local_origin: bool, local_kind: str | None, device: torch.device) -> Agreement:
    """One all-reduce of 2 × world_size numbers: who saw a local failure, who wants to block."""
    vec = torch.zeros(2 * world_size, dtype=torch.float32, device=device)
    vec[rank] = float(local_origin)
    if local_kind is not None:
        vec[world_size + rank] = float(KINDS.index(local_kind) + 1)
    torch.distributed.all_reduce(vec)
    host = vec.tolist()
    origins = [r for r in range(world_size) if host[r] > 0]
    blockers = [r for r in range(world_size) if host[world_size + r] > 0]
    kinds = {r: KINDS[int(host[world_size + r]) - 1] for r in blockers}
    peer = blockers[0] if blockers else None
    return Agreement(
        origin_ranks=origins,
        block=bool(blockers),
        peer_kind=kinds[peer] if peer is not None else None,
        peer_rank=peer,
        kinds=kinds,
    )


# ---------------------------------------------------------------- the one-read round
# Facts a rank publishes about its own step, one bit each, in a float64 word (exact below 2**53).
INPUTS_BAD, LOSS_BAD, OUTPUTS_BAD, LOCAL_GRADS_BAD, GRADS_BAD, PARAMS_BAD, LOSS_SPIKE, GRAD_SPIKE = (1 << i for i in range(8))
_ORIGIN_BITS = INPUTS_BAD | LOSS_BAD | OUTPUTS_BAD | LOCAL_GRADS_BAD | PARAMS_BAD
DIVERGES = 1 << 9
"""This rank's divergence detector flags the step (judged on the device from its firing ranges)."""
DEVICE_BLOCK = 1 << 8
"""Sync-free mode: this rank's device verdict blocks the update (``sync_free.device_verdict``)."""


class StepRound:
    """One step's cross-rank agreement, folded into the step's single host read.

    Usage (inside the guard's decision)::

        staged = sentinel.stage(...)                      # this rank's figures, on the device
        ranks = StepRound(watched, judge, staged, grad_index)   # facts word + all-reduce, on the device
        local, shared = sentinel.read(staged, ranks.vector)   # the one host read
        health = sentinel.finish(staged, local)
        ranks.settle(health, shared)                      # FSDP2: global norms into ``health``
        agreement = ranks.agreement(...)                  # None: take the rare two-round path

    The all-reduced vector is ``world_size × k`` numbers (k = 1, or 2 under FSDP2, where the
    gradient-spike threshold travels too because the global norm is known only after the
    reduction) plus, under FSDP2, ``2 + 2 × n_params`` squared norms.
    """

    def __init__(self, watched: "Watched", judge: "StepJudge", staged: "StagedHealth", grad_index: list[int],
                 *, device_block: torch.Tensor | None = None) -> None:
        self.rank, self.world_size = watched.rank, watched.world_size
        self.sharded = watched.sharded
        self.n_params = len(watched.params)
        self.grad_index = grad_index
        self.has_loss = staged.has_loss
        self.has_grads = bool(staged.grad_norms)
        self.has_params = bool(staged.param_norms)
        cfg = watched.config
        self.loss_threshold = judge.loss_spikes.threshold() if cfg.detection.detect_loss_spikes else math.inf
        self.grad_threshold = judge.grad_spikes.threshold() if cfg.detection.detect_grad_explosion else math.inf
        self.divergence = judge.divergence.firing_ranges() if cfg.detection.detect_divergence else None
        """Where this rank's divergence detector fires (its loss is its own: every rank must know)."""
        self.k = 2 if self.sharded else 1
        self.fallback = False
        self.words = np.zeros(0, dtype=np.int64)
        self.grad_thresholds = np.zeros(0)
        self.global_grad_norm: float | None = None
        self._device_block = device_block
        self.vector = self._start(staged)

    # -------------------------------------------------------------- on the device
    def _start(self, staged: "StagedHealth") -> torch.Tensor:
        device = staged.vector.device
        f64 = torch.float64
        zero = torch.zeros((), dtype=f64, device=device)
        bad = 1.0 - staged.local_flags.to(f64)  # [inputs, outputs, local grads]; Python constants: no copy to the device
        word = bad[0] * INPUTS_BAD + bad[1] * OUTPUTS_BAD + bad[2] * LOCAL_GRADS_BAD
        loss = staged.loss.to(f64)
        if self.has_loss:
            finite = torch.isfinite(loss)
            word = word + (~finite).to(f64) * LOSS_BAD
            word = word + (finite & (loss > self.loss_threshold)).to(f64) * LOSS_SPIKE
        if self.divergence is not None:
            g = staged.unscaled_grad_norm64() if self.has_grads and not self.sharded else None
            diverges = self.divergence.fires_on_device(loss if self.has_loss else None, g)
            if isinstance(diverges, torch.Tensor):
                word = word + diverges.to(f64) * DIVERGES
        if self._device_block is not None:
            word = word + self._device_block.to(f64) * DEVICE_BLOCK
        slot = [word]
        if not self.sharded:  # the norms are this rank's own (DDP: the all-reduced gradients)
            if self.has_grads:
                g = staged.unscaled_grad_norm64()
                finite = torch.isfinite(g)
                word = word + (~finite).to(f64) * GRADS_BAD + (finite & (g > self.grad_threshold)).to(f64) * GRAD_SPIKE
            if self.has_params:
                word = word + (~torch.isfinite(staged.param_norm)).to(f64) * PARAMS_BAD
            slot = [word]
        else:  # shard norms: global figures and the gradient-spike verdict come after the reduction
            slot = [word, torch.full((), self.grad_threshold, dtype=f64, device=device)]
        parts = [torch.zeros(self.rank * self.k, dtype=f64, device=device), torch.stack(slot),
                 torch.zeros((self.world_size - self.rank - 1) * self.k, dtype=f64, device=device)]
        if self.sharded:
            parts.append(self._shard_squares(staged, zero))
        vec = torch.cat(parts)
        torch.distributed.all_reduce(vec)
        return vec

    def _shard_squares(self, staged: "StagedHealth", zero: torch.Tensor) -> torch.Tensor:
        """Squared shard norms laid out by parameter index (the same length on every rank,
        whichever gradients a rank holds): total grad, total param, per grad, per param."""
        f64 = torch.float64
        grads = [zero] * self.n_params
        for i, n in zip(self.grad_index, staged.grad_norms):
            grads[i] = n
        params = list(staged.param_norms) if len(staged.param_norms) == self.n_params else [zero] * self.n_params
        head = torch.stack([staged.grad_norm if self.has_grads else zero, staged.param_norm if self.has_params else zero])
        squares = torch.cat([head.to(f64), torch.stack(grads).to(f64) if grads else zero.new_zeros(0),
                             torch.stack(params).to(f64) if params else zero.new_zeros(0)]) ** 2
        if staged.grads_scaled and self.has_grads:
            s = staged.scale.to(f64)
            usable = ~torch.isnan(s) & (s != 0)
            divisor = torch.where(usable, s * s, torch.ones_like(s))
            scale = torch.ones_like(squares)
            scale[0] = divisor
            scale[2:2 + self.n_params] = divisor
            squares = squares / scale
        return squares

    def device_blockers(self) -> dict[int, str]:
        """After :meth:`settle` (sync-free mode): the ranks whose own device verdict blocked the
        update, each with the kind its published facts suggest (a finite anomaly of its own loss
        when nothing non-finite was published: a spike or a divergence)."""
        out = {}
        for r in np.flatnonzero(self.words & DEVICE_BLOCK).tolist():
            word = int(self.words[r])
            out[r] = ("nonfinite_input" if word & INPUTS_BAD else "nonfinite_loss" if word & LOSS_BAD else
                      "nonfinite_grad" if word & (GRADS_BAD | LOCAL_GRADS_BAD) else "nonfinite_param" if word & PARAMS_BAD
                      else "grad_explosion" if word & GRAD_SPIKE else "loss_spike")
        return out

    def global_norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """On the device, after the all-reduce (FSDP2): the model's gradient and parameter norms."""
        squares = self.vector[self.world_size * self.k:]
        return squares[0].sqrt(), squares[1].sqrt()

    def any_block(self) -> torch.Tensor:
        """On the device, after the all-reduce: some rank's own verdict blocks the update (sync-free mode)."""
        words = self.vector[: self.world_size * self.k : self.k]
        return (torch.floor(words / DEVICE_BLOCK) % 2 > 0).any()

    # -------------------------------------------------------------- on the host
    def settle(self, health: "StepHealth", shared: np.ndarray) -> None:
        """Take the read agreement vector in; under FSDP2 put the global norms into ``health``.

        Sets :attr:`fallback` when the rare two-round path must settle the step.
        """
        slots = shared[: self.world_size * self.k].reshape(self.world_size, self.k)
        self.words = slots[:, 0].astype(np.int64)
        if not self.sharded:
            self.fallback = bool((self.words & (GRADS_BAD | PARAMS_BAD)).any())
            return
        squares = shared[self.world_size * self.k:]
        host = np.sqrt(squares).tolist()  # a NaN square stays NaN
        n = self.n_params
        if (self.has_grads and not math.isfinite(host[0])) or (self.has_params and not math.isfinite(host[1])):
            self.fallback = True  # a non-finite global norm: combined again from exact local figures
            return
        if health.grad_norm is not None:
            health.grad_norm = host[0]
        if health.param_norm is not None:
            health.param_norm = host[1]
        if health.grad_norms:
            health.grad_norms = [host[2 + i] for i in self.grad_index]
        if len(health.param_norms) == n:
            health.param_norms = host[2 + n:]
        self.grad_thresholds = slots[:, 1]
        self.global_grad_norm = host[0] if self.has_grads else None

    def agreement(self, watched: "Watched", judge: "StepJudge", *, scaler_active: bool) -> "Agreement":
        """The decision every rank reaches from the same facts: who originated, who blocks."""
        from .diagnosis.triage import triage

        origins, blockers, kinds = [], [], {}
        flagged = self.words != 0
        sharded_spikes = None
        if self.sharded and self.global_grad_norm is not None and math.isfinite(self.global_grad_norm):
            sharded_spikes = self.global_grad_norm > self.grad_thresholds
            flagged |= sharded_spikes
        for r in np.flatnonzero(flagged).tolist():  # vectorised: only ranks with a fact are judged
            word = int(self.words[r])
            grad_spike = bool(sharded_spikes[r]) if sharded_spikes is not None else bool(word & GRAD_SPIKE)
            finding = triage(  # a divergence of a rank's own loss reads as its loss spike: both stop the update
                _facts_health(word), step=watched.step, scaler_active=scaler_active,
                loss_spikes=_Verdict(bool(word & (LOSS_SPIKE | DIVERGES))), grad_spikes=_Verdict(grad_spike),
                last_applied=judge.last_applied,
            )
            if word & _ORIGIN_BITS or (finding is not None and finding.kind == "loss_spike"):
                origins.append(r)
            if finding is not None and blocks(watched, finding):
                blockers.append(r)
                kinds[r] = finding.kind
        peer = blockers[0] if blockers else None
        return Agreement(origin_ranks=origins, block=bool(blockers),
                         peer_kind=kinds[peer] if peer is not None else None, peer_rank=peer, kinds=kinds)


def blocks(watched: "Watched", finding: "Finding") -> bool:
    """Whether this finding stops the update under the guard's policy."""
    from .response.policies import action_for

    return action_for(watched.policy, finding, finite_trouble=is_finite_trouble(finding.kind),
                      config=watched.config) != Action.LOGGED


class _Verdict:
    """A spike detector stand-in that replays a verdict already reached (by the rank that owns
    the detector, from its threshold) instead of judging again."""

    def __init__(self, flagged: bool) -> None:
        self.flagged = flagged

    def update(self, value: float) -> object | None:
        from .detection.spikes import Spike

        return Spike(value=value, median=math.nan, zscore=math.nan, ratio=math.nan, window=0) if self.flagged else None


def _facts_health(word: int) -> "StepHealth":
    """A StepHealth carrying only a rank's published facts (values stand in for figures that
    are not shared: only finiteness and the spike verdicts decide the kind)."""
    from .detection.sentinel import StepHealth

    return StepHealth(
        loss=math.nan if word & LOSS_BAD else 0.0, grad_norm=math.inf if word & GRADS_BAD else 0.0,
        param_norm=math.inf if word & PARAMS_BAD else 0.0, inputs_finite=not word & INPUTS_BAD,
        outputs_finite=not word & OUTPUTS_BAD, local_grads_finite=not word & LOCAL_GRADS_BAD,
        scale=None, grad_norms=[], param_norms=[],
    )


def combine_shards(health: "StepHealth", *, grad_index: list[int], n_params: int, device: torch.device) -> None:
    """Global gradient and parameter norms, total and per tensor, from each rank's shard norms
    as read on the host (the rare path of :class:`StepRound`: one more collective and read).

    One all-reduce of squared norms laid out by parameter index, so per-layer figures are the
    model's, not a shard's. NaN and Inf propagate.
    """
    squares = torch.zeros(2 + 2 * n_params, dtype=torch.float64)
    squares[0] = (health.grad_norm or 0.0) ** 2
    squares[1] = (health.param_norm or 0.0) ** 2
    if health.grad_norms:
        squares[torch.tensor(grad_index, dtype=torch.long) + 2] = torch.tensor(health.grad_norms, dtype=torch.float64) ** 2
    if len(health.param_norms) == n_params:
        squares[2 + n_params:] = torch.tensor(health.param_norms, dtype=torch.float64) ** 2
    squares = squares.to(device)
    torch.distributed.all_reduce(squares)
    host = squares.sqrt().tolist()
    if health.grad_norm is not None:
        health.grad_norm = host[0]
    if health.param_norm is not None:
        health.param_norm = host[1]
    if health.grad_norms:
        health.grad_norms = [host[2 + i] for i in grad_index]
    if len(health.param_norms) == n_params:
        health.param_norms = host[2 + n_params:]
