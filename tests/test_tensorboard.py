"""TensorBoard export (nantrace.storage.tensorboard): read the event file back and compare
with the run; non-finite gradients are counted beside the histograms, never dropped."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

import nantrace
from conftest import assert_unhooked
from dynamics_helpers import _one_thread, classification_batches, quiet, relu_mlp  # noqa: F401
from nantrace.dynamics._common import MonitorFailedWarning
from nantrace.storage.tensorboard import BUCKET_LIMITS, gradient_histogram

pytest.importorskip("tensorboard", reason="needs the tensorboard extra: pip install 'nantrace[tensorboard]'")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

pytestmark = pytest.mark.filterwarnings(f"error::{MonitorFailedWarning.__module__}.{MonitorFailedWarning.__name__}")

NAN_STEP = 4


def _events(logdir) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_gradient_histogram_matches_a_reference() -> None:
    g = torch.tensor([0.0, -1e-3, 2.5, float("nan"), float("inf"), 3e5, -7.0])
    limits = torch.as_tensor(BUCKET_LIMITS[:-1], dtype=torch.float64)
    out = gradient_histogram(g, limits).tolist()
    counts, (nonfinite, n, lo, hi, total, squares) = out[:len(BUCKET_LIMITS)], out[len(BUCKET_LIMITS):]
    finite = [0.0, -1e-3, 2.5, 3e5, -7.0]
    assert (nonfinite, n, lo, hi) == (2, 5, -7.0, 3e5)
    assert total == pytest.approx(sum(finite)) and squares == pytest.approx(sum(x * x for x in finite))
    assert sum(counts) == 5
    for x in finite:  # each value in the first bucket whose upper limit is >= it
        bucket = next(i for i, limit in enumerate(BUCKET_LIMITS) if x <= limit)
        assert counts[bucket] >= 1
    assert counts[-1] == 1  # 3e5 is beyond the last finite limit (1e4)


def test_event_file_holds_the_run(tmp_path) -> None:
    model = relu_mlp(0, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step_now = [0]
    model[2].weight.register_hook(lambda grad: grad * float("nan") if step_now[0] == NAN_STEP else grad)
    logdir = tmp_path / "tb"
    guard = nantrace.watch(model, opt, config=quiet(tensorboard=str(logdir), update_stats_every=2))
    batches = classification_batches()
    grads: dict[int, torch.Tensor] = {}
    losses = []
    for step in range(6):
        step_now[0] = step
        x, y = batches(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        grads[step] = torch.cat([model[2].weight.grad.flatten(), model[2].bias.grad.flatten()]).double()
    guard.close()
    assert_unhooked(model, opt)

    acc = _events(logdir)
    scalars = set(acc.Tags()["scalars"])
    assert {"loss", "grad_norm", "param_norm", "lr/group0", "skipped", "nonfinite/health", "nonfinite/2"} <= scalars
    assert [e.step for e in acc.Scalars("loss")] == list(range(6))
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx(losses, rel=1e-6)
    assert [e.value for e in acc.Scalars("skipped")] == [0, 0, 0, 0, 1, 0]  # the NaN step was blocked
    assert [e.value for e in acc.Scalars("nonfinite/health")] == [0, 0, 0, 0, 1, 0]
    assert math.isnan(acc.Scalars("grad_norm")[NAN_STEP].value)  # stored as NaN, not dropped
    assert [(e.step, e.value) for e in acc.Scalars("nonfinite/2")] == [(0, 0), (2, 0), (4, model[2].weight.numel())]
    assert [e.step for e in acc.Scalars("layer_grad_norm/0")] == [0, 2, 4]

    histograms = {e.step: e.histogram_value for e in acc.Histograms("grad/2")}
    assert sorted(histograms) == [0, 2, 4]
    for step in (0, 2):
        h, ref = histograms[step], grads[step]
        assert h.num == ref.numel() and sum(h.bucket) == ref.numel()
        assert h.min == pytest.approx(float(ref.min())) and h.max == pytest.approx(float(ref.max()))
        assert h.sum == pytest.approx(float(ref.sum()), abs=1e-9) and h.sum_squares == pytest.approx(float((ref ** 2).sum()))
        assert list(h.bucket_limit) == sorted(h.bucket_limit)
    assert histograms[NAN_STEP].num == model[2].bias.numel()  # only the finite values, the rest counted beside


def test_true_writes_under_the_run_directory(tmp_path) -> None:
    model = relu_mlp(0, width=8)
    guard = nantrace.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=tmp_path,
                           config=quiet(tensorboard=True))
    guard.close()
    assert os.listdir(tmp_path / "tensorboard")
    assert guard.store is not None


def test_true_without_a_run_directory_is_an_error() -> None:
    model = relu_mlp(0, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="Config.tensorboard=True writes to RUN_DIR/tensorboard, but watch"):
        nantrace.watch(model, opt, config=quiet(tensorboard=True))
    assert_unhooked(model, opt)


def test_missing_tensorboard_says_what_to_install(monkeypatch, tmp_path) -> None:
    import nantrace._imports as imports

    monkeypatch.setattr(imports, "is_available", lambda package: False)
    model = relu_mlp(0, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ImportError, match=r"pip install 'nantrace\[tensorboard\]'"):
        nantrace.watch(model, opt, config=quiet(tensorboard=str(tmp_path)))
    assert_unhooked(model, opt)
    from nantrace.patches import CLIP_FUNCTIONS

    assert not any(p.installed for p in CLIP_FUNCTIONS)
