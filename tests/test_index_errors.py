"""An index outside the dimension it addresses raises; the incident is ``label_out_of_range`` at the indexing op,
whatever the indexed tensor's dtype (an integer lookup table: a vocabulary remap, a label map) and wherever the
index sits in the op's arguments (``gather(self, dim, index)``, ``index_select(self, dim, index)``,
``take(self, index)``, ``x[i, j]``, ``F.one_hot(labels, num_classes)``, whose check runs above the dispatcher: the
call that raised again in the replay is named). An index in range whose op raises for another reason is no such incident."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from origin_markers import points_at

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]
FAIL = 2
REMAP = torch.tensor([3, 0, 2, 1, 4, 6, 5, 7])  # old vocabulary id -> new id (8 entries)
BUCKETS = torch.tensor([[0, 1, 1, 2], [2, 3, 3, 3], [0, 0, 1, 2]])  # (region, hour-of-day quarter) -> bucket


def remap_gather(ids: torch.Tensor) -> torch.Tensor:
    return REMAP.gather(0, ids)  # <origin:gather>


def remap_index_select(ids: torch.Tensor) -> torch.Tensor:
    return REMAP.index_select(0, ids)  # <origin:index_select>


def remap_take(ids: torch.Tensor) -> torch.Tensor:
    return REMAP.take(ids)  # <origin:take>


def bucket_2d(ids: torch.Tensor) -> torch.Tensor:
    return BUCKETS[ids % 3, ids // 2]  # <origin:advanced>


def one_hot_targets(ids: torch.Tensor) -> torch.Tensor:
    labels = torch.where(ids == 3, torch.full_like(ids, -100), ids) % 8  # (-100 % 8 = 4: a label stays in range)
    return F.one_hot(torch.where(ids == 8, ids, labels), 8).argmax(-1)  # <origin:one_hot>


def one_hot_ignore_index(ids: torch.Tensor) -> torch.Tensor:
    labels = torch.where(ids == 8, torch.full_like(ids, -100), ids)  # the dataset's ignore index, one-hot encoded by hand
    return F.one_hot(labels, 8).argmax(-1)  # <origin:one_hot_ignore>


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids % 8))


CASES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str, str, type[BaseException]]] = {
    "gather_integer_table": (remap_gather, "aten.gather.default", "gather", RuntimeError),
    "index_select_integer_table": (remap_index_select, "aten.index_select.default", "index_select", IndexError),
    "take_integer_table": (remap_take, "aten.take.default", "take", IndexError),
    "advanced_index_second_dimension": (bucket_2d, "aten.index.Tensor", "advanced", IndexError),
    # F.one_hot checks its labels in C++ above the dispatcher (no dispatched op raises): the call itself is named
    "one_hot_label_past_the_classes": (one_hot_targets, "aten.one_hot.default", "one_hot", RuntimeError),
    "one_hot_of_the_ignore_index": (one_hot_ignore_index, "aten.one_hot.default", "one_hot_ignore", RuntimeError),
}


def batches(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 8, (12,), generator=g)
    if step == FAIL:
        ids[4] = 8  # an id from the new tokenizer's extra entry: past the old table's end
    return ids


@pytest.mark.parametrize("name", list(CASES))
def test_an_index_past_a_table_is_label_out_of_range(name: str) -> None:
    remap, op, tag, error = CASES[name]
    with pytest.raises(error):  # the construction, without nantrace
        remap(batches(FAIL))
    torch.manual_seed(0)
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    with pytest.raises(error), guard:
        for step in range(FAIL + 1):
            ids = batches(step)
            opt.zero_grad()
            logits = model(ids)
            F.cross_entropy(logits, remap(ids) % 4).backward()  # the remapped ids are the loss code's targets
            opt.step()
    [inc] = guard.incidents
    assert (inc.step, inc.kind, inc.op, inc.module, inc.cause, inc.action) == (
        FAIL, "exception", op, None, "label_out_of_range", "raised"), inc.summary
    assert points_at(inc.source, __file__, tag), inc.source


def test_an_index_in_range_is_no_incident() -> None:
    """``gather`` raising on a shape mismatch (index of another rank), every index in range: not a value's."""
    torch.manual_seed(0)
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    with pytest.raises(RuntimeError), guard:
        ids = batches(0)
        opt.zero_grad()
        logits = model(ids)
        bad = REMAP[None].expand(2, 8).gather(1, ids[None, None, :2] % 8)  # index with 3 dims for a 2-d input
        (F.cross_entropy(logits, ids % 4) + bad.sum()).backward()
    assert list(guard.incidents) == []
