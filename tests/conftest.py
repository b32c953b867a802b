"""Shared helpers for the nantrace tests: tiny models, quiet configs, state snapshots."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import nantrace


@pytest.fixture
def one_thread():
    """One intra-op thread for tests of tiny models: more threads only add contention (a busy CI machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def quiet() -> nantrace.Config:
    """Default config without console output."""
    return nantrace.Config(print_incidents=False)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Deep copies of the model's and optimizer's state, for bit-for-bit comparisons."""
    return {
        "model": copy.deepcopy(model.state_dict()),
        "optimizer": copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None,
    }


def same_state(a: Any, b: Any) -> bool:
    """True when two nested state structures are bit-for-bit identical (NaN == NaN)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and bool(
            torch.equal(a, b) or (a.is_floating_point() and torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b, 7.0))
                                  and torch.equal(torch.isnan(a), torch.isnan(b)))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def mlp(seed: int = 0, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def assert_unhooked(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, scaler: Any = None,
                    scaler_keys: set[str] | None = None) -> None:
    """Nothing of nantrace remains on the model, optimizer, scaler or torch.autograd."""
    from nantrace.patches import BACKWARD

    for name, m in model.named_modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, f"hook left on module {name!r}"
        assert not m._backward_hooks and not m._backward_pre_hooks, f"backward hook left on {name!r}"
    if optimizer is not None:
        assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
        assert not optimizer._optimizer_load_state_dict_post_hooks
        assert "step" not in optimizer.__dict__
    if scaler is not None and scaler_keys is not None:
        assert set(scaler.__dict__) == scaler_keys
    assert not BACKWARD.installed
    assert torch.autograd.backward.__module__ == "torch.autograd"


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "cause_matrix: the cause oracle and its generated matrix (tests/test_cause_matrix.py)")


@pytest.fixture
def distributions_validate() -> Any:
    """torch.distributions validates its arguments by default (``__debug__``), as in a script; but
    ``torch._dynamo`` turns that default off for the whole process the first time anything is compiled
    (an earlier test's ``torch.compile``). Programs that rely on the default ask for it back."""
    before = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(True)
    yield
    torch.distributions.Distribution.set_default_validate_args(before)
