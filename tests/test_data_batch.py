"""Batch validation and the validating collate (nantrace.data.batch / nantrace.data.collate)."""

from __future__ import annotations

import json
import pickle
import time

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Dataset, default_collate

from nantrace.data import (
    BatchSchema,
    DataIssue,
    DataValidationError,
    ValidatingCollate,
    validate_batch,
)

NAN, INF = float("nan"), float("inf")


def _images(b: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, 3, 4, 4, generator=torch.Generator().manual_seed(seed))


def _with(t: torch.Tensor, index: tuple, value: float) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


# --------------------------------------------------------------------------- validate_batch


NONFINITE_CASES = [
    pytest.param({"pixel_values": _with(_images(), (3, 0, 1, 1), NAN), "labels": torch.arange(8) % 5},
                 'batch["pixel_values"]', [3], {"3": "NaN"}, id="dict-nan"),
    pytest.param((_with(_with(_images(), (1, 2, 0, 0), INF), (4, 0, 3, 3), INF), torch.arange(8) % 5),
                 "batch[0]", [1, 4], {"1": "+Inf", "4": "+Inf"}, id="tuple-inf"),
    pytest.param({"inputs": [_images(), _with(_images(seed=1), (0, 0, 0, 0), -INF)]},
                 'batch["inputs"][1]', [0], {"0": "-Inf"}, id="nested-neginf"),
    pytest.param(_with(torch.randn(6, 5), (5, 4), NAN), "batch", [5], {"5": "NaN"}, id="bare-tensor"),
    pytest.param({"x": _with(torch.randn(4, 3, dtype=torch.float16), (2, 1), INF)},
                 'batch["x"]', [2], {"2": "+Inf"}, id="fp16"),
    pytest.param({"x": _with(torch.randn(4, 3, dtype=torch.bfloat16), (0, 0), NAN)},
                 'batch["x"]', [0], {"0": "NaN"}, id="bf16"),
    pytest.param({"x": _with(torch.randn(4, 3, dtype=torch.float64), (1, 2), NAN)},
                 'batch["x"]', [1], {"1": "NaN"}, id="fp64"),
    pytest.param({"x": np.where(np.arange(12).reshape(4, 3) == 7, np.nan, 1.0).astype(np.float32) * np.arange(3)},
                 'batch["x"]', [2], {"2": "NaN"}, id="numpy"),
    pytest.param({"labels": _with(torch.rand(4, 2), (3, 1), NAN)}, 'batch["labels"]', [3], {"3": "NaN"},
                 id="float-labels"),
]


@pytest.mark.parametrize("batch, path, indices, kinds", NONFINITE_CASES)
def test_nonfinite_input_is_located(batch, path, indices, kinds):
    report = validate_batch(batch)
    assert report.causes == ["nonfinite_input"]
    issue = report.issues[0]
    assert issue.path == path
    assert issue.sample_indices == indices
    assert issue.details["values"] == kinds
    assert report.bad_sample_indices == indices
    for kind in set(kinds.values()):
        assert kind in issue.summary
    assert path in issue.summary


LABEL_CASES = [
    pytest.param({"x": torch.randn(6, 2), "labels": torch.tensor([0, 1, 10, 3, 4, 11])}, 10,
                 'batch["labels"]', [2, 5], (0, 11), id="too-large"),
    pytest.param({"x": torch.randn(4, 2), "label": torch.tensor([0, -1, 2, 3])}, 10,
                 'batch["label"]', [1], (-1, 3), id="negative-not-ignore"),
    pytest.param({"x": torch.randn(4, 2), "target": torch.tensor([0, -5, 2, 3])}, None,
                 'batch["target"]', [1], (-5, 3), id="negative-without-num-classes"),
    pytest.param((torch.randn(4, 2), torch.tensor([3, 3, 1, 0])), 3, "batch[1]", [0, 1], (0, 3),
                 id="tuple-last-element"),
    pytest.param({"input_ids": torch.randint(0, 50, (3, 5)),
                  "labels": torch.tensor([[-100, 1, 2, 3, -100], [-100, -100, 4, 60, 1], [0, 0, 0, 0, -100]])},
                 50, 'batch["labels"]', [1], (0, 60), id="token-labels"),
    pytest.param({"x": torch.randn(2, 2), "targets": {"cls": torch.tensor([1, 7])}}, 5,
                 'batch["targets"]["cls"]', [1], (1, 7), id="nested-under-label-key"),
]


@pytest.mark.parametrize("batch, num_classes, path, indices, span", LABEL_CASES)
def test_label_out_of_range(batch, num_classes, path, indices, span):
    report = validate_batch(batch, num_classes=num_classes)
    assert report.causes == ["label_out_of_range"]
    issue = report.issues[0]
    assert (issue.path, issue.sample_indices) == (path, indices)
    assert (issue.details["min"], issue.details["max"]) == span
    assert issue.details["kind"] == "out_of_range"
    assert f"{span[0]}..{span[1]}" in issue.summary


def test_all_labels_ignored_is_reported():
    batch = {"input_ids": torch.ones(3, 4, dtype=torch.long), "labels": torch.full((3, 4), -100)}
    report = validate_batch(batch, num_classes=10)
    assert report.causes == ["label_out_of_range"]
    issue = report.issues[0]
    assert issue.details["kind"] == "all_ignored"
    assert issue.sample_indices == [0, 1, 2]
    assert "0/0 = NaN" in issue.summary
    # a custom ignore index counts too; with ignore_index=None nothing is "ignored"
    assert validate_batch({"labels": torch.full((2,), 7)}, ignore_index=7).issues[0].details["kind"] == "all_ignored"
    assert validate_batch({"labels": torch.full((2,), 7)}, ignore_index=None).ok


def test_custom_label_keys():
    batch = {"x": torch.randn(3, 2), "cls": torch.tensor([0, 1, 9]), "labels": torch.tensor([0, 1, 9])}
    report = validate_batch(batch, num_classes=3, label_keys=("cls",))
    assert [(i.cause, i.path, i.sample_indices) for i in report.issues] == [
        ("label_out_of_range", 'batch["cls"]', [2])]


HEALTHY = [
    pytest.param({"pixel_values": _images(16), "labels": torch.arange(16) % 10}, 10, id="images"),
    pytest.param({"input_ids": torch.randint(0, 100, (4, 12)), "attention_mask": torch.ones(4, 12),
                  "labels": torch.where(torch.rand(4, 12) < 0.3, -100, torch.randint(0, 100, (4, 12)))},
                 100, id="tokens-float-mask"),
    pytest.param((torch.rand(8, 5) * 255, torch.randint(0, 3, (8,))), 3, id="raw-pixels-0-255"),
    pytest.param({"x": torch.randn(8, 4), "y": torch.zeros(8), "meta": ["a"] * 8, "id": torch.arange(8)},
                 None, id="constant-float-target-and-strings"),
    pytest.param([torch.randn(5, 2), torch.randn(5, 2), torch.randint(0, 2, (5,))], 2, id="list"),
    pytest.param({"x": torch.randn(1, 3), "labels": torch.tensor(1)}, 2, id="scalar-label"),
    pytest.param({"x": torch.zeros(0, 3), "labels": torch.zeros(0, dtype=torch.long)}, 2, id="empty"),
]


@pytest.mark.parametrize("batch, num_classes", HEALTHY)
def test_healthy_batches_have_no_issue(batch, num_classes):
    report = validate_batch(batch, num_classes=num_classes, reference=BatchSchema())
    assert report.ok, str(report)
    assert report.issues == []


DEGENERATE = [
    pytest.param({"x": torch.full((4, 6), 0.5)}, "constant", [], id="constant"),
    pytest.param({"x": 1e6 + 1e-4 * torch.randn(4, 6, dtype=torch.float64)}, "tiny_spread", [], id="tiny-spread-fp64"),
    pytest.param({"x": 1e6 + torch.randint(0, 3, (4, 6)).float() * 0.0625}, "tiny_spread", [], id="tiny-spread-fp32"),
    pytest.param({"x": torch.cat([torch.randn(3, 6), torch.randn(1, 6) * 3e4])}, "large_range", [3],
                 id="one-unnormalised-sample"),
    pytest.param({"x": torch.arange(4.0)[:, None].expand(4, 6) * 5000}, "large_range", [0, 3],
                 id="spread-between-samples"),
]


@pytest.mark.parametrize("batch, kind, indices", DEGENERATE)
def test_degenerate_normalisation(batch, kind, indices):
    report = validate_batch(batch)
    assert report.causes == ["degenerate_normalisation"]
    issue = report.issues[0]
    assert (issue.path, issue.details["kind"], issue.sample_indices) == ('batch["x"]', kind, indices)
    assert issue.severity == "warning"
    assert report.bad_sample_indices == []  # not a per-sample cause


def test_stats_can_be_switched_off():
    assert validate_batch({"x": torch.full((4, 6), 0.5)}, stats=False).ok
    report = validate_batch({"x": _with(torch.full((4, 6), 0.5), (2, 1), NAN)}, stats=False)
    assert [(i.cause, i.sample_indices) for i in report.issues] == [("nonfinite_input", [2])]


def test_degenerate_thresholds_are_configurable():
    assert validate_batch({"x": torch.rand(4, 6) * 3e4}, max_range=1e5).ok
    assert not validate_batch({"x": torch.rand(4, 6) * 300}, max_range=100).ok
    # float masks are legitimately constant; the key filter can be changed
    assert validate_batch({"attention_mask": torch.ones(2, 3)}).ok
    assert validate_batch({"attention_mask": torch.ones(2, 3)}, skip_stats_keys=()).causes == ["degenerate_normalisation"]


SCHEMA_CASES = [
    pytest.param({"x": torch.randn(4, 3, 8, 8).double(), "labels": torch.zeros(4, dtype=torch.long)},
                 [("dtype_mismatch", 'batch["x"]')], id="dtype"),
    pytest.param({"x": torch.randn(4, 1, 8, 8), "labels": torch.zeros(4, dtype=torch.long)},
                 [("shape_mismatch", 'batch["x"]')], id="channels"),
    pytest.param({"x": torch.randn(4, 3, 8), "labels": torch.zeros(4, dtype=torch.long)},
                 [("shape_mismatch", 'batch["x"]')], id="ndim"),
    pytest.param({"x": torch.randn(4, 3, 8, 8)}, [("shape_mismatch", 'batch["labels"]')], id="missing-key"),
    pytest.param({"x": torch.randn(4, 3, 8, 8), "labels": torch.zeros(4, dtype=torch.long), "w": torch.rand(4)},
                 [("shape_mismatch", 'batch["w"]')], id="new-key"),
    pytest.param({"x": torch.randn(4, 3, 8, 8), "labels": torch.zeros(4, dtype=torch.int32)},
                 [("dtype_mismatch", 'batch["labels"]')], id="label-dtype"),
]


@pytest.mark.parametrize("second, expected", SCHEMA_CASES)
def test_schema_changes_are_reported(second, expected):
    schema = BatchSchema()
    first = {"x": torch.randn(8, 3, 8, 8), "labels": torch.zeros(8, dtype=torch.long)}
    assert validate_batch(first, reference=schema).ok
    assert validate_batch(first, reference=schema).ok  # same structure, other batch size is fine
    report = validate_batch(second, reference=schema)
    assert [(i.cause, i.path) for i in report.issues] == expected
    assert all(i.sample_indices == [] for i in report.issues)


def test_schema_variable_dims():
    schema = BatchSchema(variable_dims={'batch["input_ids"]': (1,)})
    assert validate_batch({"input_ids": torch.ones(2, 7, dtype=torch.long)}, reference=schema).ok
    assert validate_batch({"input_ids": torch.ones(5, 12, dtype=torch.long)}, reference=schema).ok
    everywhere = BatchSchema(variable_dims=(-1,))
    assert validate_batch({"a": torch.randn(2, 3, 7)}, reference=everywhere).ok
    assert validate_batch({"a": torch.randn(2, 3, 9)}, reference=everywhere).ok
    assert validate_batch({"a": torch.randn(2, 4, 9)}, reference=everywhere).causes == ["shape_mismatch"]


def test_distribution_shift_after_warmup():
    gen = torch.Generator().manual_seed(1)
    schema = BatchSchema(warmup=10, shift_sigma=6.0)
    for _ in range(10):
        assert validate_batch({"x": torch.randn(32, 16, generator=gen)}, reference=schema).ok
    report = validate_batch({"x": torch.randn(32, 16, generator=gen) * 255}, reference=schema)
    assert report.causes == ["distribution_shift"]
    issue = report.issues[0]
    assert issue.path == 'batch["x"]' and issue.details["z_std"] > 6 and issue.severity == "warning"
    # flagged batches do not move the reference; healthy ones still pass
    assert validate_batch({"x": torch.randn(32, 16, generator=gen)}, reference=schema).ok
    shifted = validate_batch({"x": torch.randn(32, 16, generator=gen) + 2.0}, reference=schema)
    assert shifted.causes == ["distribution_shift"] and shifted.issues[0].details["z_mean"] > 6
    # k is configurable
    lenient = BatchSchema(warmup=10, shift_sigma=1e6)
    for _ in range(10):
        validate_batch({"x": torch.randn(32, 16, generator=gen)}, reference=lenient)
    assert validate_batch({"x": torch.randn(32, 16, generator=gen) + 2.0}, reference=lenient).ok


def test_no_false_shift_on_a_long_noisy_run():
    gen = torch.Generator().manual_seed(7)
    schema = BatchSchema()
    scales = torch.linspace(0.8, 1.2, 300)
    for step in range(300):
        x = torch.randn(16, 3, 8, 8, generator=gen) * scales[step] + 0.1 * torch.randn(1, generator=gen)
        batch = {"pixel_values": x, "labels": torch.randint(0, 10, (16,), generator=gen)}
        report = validate_batch(batch, num_classes=10, reference=schema)
        assert report.ok, (step, str(report))


def test_no_early_flag_before_warmup_and_identical_batches():
    schema = BatchSchema(warmup=5)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    for _ in range(8):
        assert validate_batch({"x": x}, reference=schema).ok  # zero spread: floor keeps it sane
    assert validate_batch({"x": x * 1.001}, reference=schema).ok
    assert validate_batch({"x": x + 5}, reference=schema).causes == ["distribution_shift"]


class _CountSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.scalar_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.scalar_reads += 1
        return func(*args, **(kwargs or {}))


def test_checks_read_no_scalars_on_the_device():
    # The only device->host traffic is one stacked transfer per tensor; no .item()/bool().
    batch = {"pixel_values": _images(16), "labels": torch.arange(16) % 10,
             "input_ids": torch.randint(0, 9, (16, 5)), "attention_mask": torch.ones(16, 5)}
    schema = BatchSchema()
    with _CountSyncs() as mode:
        for _ in range(3):
            validate_batch(batch, num_classes=10, reference=schema)
    assert mode.scalar_reads == 0


def test_report_is_json_serialisable():
    batch = {"x": _with(torch.randn(4, 3), (1, 1), NAN), "labels": torch.tensor([0, 1, 5, 1])}
    report = validate_batch(batch, num_classes=3)
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert data["ok"] is False
    assert [i["cause"] for i in data["issues"]] == ["nonfinite_input", "label_out_of_range"]
    assert data["checked"] == ['batch["x"]', 'batch["labels"]']


@pytest.mark.parametrize("kwargs, exc, words", [
    ({"num_classes": 0}, ValueError, ["num_classes", "0"]),
    ({"num_classes": 2.5}, ValueError, ["num_classes", "2.5"]),
    ({"ignore_index": "x"}, TypeError, ["ignore_index", "'x'"]),
    ({"max_range": -1}, ValueError, ["max_range", "-1"]),
    ({"reference": {}}, TypeError, ["reference", "BatchSchema"]),
])
def test_validate_batch_bad_arguments(kwargs, exc, words):
    with pytest.raises(exc) as info:
        validate_batch(torch.zeros(2), **kwargs)
    assert all(w in str(info.value) for w in words)


# --------------------------------------------------------------------------- collate


class FakeGuard:
    def __init__(self):
        self.calls: list[DataIssue] = []

    def record_data_incident(self, issue):
        self.calls.append(issue)


def _sample(i: int, *, bad_x: frozenset = frozenset(), bad_y: frozenset = frozenset()):
    x = torch.full((3,), float(i % 7) - 3.0) + torch.arange(3.0)
    if i in bad_x:
        x[1] = NAN
    y = torch.tensor(99 if i in bad_y else i % 5)
    return {"x": x, "labels": y, "id": torch.tensor(i)}


def test_collate_skip_drops_bad_samples():
    guard = FakeGuard()
    collate = ValidatingCollate(num_classes=5, guard=guard)
    samples = [_sample(i, bad_x=frozenset({2}), bad_y=frozenset({5})) for i in range(8)]
    batch = collate(samples)
    assert batch["id"].tolist() == [0, 1, 3, 4, 6, 7]
    assert (collate.skipped_batches, collate.skipped_samples) == (1, 2)
    assert [(i.cause, i.path, i.sample_indices) for i in collate.issues] == [
        ("nonfinite_input", 'batch["x"]', [2]), ("label_out_of_range", 'batch["labels"]', [5])]
    assert [i.cause for i in guard.calls] == ["nonfinite_input", "label_out_of_range"]
    # healthy batches pass untouched and are not counted
    healthy = [_sample(i) for i in range(4)]
    out = collate(healthy)
    assert out["id"].tolist() == [0, 1, 2, 3]
    assert (collate.skipped_batches, collate.skipped_samples, len(collate.issues)) == (1, 2, 2)


@pytest.mark.parametrize("bad_x, bad_y, cause, path, indices", [
    ({1}, set(), "nonfinite_input", 'batch["x"]', [1]),
    (set(), {0, 3}, "label_out_of_range", 'batch["labels"]', [0, 3]),
])
def test_collate_raise_names_cause_path_and_samples(bad_x, bad_y, cause, path, indices):
    guard = FakeGuard()
    collate = ValidatingCollate(policy="raise", num_classes=5, guard=guard)
    samples = [_sample(i, bad_x=frozenset(bad_x), bad_y=frozenset(bad_y)) for i in range(4)]
    with pytest.raises(DataValidationError) as info:
        collate(samples)
    err = info.value
    assert isinstance(err, ValueError)
    assert [(i.cause, i.path, i.sample_indices) for i in err.issues] == [(cause, path, indices)]
    assert cause in str(err) and path in str(err) and f"samples {indices}" in str(err)
    assert [i.cause for i in guard.calls] == [cause]
    assert (collate.skipped_batches, collate.skipped_samples) == (0, 0)


def test_collate_unfixable_batches():
    collate = ValidatingCollate(num_classes=5)
    every = [_sample(i, bad_x=frozenset(range(3))) for i in range(3)]
    with pytest.raises(DataValidationError, match="no valid subset") as info:
        collate(every)
    assert info.value.issues[0].cause == "nonfinite_input"
    assert (collate.skipped_batches, collate.skipped_samples) == (1, 3)

    passing = ValidatingCollate(num_classes=5, on_unfixable="pass", guard=FakeGuard())
    out = passing(every)
    assert out["x"].shape == (3, 3) and bool(out["x"].isnan().any())
    assert [i.cause for i in passing.guard.calls] == ["nonfinite_input"]

    ignored = [{"x": torch.randn(2), "labels": torch.tensor([-100, -100])} for _ in range(3)]
    with pytest.raises(DataValidationError, match="0/0 = NaN"):
        ValidatingCollate()(ignored)


def test_collate_schema_changes():
    collate = ValidatingCollate()
    assert collate([{"x": torch.randn(3)} for _ in range(4)])["x"].shape == (4, 3)
    with pytest.raises(DataValidationError, match="float64") as info:  # dtype: enforced
        collate([{"x": torch.randn(3, dtype=torch.float64)} for _ in range(4)])
    assert [i.cause for i in info.value.issues] == ["dtype_mismatch"]
    # shape changes are recorded (dynamic padding is legitimate) unless enforced
    assert collate([{"x": torch.randn(5)} for _ in range(4)])["x"].shape == (4, 5)
    assert [i.cause for i in collate.issues] == ["dtype_mismatch", "shape_mismatch"]
    strict = ValidatingCollate(enforce=("shape_mismatch",))
    strict([{"x": torch.randn(3)} for _ in range(4)])
    with pytest.raises(DataValidationError, match="per-sample shape"):
        strict([{"x": torch.randn(5)} for _ in range(4)])
    padded = ValidatingCollate(schema=BatchSchema(variable_dims=(1,)), enforce=("shape_mismatch",))
    for length in (7, 3, 11):
        padded([{"input_ids": torch.ones(length, dtype=torch.long)} for _ in range(2)])
    assert padded.issues == []


def test_collate_warnings_are_recorded_not_enforced():

    warn_only = ValidatingCollate(check_schema=False)
    out = warn_only([{"x": torch.full((3,), 2.0)} for _ in range(4)])  # constant input
    assert out["x"].shape == (4, 3)
    assert [i.cause for i in warn_only.issues] == ["degenerate_normalisation"]
    strict = ValidatingCollate(policy="raise", enforce=("degenerate_normalisation",))
    with pytest.raises(DataValidationError, match="degenerate_normalisation"):
        strict([{"x": torch.full((3,), 2.0)} for _ in range(4)])


def test_collate_custom_collate_fn_whose_rows_are_not_samples():
    def pairs(samples):  # packs two samples per row
        return {"x": torch.stack([torch.cat([a["x"], b["x"]]) for a, b in zip(samples[::2], samples[1::2])])}

    collate = ValidatingCollate(pairs)
    samples = [_sample(i, bad_x=frozenset({1})) for i in range(4)]
    with pytest.raises(DataValidationError, match="no valid subset"):
        collate(samples)


@pytest.mark.parametrize("kwargs, exc, words", [
    ({"policy": "drop"}, ValueError, ["policy", "'drop'", "skip", "raise"]),
    ({"num_classes": 0}, ValueError, ["num_classes", "0"]),
    ({"num_classes": -3}, ValueError, ["num_classes", "-3"]),
    ({"collate_fn": 42}, TypeError, ["collate_fn", "42", "callable"]),
    ({"on_unfixable": "retry"}, ValueError, ["on_unfixable", "'retry'", "pass"]),
    ({"enforce": ("nan",)}, ValueError, ["enforce", "nan", "nonfinite_input"]),
    ({"guard": object()}, TypeError, ["guard", "record_data_incident"]),
    ({"max_range": 0}, ValueError, ["max_range", "0"]),
])
def test_collate_bad_arguments(kwargs, exc, words):
    with pytest.raises(exc) as info:
        ValidatingCollate(**kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_collate_pickle_round_trip():
    collate = ValidatingCollate(num_classes=5, policy="skip")
    collate([_sample(i, bad_y=frozenset({0})) for i in range(3)])
    clone = pickle.loads(pickle.dumps(collate))
    assert (clone.policy, clone.validate_kwargs["num_classes"]) == ("skip", 5)
    assert (clone.skipped_batches, clone.skipped_samples) == (1, 1)
    assert [i.cause for i in clone.issues] == ["label_out_of_range"]
    assert clone([_sample(i) for i in range(2)])["id"].tolist() == [0, 1]


class _Items(Dataset):
    def __init__(self, n: int, bad_x: set[int], bad_y: set[int]):
        self.n, self.bad_x, self.bad_y = n, frozenset(bad_x), frozenset(bad_y)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return _sample(i, bad_x=self.bad_x, bad_y=self.bad_y)


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_collate_with_two_workers_counts_and_reports_back():
    guard = FakeGuard()
    collate = ValidatingCollate(num_classes=5, guard=guard)
    data = _Items(40, bad_x={3, 17, 18}, bad_y={25})
    loader = DataLoader(data, batch_size=8, num_workers=2, collate_fn=collate)
    seen = [i for batch in loader for i in batch["id"].tolist()]
    assert sorted(seen) == [i for i in range(40) if i not in {3, 17, 18, 25}]
    assert (collate.skipped_batches, collate.skipped_samples) == (3, 4)
    assert _wait_for(lambda: len(guard.calls) == 3)
    collate.drain(timeout=0.1)
    assert sorted((i.cause, tuple(i.sample_indices)) for i in collate.issues) == [
        ("label_out_of_range", (1,)), ("nonfinite_input", (1, 2)), ("nonfinite_input", (3,))]
    assert sorted(i.cause for i in guard.calls) == ["label_out_of_range", "nonfinite_input", "nonfinite_input"]


def test_collate_raise_from_a_worker_reaches_the_main_process():
    loader = DataLoader(_Items(16, bad_x={9}, bad_y=set()), batch_size=4, num_workers=2,
                        collate_fn=ValidatingCollate(policy="raise"))
    it = iter(loader)
    try:
        with pytest.raises(DataValidationError) as info:
            list(it)
        assert 'nonfinite_input at batch["x"] samples [1]' in str(info.value)
    finally:
        # After a worker exception PyTorch's shutdown waits 5 s per idle worker before
        # terminating it; end this test's own workers right away instead.
        for worker in getattr(it, "_workers", []):
            worker.terminate()
        del it


def test_default_collate_output_is_unchanged():
    samples = [_sample(i) for i in range(5)]
    expected = default_collate(samples)
    got = ValidatingCollate()(samples)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_collate_with_spawned_workers():
    # spawn is the default start method on macOS and Windows: the collate is pickled
    guard = FakeGuard()
    collate = ValidatingCollate(num_classes=5, guard=guard)
    loader = DataLoader(_Items(16, bad_x={5}, bad_y=set()), batch_size=8, num_workers=1,
                        collate_fn=collate, multiprocessing_context="spawn")
    seen = [i for batch in loader for i in batch["id"].tolist()]
    assert sorted(seen) == [i for i in range(16) if i != 5]
    assert (collate.skipped_batches, collate.skipped_samples) == (1, 1)
    assert _wait_for(lambda: len(guard.calls) == 1)
    assert [(i.cause, i.sample_indices) for i in guard.calls] == [("nonfinite_input", [5])]


def test_collate_reports_to_a_real_guard_as_data_incidents():
    """A ValidatingCollate with a real guard turns bad samples into phase='data' incidents."""
    import nantrace
    from nantrace.data import ValidatingCollate

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False))
    collate = ValidatingCollate(num_classes=3, guard=guard)
    samples = [(torch.randn(4), torch.tensor(i % 3)) for i in range(6)]
    samples[2] = (torch.tensor([1.0, float("nan"), 0.0, 0.0]), torch.tensor(1))
    samples[4] = (torch.randn(4), torch.tensor(7))
    x, y = collate(samples)
    assert x.shape == (4, 4) and torch.isfinite(x).all() and int(y.max()) < 3
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    guard.close()
    got = sorted((i.step, i.kind, i.phase, i.cause, i.action, tuple(i.details["sample_indices"])) for i in guard.incidents)
    assert got == [
        (0, "nonfinite_input", "data", "label_out_of_range", "skipped", (4,)),
        (0, "nonfinite_input", "data", "nonfinite_input", "skipped", (2,)),
    ]


@pytest.mark.parametrize("make, needed", [
    (lambda: torch.randn(16, 3, 8, 8), False),                       # normalised: no check can fire
    (lambda: torch.rand(16, 3, 8, 8), False),                        # [0, 1] pixels
    (lambda: torch.full((16, 3, 8, 8), 0.5), True),                  # constant: the spread check must look
    (lambda: 1e6 + 1e-3 * torch.rand(16, 3, 8, 8, dtype=torch.float64), True),  # tiny spread next to its magnitude
    (lambda: 255 * torch.rand(16, 3, 8, 8), False),                  # raw pixels, small rows: 2 sqrt(sum x^2) < 1e4
    (lambda: 255 * torch.rand(2, 3, 224, 224), True),                # raw pixels, image rows: the bound is not conclusive
])
def test_the_min_max_pass_is_skipped_only_when_no_check_could_fire(make, needed):
    from nantrace.data.batch import _extremes_needed

    t = make()
    x = t.reshape(t.shape[0], -1).double()
    n = float(x.numel())
    mean, std = float(x.mean()), float(x.std())
    assert _extremes_needed(n, mean, std, (x * x).sum(1).numpy(), max_range=1e4, spread_rtol=1e-6) is needed
    if not needed:  # and then, exactly, neither check would have fired
        lo, hi = float(x.min()), float(x.max())
        assert hi - lo <= 1e4 and hi - lo > 1e-6 * max(abs(lo), abs(hi))
