"""The step check's two ways to a norm on the CPU (issue 13, item 4): ATen's norm kernel
(``_foreach_norm``) and, for large contiguous float32 tensors, the root of a BLAS ``dot``.

Both must read the same about finiteness (NaN stays NaN, an Inf or a sum of squares beyond
float32 becomes Inf, which the host then recounts in float64), and give the same norms to
float32 rounding. The reference is NumPy in float64, which shares no code with either path.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import nantrace
from nantrace.detection import sentinel

BIG = sentinel.DOT_MIN_NUMEL


def _reference(t: torch.Tensor) -> float:
    """The norm a float32 sum of squares gives: NaN when an element is NaN, Inf when an element is
    infinite (squares are +Inf, never Inf - Inf) or the sum passes float32's largest value."""
    total = float(np.sum(np.square(t.detach().numpy().astype(np.float64).ravel())))
    if math.isnan(total):
        return math.nan
    return math.inf if total > float(np.finfo(np.float32).max) else math.sqrt(total)


def _tensors(pattern: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    large = torch.randn(BIG + 7, generator=g)
    matrix = torch.randn(512, 512, generator=g)
    small = torch.randn(300, generator=g)
    strided = torch.randn(512, 512, generator=g).t()  # large but not contiguous: left to the norm kernel
    if pattern == "nan_large":
        large[123] = math.nan
    elif pattern == "inf_large":
        matrix[5, 7] = math.inf
    elif pattern == "neg_inf_large":
        large[-1] = -math.inf
    elif pattern == "inf_and_neg_inf":
        large[0], large[1] = math.inf, -math.inf  # squares: +inf + +inf, never inf - inf
    elif pattern == "overflow_finite":
        matrix.fill_(3e19)  # every element finite, the float32 sum of squares is not
    elif pattern == "nan_small":
        small[0] = math.nan
    elif pattern == "nan_strided":
        strided[3, 4] = math.nan
    return [large, small, matrix, strided]


PATTERNS = ["clean", "nan_large", "inf_large", "neg_inf_large", "inf_and_neg_inf", "overflow_finite",
            "nan_small", "nan_strided"]


@pytest.mark.parametrize("dot", [True, False], ids=["dot", "norm_kernel"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_both_paths_read_finiteness_and_norms_alike(monkeypatch, pattern, dot):
    monkeypatch.setattr(sentinel, "_DOT_VERDICT", [dot])
    tensors = _tensors(pattern)
    got = [float(n) for n in sentinel._norms(tensors)]
    for value, t in zip(got, tensors):
        want = _reference(t)
        if math.isnan(want):
            assert math.isnan(value)
        elif math.isinf(want):
            assert value == math.inf
        else:
            assert value == pytest.approx(want, rel=2e-5)


def test_dot_is_taken_for_large_contiguous_float32_only(monkeypatch):
    monkeypatch.setattr(sentinel, "_DOT_VERDICT", [True])
    dots: list[int] = []
    real = torch.dot
    monkeypatch.setattr(torch, "dot", lambda a, b: dots.append(a.numel()) or real(a, b))
    tensors = _tensors("clean")
    sentinel._norms(tensors)
    assert sorted(dots) == sorted([BIG + 7, 512 * 512])  # not the small one, not the transposed one
    dots.clear()
    sentinel._norms([t.half() for t in tensors[:3]], dtype=torch.float32)  # float16: the norm kernel
    assert dots == []
    monkeypatch.setattr(sentinel, "_DOT_VERDICT", [False])
    sentinel._norms(tensors)
    assert dots == []  # where dot lost the timing, nothing changes


def test_the_choice_is_timed_once_per_process(monkeypatch):
    monkeypatch.setattr(sentinel, "_DOT_VERDICT", [])
    large = [torch.randn(BIG), torch.randn(BIG)]
    first = sentinel._dot_pays(large)
    assert isinstance(first, bool) and sentinel._DOT_VERDICT == [first]
    monkeypatch.setattr(sentinel, "_sums_of_squares", lambda *_: pytest.fail("timed twice"))
    assert sentinel._dot_pays(large) is first


def test_a_parameter_norm_by_dot_builds_no_graph(monkeypatch):
    monkeypatch.setattr(sentinel, "_DOT_VERDICT", [True])
    p = nn.Parameter(torch.randn(BIG))
    (norm,) = sentinel._norms([p])
    assert norm.grad_fn is None and not norm.requires_grad


class _Wide(nn.Module):
    """A classifier whose hidden layer's weight (512 x 512) is large enough for the dot path."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 512)
        self.hidden = nn.Linear(512, 512)
        self.head = nn.Linear(512, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(torch.relu(self.inp(x)))))


def _run(dot: bool, monkeypatch, *, poison_at: int | None) -> tuple[list[dict], list[float], dict[str, torch.Tensor]]:
    monkeypatch.setattr(sentinel, "_DOT_VERDICT", [dot])
    torch.manual_seed(0)
    model = _Wide()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(6)]
    norms: list[float] = []
    config = nantrace.Config(outputs={"print_incidents": False})
    with nantrace.watch(model, opt, config=config) as guard:
        for step, (x, y) in enumerate(data):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            if step == poison_at:
                model.hidden.weight.grad[7, 9] = math.nan  # a gradient corrupted after the backward
            opt.step()
            norms.append(guard.last_step["grad_norm"])
        incidents = [{k: i.to_dict()[k] for k in ("step", "kind", "cause", "action")} for i in guard.incidents]
    return incidents, norms, {k: v.clone() for k, v in model.state_dict().items()}


def step_is_bad(norm: float) -> bool:
    return not math.isfinite(norm)


def test_a_run_reads_the_same_by_either_path(monkeypatch):
    by_dot = _run(True, monkeypatch, poison_at=3)
    by_kernel = _run(False, monkeypatch, poison_at=3)
    assert by_dot[0] == by_kernel[0]
    assert [i["step"] for i in by_dot[0]] == [3] and by_dot[0][0]["kind"] == "nonfinite_grad"
    assert by_dot[0][0]["action"] == "skipped"
    assert [step_is_bad(n) for n in by_dot[1]] == [False, False, False, True, False, False]
    for a, b in zip(by_dot[1], by_kernel[1]):
        assert (math.isnan(a) and math.isnan(b)) if step_is_bad(a) else a == pytest.approx(b, rel=1e-5)
    for name, value in by_dot[2].items():  # the weights depend only on the verdicts, not the path
        assert torch.equal(value, by_kernel[2][name]), name
