"""nantrace's vocabulary in one place: incident kinds, phases, cause codes, actions and policies.

Everything that names a kind, a cause or an action imports it from here; the values are the
public contract (``API.md``: the ``Incident`` fields and the cause table). Each set is a
``Literal`` type, for type checkers, and a tuple of its values, for checks at run time; actions
and policies are also string enums, so code says ``Action.SKIPPED`` while an incident still
holds (and compares equal to, and serialises as) the plain string ``"skipped"``.

Usage::

    from nantrace.taxonomy import Action, CAUSES, is_finite_trouble
    incident.action = Action.SKIPPED        # == "skipped"; json.dumps gives "skipped"
    assert incident.cause in CAUSES
"""

from __future__ import annotations

import enum
import sys
from typing import Literal, get_args

__all__ = [
    "ACTIONS", "BATCH_CAUSES", "BLOCKING_ACTIONS", "CAUSES", "DATA_INCIDENT_CAUSES", "EARLY_WARNING_CAUSES",
    "EARLY_WARNING_KINDS", "FINITE_TROUBLE_KINDS", "KINDS", "MASK_CAUSES", "PHASES", "POLICIES", "SAMPLER_CAUSES",
    "SEED_CAUSES", "STOPPING_ACTIONS", "Action", "Cause", "Kind", "Phase", "Policy", "StrEnum", "is_finite_trouble",
]

if sys.version_info >= (3, 11):
    StrEnum = enum.StrEnum
else:  # pragma: no cover - Python 3.10
    class StrEnum(str, enum.Enum):
        """``enum.StrEnum`` before Python 3.11: members are their string values."""

        __str__ = str.__str__
        __format__ = str.__format__  # type: ignore[assignment]


# ---------------------------------------------------------------- incident kinds (what was observed)
Kind = Literal[
    "nonfinite_loss", "nonfinite_grad", "nonfinite_param", "nonfinite_input", "nonfinite_activation",
    "loss_spike", "grad_explosion", "scaler_collapse", "optimizer_state", "exception",
    # early warnings: the update is applied (action ``logged``)
    "grad_growth", "update_ratio", "vanishing_gradient", "lr_schedule", "clipping", "logit_saturation",
]
KINDS: tuple[str, ...] = get_args(Kind)

EARLY_WARNING_KINDS: tuple[str, ...] = KINDS[KINDS.index("grad_growth"):]
"""Kinds that only the training-dynamics monitors report (always ``logged``); they also report
``optimizer_state``, a kind the guard's step check uses too."""

FINITE_TROUBLE_KINDS: tuple[str, ...] = ("loss_spike", "grad_explosion", "scaler_collapse")
"""Kinds of a step whose values are finite but wrong: ``Config.finite_anomaly_action="log"`` only reports them."""


def is_finite_trouble(kind: str) -> bool:
    """Whether an incident of ``kind`` is a finite anomaly (a spike, an explosion, a collapse)."""
    return kind in FINITE_TROUBLE_KINDS


# ---------------------------------------------------------------- phases (where the first bad value arose)
Phase = Literal["data", "forward", "backward", "optimizer"]
PHASES: tuple[str, ...] = get_args(Phase)

# ---------------------------------------------------------------- cause codes (why)
Cause = Literal[
    "nonfinite_input", "label_out_of_range", "nonfinite_param", "log_nonpositive", "div_by_zero", "sqrt_negative",
    "grad_singularity", "exp_overflow", "overflow", "domain_error", "precision_overflow", "masked_softmax_all",
    "inf_arithmetic", "zero_variance_norm", "where_gradient_trap", "gradient_explosion", "loss_divergence",
    "scaler_collapse", "optimizer_state", "unknown",
    # early warnings
    "update_too_large", "vanishing_gradient", "lr_schedule_mismatch", "clip_threshold", "logit_saturation",
]
CAUSES: tuple[str, ...] = get_args(Cause)

EARLY_WARNING_CAUSES: tuple[str, ...] = CAUSES[CAUSES.index("update_too_large"):]
"""Causes that only the training-dynamics monitors use (nothing is non-finite yet)."""


# ---------------------------------------------------------------- what nantrace did, and what it may be told to do
class Action(StrEnum):
    """The incident's ``action`` field: what nantrace did about it."""

    SKIPPED = "skipped"
    """The update did not happen; training goes on."""
    RAISED = "raised"
    """``NonFiniteError`` was raised before any parameter changed."""
    ROLLED_BACK = "rolled_back"
    """The last good snapshot was restored; training goes on."""
    PAUSED = "paused"
    """The bundle was written, then ``NonFiniteError`` raised."""
    LOGGED = "logged"
    """Reported only: the update was applied (an early warning, a data incident whose cleaned batch trained)."""


ACTIONS: tuple[str, ...] = tuple(a.value for a in Action)
STOPPING_ACTIONS: tuple[Action, ...] = (Action.RAISED, Action.PAUSED)
"""Actions after which the guard raises ``NonFiniteError``."""
BLOCKING_ACTIONS: tuple[Action, ...] = (Action.SKIPPED, Action.RAISED, Action.ROLLED_BACK, Action.PAUSED)
"""Actions under which the step's update does not land."""


class Policy(StrEnum):
    """``on_anomaly``: what the guard does about an incident (``watch(..., on_anomaly=...)``)."""

    SKIP = "skip"
    """Drop the update and go on (escalating along the ladder when skips repeat)."""
    RAISE = "raise"
    """Raise ``NonFiniteError`` before any change."""
    ROLLBACK = "rollback"
    """Restore the last good snapshot and go on."""
    PAUSE = "pause"
    """Write the incident bundle, then raise."""


POLICIES: tuple[str, ...] = tuple(p.value for p in Policy)

# ---------------------------------------------------------------- the data layer's findings (nantrace.data)
BATCH_CAUSES: tuple[str, ...] = (
    "nonfinite_input", "label_out_of_range", "shape_mismatch", "dtype_mismatch", "degenerate_normalisation",
    "distribution_shift",
)
"""Cause codes a batch check can report."""

MASK_CAUSES: tuple[str, ...] = ("padding_mask_mismatch", "not_causal", "cross_sample_attention", "fully_masked_row")
"""Cause codes an attention-mask check can report (plus ``nonfinite_input`` for a NaN mask)."""

SAMPLER_CAUSES: tuple[str, ...] = (
    "sampler_duplicate", "sampler_gap", "sampler_imbalance", "sampler_out_of_range", "sampler_config",
)
"""Cause codes ``audit_sampler`` can report."""

SEED_CAUSES: tuple[str, ...] = (
    "nondeterministic_augmentation", "global_rng_use", "shared_random_stream", "sample_mutated",
)
"""Cause codes ``audit_augmentation`` can report."""

DATA_INCIDENT_CAUSES: tuple[str, ...] = ("nonfinite_input", "label_out_of_range")
"""Data-layer causes that are also incident causes: a watched ``ValidatingCollate`` reports them
to the guard (kind ``nonfinite_input``, phase ``data``); they are judged per sample."""
