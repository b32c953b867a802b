"""nantrace's diagnosis against the independent cause oracle (issue 9, item 5).

Every case of tests/cause_matrix.py is trained under ``nantrace.watch`` exactly as
tests/scenarios.py ``run()`` does (cases whose origin is in the loss function twice: with
``guard.replayable(loss_fn)`` and zero-intrusive), and its incident's (phase, op, module,
cause, source line, and the step) must equal the verdict of tests/cause_oracle.py on the same program.
The oracle itself is checked against hand-computed expectations: on every matrix case (the
family's expectation), on ~20 cases spelled out in full below, and on the hand-written
scenarios of tests/scenarios.py.

Run alone::

    PYTHONPATH=/work/main/src python -m pytest -q -m cause_matrix tests/test_cause_matrix.py
    PYTHONPATH=/work/main/src python tests/test_cause_matrix.py   # writes /tmp/oracle_report.txt

Every run of the agreement tests rewrites ``/tmp/oracle_report.txt`` (or ``$ORACLE_REPORT``):
one line per disagreement and the totals per variant.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cause_matrix  # noqa: E402
import cause_oracle  # noqa: E402
from cause_matrix import CASES, FAIL_STEP, origin_line  # noqa: E402

pytestmark = pytest.mark.cause_matrix

REPORT = os.environ.get("ORACLE_REPORT", "/tmp/oracle_report.txt")
VARIANTS = ("module", "loss-replayable", "loss-zero-intrusive")


def _variants(case: cause_matrix.Case) -> tuple[str, ...]:
    return ("module",) if case.place == "module" else ("loss-replayable", "loss-zero-intrusive")


RUNS = [(name, v) for name, case in CASES.items() for v in _variants(case)]


# ------------------------------------------------------------------ the two verdicts
def _where(source: str | None) -> str | None:
    """``file.py:LINE`` (the basename), for comparing and printing sources."""
    if source is None:
        return None
    path, _, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}"


Key = tuple[Any, ...]   # (phase, op, module, cause, source)


@functools.lru_cache(maxsize=None)
def oracle_verdict(name: str) -> Key | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        v = cause_oracle.decide(cause_matrix.build(CASES[name]))
    return None if v is None else (v.step, v.phase, v.op, v.module, v.cause, _where(v.source))


def _nantrace_run(name: str, variant: str) -> Key | None:
    import nantrace

    program = cause_matrix.build(CASES[name])
    guard = nantrace.watch(program.model, program.optimizer, config=nantrace.Config(print_incidents=False))
    loss_fn = guard.replayable(program.loss_fn) if variant == "loss-replayable" else program.loss_fn
    try:
        with warnings.catch_warnings(), guard:   # the guard sees an exception that ends the loop (__exit__)
            warnings.simplefilter("ignore")
            for batch in program.batches:
                program.optimizer.zero_grad()
                loss = loss_fn(program.model, batch)
                loss.backward()
                program.optimizer.step()
    except nantrace.NonFiniteError:
        pass
    except Exception:   # noqa: BLE001 - the step raised (a bad value reached a validating op): the loop stops
        pass
    finally:
        guard.close()
    main = [i for i in guard.incidents if i.action != "logged"]
    if not main:
        return None
    inc = main[0]
    if "localisation_error" in inc.details:  # localisation must never fail, silently or not
        LOCALISATION_ERRORS.append(f"{name} [{variant}]: {inc.details['localisation_error']}")
    return (inc.step, inc.phase, inc.op, inc.module, inc.cause, _where(inc.source))


RESULTS: dict[tuple[str, str], tuple[Key | None, Key | None, float]] = {}
LOCALISATION_ERRORS: list[str] = []


def compare(name: str, variant: str) -> tuple[Key | None, Key | None]:
    if (name, variant) not in RESULTS:
        want = oracle_verdict(name)
        start = time.perf_counter()
        try:
            got = _nantrace_run(name, variant)
        except Exception as exc:  # noqa: BLE001 - a crash of the guard is a disagreement, reported
            got = ("crash", type(exc).__name__, str(exc)[:80])
        RESULTS[(name, variant)] = (want, got, time.perf_counter() - start)
    want, got, _ = RESULTS[(name, variant)]
    return want, got


def _fmt(key: Key | None) -> str:
    if key is None:
        return "no incident"
    if key[0] == "crash":
        return f"crash {key[1]}: {key[2]}"
    step, phase, op, module, cause, source = key
    return f"{cause} {op} module={module!r} phase={phase} step={step} {source}"


def _fields(key: Key | None) -> Key | None:
    """The compared fields: step, phase, op, module, cause, source."""
    return None if key is None or key[0] == "crash" else key


def write_report(path: str = REPORT) -> str:
    lines, totals = [], {v: [0, 0] for v in VARIANTS}
    for (name, variant), (want, got, _) in sorted(RESULTS.items()):
        totals[variant][1] += 1
        if _fields(want) == _fields(got) and want is not None:
            totals[variant][0] += 1
        else:
            lines.append(f"{name} [{variant}] | oracle: {_fmt(want)} | nantrace: {_fmt(got)}")
    agree = sum(a for a, _ in totals.values())
    total = sum(n for _, n in totals.values())
    head = [f"cause oracle vs nantrace: {agree}/{total} runs agree on (step, phase, op, module, cause, source)",
            f"written {time.strftime('%Y-%m-%d %H:%M:%S')}; nantrace from {_nantrace_path()}",
            "per variant: " + ", ".join(f"{v} {a}/{n}" for v, (a, n) in totals.items()),
            "command: .venv/bin/python tests/test_cause_matrix.py",
            f"disagreements ({len(lines)}):", ""]
    text = "\n".join(head + lines) + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text


def _nantrace_path() -> str:
    try:
        import nantrace
        return os.path.dirname(nantrace.__file__)
    except Exception:  # noqa: BLE001
        return "?"


@pytest.fixture(scope="module", autouse=True)
def _report_at_end():
    yield
    if RESULTS:
        write_report()


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- nantrace == oracle
@pytest.mark.parametrize("name,variant", RUNS, ids=[f"{n}[{v}]" for n, v in RUNS])
def test_nantrace_agrees_with_oracle(name: str, variant: str) -> None:
    errors = len(LOCALISATION_ERRORS)
    want, got = compare(name, variant)
    assert len(LOCALISATION_ERRORS) == errors, LOCALISATION_ERRORS[-1]
    assert want is not None, "the oracle found no failure: the case is broken"
    assert _fields(got) == _fields(want), f"\n oracle:   {_fmt(want)}\n nantrace: {_fmt(got)}"


# ------------------------------------------------------------ the matrix's own shape
def test_matrix_size_and_dimensions() -> None:
    cases = list(CASES.values())
    assert len(cases) >= 150
    assert {c.dtype for c in cases} == {torch.float32, torch.float16, torch.bfloat16}
    assert {c.place for c in cases} == {"module", "loss"}
    assert {c.phase for c in cases} >= {"forward", "backward"}
    assert 10 <= sum(c.compiled for c in cases) <= 15
    assert {c.model_cls for c in cases} == set(cause_matrix.MODELS)
    needed = {"log_nonpositive", "div_by_zero", "sqrt_negative", "exp_overflow", "overflow", "precision_overflow",
              "domain_error", "masked_softmax_all", "inf_arithmetic", "zero_variance_norm", "where_gradient_trap",
              "grad_singularity", "label_out_of_range"}
    assert needed <= {c.cause for c in cases}


def test_origin_tags_resolve() -> None:
    for fam in cause_matrix.FAMILIES.values():
        assert f"<origin:{fam.tag}>" in open(cause_matrix.__file__, encoding="utf-8").read().splitlines()[origin_line(fam.tag) - 1]


# ------------------------------------------------------- the oracle, checked by hand
@pytest.mark.parametrize("name", list(CASES))
def test_oracle_matches_family_expectation(name: str) -> None:
    """Each case fails at FAIL_STEP, at its tagged line, with the op, module, phase and cause
    computed by hand for its family and dtype (tests/cause_matrix.py)."""
    case = CASES[name]
    want = (FAIL_STEP, case.phase, case.op, case.module, case.cause, f"cause_matrix.py:{origin_line(case.family.tag)}")
    assert oracle_verdict(name) == want


# Twenty cases spelled out in full, each with the arithmetic that decides it.
HAND = {
    # log(0) = -inf: the argument is 0 <= 0
    "log.float32.module": ("forward", "aten.log.default", "block.op", "log_nonpositive"),
    # lgamma(0) = +inf, a pole at a non-positive integer
    "lgamma.bfloat16.loss": ("forward", "aten.lgamma.default", None, "log_nonpositive"),
    # (h > 0).sum() of a zero row is 0: 0 / 0
    "div_count.float32.loss": ("forward", "aten.div.Tensor", None, "div_by_zero"),
    # RMSNorm without eps of a zero row: rsqrt(0) = inf, then 0 * inf in mul: the inf was computed, rsqrt is the origin
    "rms_manual.float32.module": ("forward", "aten.rsqrt.default", "layers.0.op", "zero_variance_norm"),
    # sqrt(-2) = NaN
    "sqrt.float16.module": ("forward", "aten.sqrt.default", "layers.0.op", "sqrt_negative"),
    # exp(100) = 2.7e43 > 3.4e38 (float32 max)
    "exp.float32.loss": ("forward", "aten.exp.default", None, "exp_overflow"),
    # exp(12) = 162755 > 65504 in float16, finite in float32
    "exp.float16.loss": ("forward", "aten.exp.default", None, "precision_overflow"),
    # e / e.sum(): inf / inf is NaN, but the inf was made by exp(100): exp is the origin
    "naive_softmax.float32.module": ("forward", "aten.exp.default", "layers.0.op", "exp_overflow"),
    # acos(1.5): outside [-1, 1]
    "acos.float32.module": ("forward", "aten.acos.default", "latent", "domain_error"),
    # 1e20 * 1e20 = 1e40 > 3.4e38, not an exponent
    "mul_overflow.float32.module": ("forward", "aten.mul.Tensor", "latent", "overflow"),
    # float16 300 * 300 = 90000 > 65504, finite in float32
    "mul_overflow.float16.loss": ("forward", "aten.mul.Tensor", None, "precision_overflow"),
    # LayerNorm(eps=0) of a constant row: variance 0, 0 / sqrt(0)
    "layer_norm_eps0.float32.module": ("forward", "aten.native_layer_norm.default", "block.op", "zero_variance_norm"),
    # LayerNorm of ~1e26: the variance ~1e50 exceeds float32, eps=1e-5 and the row is anything but constant
    "layer_norm_huge.float32.module": ("forward", "aten.native_layer_norm.default", "layers.0.op", "overflow"),
    # std over one sample (correction 1): 0 / 0
    "std_one_sample.float32.loss": ("forward", "aten.std.correction", None, "zero_variance_norm"),
    # a row masked entirely with -inf (an explicit constant): softmax is NaN, the mask is intentional
    "masked_softmax.float32.module": ("forward", "aten._softmax.default", "latent", "masked_softmax_all"),
    # mask * -inf: 0 * -inf = NaN at every unmasked position
    "mask_times_inf.bfloat16.loss": ("forward", "aten.mul.Tensor", None, "inf_arithmetic"),
    # where(h > 0, sqrt(h), 0) at h = -1: sqrt's NaN is not selected, its gradient is NaN
    "where_sqrt.float32.module": ("forward", "aten.sqrt.default", "latent", "where_gradient_trap"),
    # sqrt(sum((a - a)^2)) = 0: d sqrt / dx = 1 / (2 sqrt(0)) = inf
    "pair_distance.float32.loss": ("backward", "aten.sqrt.default", None, "grad_singularity"),
    # acos(tanh(100)) = acos(1.0): d acos / dx = -1 / sqrt(1 - 1) = -inf
    "acos_tanh.float16.module": ("backward", "aten.acos.default", "layers.0.op", "grad_singularity"),
    # weights [0, 0, 1, 1], targets {0, 1}: total weight 0, 0 / 0 with every label valid
    "ce_zero_weight.float32.loss": ("forward", "aten.nll_loss_forward.default", None, "div_by_zero"),
    # a 4-label target of repeats needs 7 frames, there are 4: the CTC loss is inf
    "ctc.float32.module": ("forward", "aten._ctc_loss.Tensor", "latent", "domain_error"),
    # Gram matrix [[a, 0], [0, 0]]: not positive-definite, linalg.cholesky raises
    "cholesky.float32.loss": ("forward", "aten.linalg_cholesky_ex.default", None, "domain_error"),
}


@pytest.mark.parametrize("name", list(HAND))
def test_oracle_hand_computed(name: str) -> None:
    assert name in CASES
    verdict = oracle_verdict(name)
    assert verdict is not None and verdict[1:5] == HAND[name]


# --------------------------------------------------- the oracle on the hand-written scenarios
def _scenarios() -> Any:
    import scenarios   # imports nantrace (for its run()); the oracle itself does not
    return scenarios


# Without guard.replayable nantrace cannot see into the loss function; the oracle always can, so
# these are compared with the expectation of their replayable twin.
TWIN = {"cross_entropy_all_ignored_zero_intrusive": "cross_entropy_all_ignored_in_loss_fn",
        "rmse_loss_at_perfect_fit_zero_intrusive": "rmse_loss_at_perfect_fit"}
NOT_ORACLE = {
    "transient_fault_not_reproduced": "a transient fault needs a re-run of the step; the oracle runs it once",
    "checkpoint_with_nan_loaded_mid_run": "a parameter corrupted between steps: the oracle watches ops, not the user's loads",
}
OPTIMIZER_PHASE = "the optimizer's update: checked against its own float64 replay in tests/test_optimizer_phase.py"


def _scenario_names() -> list[str]:
    try:
        return list(_scenarios().SCENARIOS)
    except ImportError:
        return []


@pytest.mark.parametrize("name", _scenario_names())
def test_oracle_agrees_with_hand_written_scenarios(name: str) -> None:
    if name in NOT_ORACLE:
        pytest.skip(NOT_ORACLE[name])
    scenarios = _scenarios()
    scn = scenarios.SCENARIOS[name]
    expected = scenarios.SCENARIOS[TWIN.get(name, name)].expected
    if expected is not None and expected.phase == "optimizer":
        pytest.skip(OPTIMIZER_PHASE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verdict = cause_oracle.decide(scenarios.build(scn))
    if expected is None:
        assert verdict is None, verdict
        return
    assert verdict is not None
    got = (verdict.step, verdict.phase, verdict.op, verdict.module, verdict.cause)
    assert got == (expected.step, expected.phase, expected.op, expected.module, expected.cause), verdict.evidence
    if expected.origin is not None:
        assert _where(verdict.source) == f"scenarios.py:{scenarios.origin_line(expected.origin)}"


def test_oracle_imports_nothing_from_nantrace() -> None:
    text = open(cause_oracle.__file__, encoding="utf-8").read()
    assert "import nantrace" not in text and "from nantrace" not in text


# ------------------------------------------------------------------ standalone report
def main() -> None:
    torch.set_num_threads(1)
    start = time.perf_counter()
    for name, variant in RUNS:
        compare(name, variant)
    text = write_report()
    print(text)
    print(f"{len(RUNS)} runs of {len(CASES)} cases in {time.perf_counter() - start:.1f}s; report: {REPORT}")


if __name__ == "__main__":
    main()
