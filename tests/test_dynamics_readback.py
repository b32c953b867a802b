"""Deferred device reads and run-store transactions (nantrace.dynamics._readback / _common),
and the whole set of monitors on a CUDA device when there is one."""

from __future__ import annotations

import sqlite3

import pytest
import torch

import nantrace
from dynamics_helpers import _one_thread, classification_batches, quiet, relu_mlp, train  # noqa: F401
from nantrace.dynamics._common import MonitorFailedWarning
from nantrace.dynamics._readback import DeferredRead, stack_on
from nantrace.storage.runstore import RunStore

pytestmark = pytest.mark.filterwarnings(f"error::{MonitorFailedWarning.__module__}.{MonitorFailedWarning.__name__}")


def test_deferred_read_on_cpu() -> None:
    values = stack_on([torch.tensor(1.5), torch.tensor([2.0, float("nan")])], torch.device("cpu"))
    read = DeferredRead(values)
    assert read.ready()
    got = read.get()
    assert got[:2] == [1.5, 2.0] and got[2] != got[2]


def test_run_store_transaction_commits_once_and_rolls_back_on_error(tmp_path) -> None:
    store = RunStore(tmp_path)
    with store.transaction():
        store.log_layer_stats(0, [(0, 1.0, 2.0, None), (1, 3.0, 4.0, 0.1)])
    with pytest.raises(sqlite3.IntegrityError):
        with store.transaction():
            store.log_layer_stats(1, [(0, 1.0, 2.0, None)])
            store._conn.execute("INSERT INTO meta(key, value) VALUES (NULL, NULL)")  # fails: NOT NULL
    store.close()
    with RunStore(tmp_path, readonly=True) as reader:
        assert [r[:2] for r in reader.layer_stats()] == [(0, 0), (0, 1)]  # step 1 rolled back


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_monitor_on_cuda(tmp_path) -> None:
    model = relu_mlp(0, width=16).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = classification_batches()

    def on_gpu(step: int):
        x, y = batches(step)
        return x.cuda(), y.cuda()

    guard = train(model, opt, on_gpu, 12, quiet(update_stats_every=3, activation_stats_every=3, optimizer_stats_every=3,
                                                 logit_stats_every=3, tensorboard=str(tmp_path / "tb")),
                  run_dir=tmp_path, clip=1.0)
    summary = nantrace.dynamics.summary(guard)
    assert summary["layers"]["update_ratio_step"] == 9 and summary["optimizer_state"]["step"] == 9
    assert summary["clipping"]["calls"] == 12 and summary["logits"]["step"] == 9
    with RunStore(tmp_path, readonly=True) as store:
        assert {r[0] for r in store.activation_stats()} == {0, 3, 6, 9}
        assert sum(r[4] is not None for r in store.layer_stats()) == 4 * 4
