"""The facts a rank publishes in the step's one read decide, on every rank, the same kind as
that rank's own triage (nantrace.distributed.StepRound)."""

from __future__ import annotations

import math

import pytest

from nantrace.detection.spikes import RobustSpikeDetector
from nantrace.diagnosis.triage import triage
from nantrace.distributed import (GRAD_SPIKE, GRADS_BAD, INPUTS_BAD, LOSS_BAD, LOSS_SPIKE, OUTPUTS_BAD, PARAMS_BAD,
                                  _facts_health, _Verdict)


@pytest.mark.parametrize("word, kind", [
    (0, None), (INPUTS_BAD, "nonfinite_input"), (LOSS_BAD, "nonfinite_loss"), (OUTPUTS_BAD, "nonfinite_activation"),
    (GRADS_BAD, "nonfinite_grad"), (PARAMS_BAD, "nonfinite_param"), (LOSS_SPIKE, "loss_spike"),
    (GRAD_SPIKE, "grad_explosion"), (LOSS_SPIKE | GRAD_SPIKE, "loss_spike"), (INPUTS_BAD | LOSS_BAD, "nonfinite_input"),
    (PARAMS_BAD | INPUTS_BAD, "nonfinite_param"),
])
def test_facts_give_the_kind_of_the_rank_that_published_them(word, kind):
    finding = triage(_facts_health(word), step=5, scaler_active=False, loss_spikes=_Verdict(bool(word & LOSS_SPIKE)),
                     grad_spikes=_Verdict(bool(word & GRAD_SPIKE)), last_applied=None)
    assert (finding.kind if finding else None) == kind


def test_a_detector_flags_exactly_the_values_above_its_published_threshold():
    det = RobustSpikeDetector(window=64, warmup=32, sigma=6.0, min_ratio=1.5)
    assert det.threshold() == math.inf
    for i in range(40):
        assert det.update(1.0 + 0.01 * math.sin(i)) is None
    for value in (1.2, 1.49, 1.6, 3.0, 100.0, -5.0):
        threshold = det.threshold()
        spike = det.update(value)
        assert (spike is not None) == (value > threshold), (value, threshold)
        assert spike is None or spike.ratio > 1.5
