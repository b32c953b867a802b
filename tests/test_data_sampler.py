"""Distributed sampler audit (nantrace.data.audit_sampler); no process group needed."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

from nantrace.data import audit_sampler


def _ds(n: int, world: int, rank: int = 0, **kwargs) -> DistributedSampler:
    return DistributedSampler(range(n), num_replicas=world, rank=rank, **kwargs)


@pytest.mark.parametrize("n, world, kwargs", [
    (12, 3, {}), (12, 4, {"shuffle": False}), (96, 8, {"seed": 7}), (5, 1, {}),
])
def test_even_split_is_clean(n, world, kwargs):
    report = audit_sampler(_ds(n, world, **kwargs))
    assert report.ok, str(report)
    assert report.per_rank_counts == [n // world] * world
    assert (report.duplicates, report.gaps, report.expected_padding, report.notes) == ({}, [], [], [])


@pytest.mark.parametrize("shuffle", [False, True])
def test_padding_duplicates_are_expected(shuffle):
    sampler = _ds(10, 4, shuffle=shuffle)
    sampler.set_epoch(3)
    report = audit_sampler(sampler)
    assert report.ok
    assert report.per_rank_counts == [3, 3, 3, 3]
    g = torch.Generator()
    g.manual_seed(sampler.seed + 3)
    order = torch.randperm(10, generator=g).tolist() if shuffle else list(range(10))
    assert report.expected_padding == sorted(order[:2])  # DistributedSampler repeats the first ones
    assert report.duplicates == {}
    assert "drop_last=False" in report.notes[0] and "expected" in report.notes[0]


def test_drop_last_tail_is_expected():
    report = audit_sampler(_ds(10, 4, shuffle=False, drop_last=True))
    assert report.ok
    assert report.per_rank_counts == [2, 2, 2, 2]
    assert report.expected_dropped == [8, 9]
    assert "drop_last=True" in report.notes[0]


def test_every_rank_built_with_rank_zero():
    report = audit_sampler([_ds(8, 2, rank=0), _ds(8, 2, rank=0)])
    assert report.causes == ["sampler_config", "sampler_duplicate", "sampler_gap"]
    config, dup, gap = report.issues
    assert "ranks [0, 0]" in config.summary
    assert dup.details["identical_shards"] == [[0, 1]]
    assert "identical shards" in dup.summary
    assert all(ranks == [0, 1] for ranks in report.duplicates.values())
    assert len(report.duplicates) == 4 and len(report.gaps) == 4
    assert sorted(list(report.duplicates) + report.gaps) == list(range(8))


def test_different_seed_per_rank():
    samplers = [_ds(20, 2, rank=r, seed=100 + r) for r in range(2)]
    report = audit_sampler(samplers)
    assert report.causes == ["sampler_config", "sampler_duplicate", "sampler_gap"]
    assert "seed differs between ranks ([100, 101])" in report.issues[0].summary
    shards = [set(s) for s in samplers]
    assert sorted(report.duplicates) == sorted(shards[0] & shards[1])
    assert report.gaps == sorted(set(range(20)) - shards[0] - shards[1])


def test_overlapping_index_lists():
    report = audit_sampler([[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]], dataset_len=10)
    assert report.causes == ["sampler_duplicate", "sampler_gap"]
    assert report.duplicates == {4: [0, 1]}
    assert report.gaps == [9]
    assert report.issues[0].sample_indices == [4] and report.issues[1].sample_indices == [9]
    assert "index 4 on ranks [0, 1]" in report.issues[0].summary


def test_unsharded_sampler_on_every_rank():
    data = range(6)
    report = audit_sampler(RandomSampler(data, generator=torch.Generator().manual_seed(0)), world_size=3)
    assert report.causes == ["sampler_duplicate"]
    assert report.duplicates == {i: [0, 1, 2] for i in range(6)}
    assert "not sharded" in report.issues[0].summary or "identical shards" in report.issues[0].summary


def test_single_sequential_sampler_is_clean():
    assert audit_sampler(SequentialSampler(range(7))).ok


def test_uneven_shards_hang_ddp():
    report = audit_sampler([[0, 1, 2], [3, 4]], dataset_len=5)
    assert report.causes == ["sampler_imbalance"]
    assert report.issues[0].details["per_rank_counts"] == [3, 2]


def test_out_of_range_indices():
    report = audit_sampler([[0, 1], [2, 12]], dataset_len=4)
    assert report.causes == ["sampler_out_of_range", "sampler_gap"]
    assert report.issues[0].sample_indices == [12] and report.issues[0].details["ranks"] == [1]
    assert report.gaps == [3]


def test_unknown_length_is_noted():
    report = audit_sampler([[0, 2], [1, 3]])
    assert report.ok and report.dataset_len == 4
    assert "dataset length unknown" in report.notes[0]


def test_report_is_json_serialisable():
    report = audit_sampler([_ds(8, 2, rank=0), _ds(8, 2, rank=0)])
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert data["ok"] is False and data["world_size"] == 2


@pytest.mark.parametrize("args, kwargs, exc, words", [
    ((42,), {}, TypeError, ["DistributedSampler", "int"]),
    (([[0], [1]],), {"world_size": 3}, ValueError, ["world_size=3", "2"]),
    (([[0], [1]],), {"world_size": 0}, ValueError, ["world_size", "0"]),
    (([[0], [1]],), {"dataset_len": -1}, ValueError, ["dataset_len", "-1"]),
])
def test_bad_arguments(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        audit_sampler(*args, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)
