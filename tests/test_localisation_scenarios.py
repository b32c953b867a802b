"""The scenario suite (issue 3): every failure pattern of tests/scenarios.py trained under
``nantrace.watch`` must give its exact diagnosis: step, kind, phase, ATen op, module path,
source line, cause, action and transient verdict, with the parameters left untouched by the
step that was blocked."""

from __future__ import annotations

import os

import pytest
import torch

import scenarios
from nantrace.incident import CAUSES
from scenarios import FAIL_STEP, SCENARIOS, STEPS, origin_line, outcome, run

FAILING = [n for n, s in SCENARIOS.items() if s.expected is not None]
HEALTHY = [n for n, s in SCENARIOS.items() if s.expected is None]
EPS_WARNED = {"adam_eps0_update_makes_nan", "fp16_adam_eps_underflow"}


def _source_line(source: str) -> int:
    path, _, line = source.rpartition(":")
    assert os.path.samefile(path, scenarios.__file__), f"{source} is not in {scenarios.__file__}"
    return int(line)


@pytest.mark.parametrize("name", FAILING)
def test_scenario_diagnosis(name: str) -> None:
    scn = SCENARIOS[name]
    exp = scn.expected
    assert exp is not None
    out = outcome(name)
    # Early warnings of the dynamics layer are "logged" incidents; only the Adam stories with an eps the
    # state's dtype cannot hold have one, raised at step 0, before the update that turns the weights non-finite.
    early = [(i.step, i.cause) for i in out.incidents if i.action == "logged"]
    assert early == ([(0, "optimizer_state")] if name in EPS_WARNED else []), early
    main = [i for i in out.incidents if i.action != "logged"]
    assert len(main) == 1, [f"step {i.step}: {i.kind}/{i.cause} {i.summary}" for i in out.incidents]
    inc = main[0]
    assert "localisation_error" not in inc.details, inc.details["localisation_error"]

    got = dict(step=inc.step, kind=inc.kind, phase=inc.phase, op=inc.op, module=inc.module, cause=inc.cause,
               action=inc.action, transient=inc.transient)
    want = dict(step=exp.step, kind=exp.kind, phase=exp.phase, op=exp.op, module=exp.module, cause=exp.cause,
                action=exp.action, transient=exp.transient)
    assert got == want, inc.summary
    if exp.origin is None:
        assert inc.source is None
    else:
        assert inc.source is not None
        assert _source_line(inc.source) == origin_line(exp.origin), f"{inc.source} is not the '# <origin:{exp.origin}>' line"
    for key, value in exp.details:
        assert inc.details.get(key) == value, (key, inc.details.get(key))

    # The blocked step left every parameter as it was; a skipped step lets training go on.
    blocked = {k: v for k, v in out.unchanged.items() if k not in {step for step, _ in early}}  # warnings only log
    assert blocked and all(blocked.values()), out.unchanged
    if exp.action == "skipped":
        assert out.raised is None and out.steps_run == STEPS
    else:
        assert out.raised is not None and out.raised.incident is inc

    # A diagnosis is a sentence and a fix, with its evidence when an op was named.
    assert inc.summary and inc.fix and "{" not in inc.summary + inc.fix
    if inc.op is not None:
        assert inc.input_stats, "no statistics of the origin op's inputs"
        assert inc.chain and any(item.get("origin") for item in inc.chain)


REPLAYABLE = [n for n in FAILING if SCENARIOS[n].replayable]


@pytest.mark.parametrize("name", REPLAYABLE)
def test_zero_intrusive_gives_the_same_diagnosis(name: str) -> None:
    """Without ``guard.replayable`` the loss tape replays the loss code: the same op, module,
    source line, phase and cause as with it (issue 11)."""
    exp = SCENARIOS[name].expected
    assert exp is not None
    out = run(SCENARIOS[name], replayable=False)
    main = [i for i in out.incidents if i.action != "logged"]
    assert len(main) == 1, [f"step {i.step}: {i.kind}/{i.cause} {i.summary}" for i in out.incidents]
    inc = main[0]
    assert "localisation_error" not in inc.details, inc.details["localisation_error"]
    got = (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action)
    assert got == (exp.step, exp.kind, exp.phase, exp.op, exp.module, exp.cause, exp.action), inc.summary
    if exp.origin is None:
        assert inc.source is None
    else:
        assert inc.source is not None and _source_line(inc.source) == origin_line(exp.origin)
    assert all(out.unchanged.values())


@pytest.mark.parametrize("name", [n for n in REPLAYABLE if SCENARIOS[n].expected.op is not None])
def test_a_zero_intrusive_bundle_replays_the_loss_code_to_the_same_diagnosis(name: str, tmp_path) -> None:
    """The loss tape travels in the bundle: ``nantrace replay`` re-runs the loss code anywhere."""
    import nantrace

    out = run(SCENARIOS[name], replayable=False, run_dir=tmp_path / "run")
    [inc] = [i for i in out.incidents if i.action != "logged"]
    assert inc.bundle is not None and "bundle_tape" not in inc.details, inc.details.get("bundle_tape")
    model = scenarios.build(SCENARIOS[name]).model
    again = nantrace.replay(inc.bundle, model=getattr(model, "_orig_mod", model))
    assert "localisation_error" not in again.details, again.details["localisation_error"]
    assert (again.op, again.module, again.phase, again.cause, again.source) == (
        inc.op, inc.module, inc.phase, inc.cause, inc.source), again.summary


@pytest.mark.parametrize("name", HEALTHY)
def test_legitimate_masks_are_never_reported(name: str) -> None:
    out = outcome(name)
    assert out.incidents == [] and out.raised is None and out.steps_run == STEPS


@pytest.mark.parametrize("name", ["fully_masked_attention_row", "sqrt_distance_of_identical_pair", "rmse_loss_at_perfect_fit"])
def test_raise_policy_gives_the_same_diagnosis_before_any_change(name: str) -> None:
    exp = SCENARIOS[name].expected
    out = run(SCENARIOS[name], on_anomaly="raise")
    assert out.raised is not None and out.steps_run == FAIL_STEP + 1
    inc = out.raised.incident
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        exp.step, exp.kind, exp.phase, exp.op, exp.module, exp.cause, "raised")
    assert out.unchanged == {FAIL_STEP: True}


# ------------------------------------------------------------- the suite's own coverage
def test_suite_is_large_enough() -> None:
    assert len(FAILING) >= 30


# The diagnosis codes of the public contract (API.md); the dynamics layer adds its own.
CONTRACT_CAUSES = (
    "nonfinite_input", "label_out_of_range", "nonfinite_param", "log_nonpositive", "div_by_zero", "sqrt_negative",
    "grad_singularity", "exp_overflow", "precision_overflow", "masked_softmax_all", "inf_arithmetic",
    "zero_variance_norm", "where_gradient_trap", "gradient_explosion", "loss_divergence", "scaler_collapse",
    "optimizer_state", "unknown",
)


def test_every_cause_code_is_exercised() -> None:
    assert set(CONTRACT_CAUSES) <= set(CAUSES)
    covered = {s.expected.cause for s in SCENARIOS.values() if s.expected is not None}
    finite_only = {"loss_divergence", "scaler_collapse"}  # finite anomalies, tested with the detectors
    assert set(CONTRACT_CAUSES) - finite_only - covered == set()


def test_suite_covers_every_variant() -> None:
    exps = [s.expected for s in SCENARIOS.values() if s.expected is not None]
    localised = [s for s in SCENARIOS.values() if s.expected is not None and s.expected.op is not None]
    assert {e.phase for e in exps} >= {"data", "forward", "backward", "optimizer"}
    assert {e.phase for e in exps if e.op is not None} >= {"forward", "backward"}
    assert any(e.module is None for e in exps if e.op is not None), "an origin in the loss function"
    assert any(e.module == "" for e in exps if e.op is not None), "an origin in the root module"
    assert any("." in (e.module or "") for e in exps), "an origin in a nested module"
    assert {s.replayable for s in localised} == {True, False}, "with and without guard.replayable"
    assert {e.step for e in exps if e.step != FAIL_STEP} <= {0, 2}  # nonfinite_param / optimizer_state only
    assert any(e.transient for e in exps)
    setups = {n: scenarios.build(SCENARIOS[n]) for n in FAILING if "compiled" in n or "autocast" in n or "fp16" in n}
    assert any(hasattr(s.model, "_orig_mod") for s in setups.values()), "a torch.compile'd model"
    assert {s.autocast for s in setups.values()} >= {torch.float16, torch.bfloat16}, "CPU autocast in both dtypes"
    assert any(s.scaler is not None for s in setups.values()), "a GradScaler"
    assert any(p.dtype == torch.float16 for s in setups.values() for p in s.model.parameters()), "a float16 model"
    assert HEALTHY, "a legitimate -inf mask that must not be reported"


def test_origin_tags_resolve() -> None:
    with open(scenarios.__file__, encoding="utf-8") as f:
        text = f.read()
    tags = {s.expected.origin for s in SCENARIOS.values() if s.expected is not None and s.expected.origin}
    for tag in tags:
        line = origin_line(tag)
        assert f"<origin:{tag}>" in text.splitlines()[line - 1]
    with pytest.raises(LookupError):
        origin_line("no-such-tag")
