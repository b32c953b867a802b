"""Seed chains and the augmentation audit (nantrace.data.seeds)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from nantrace.data import SeedChain, audit_augmentation, derive_seed

# The derivation is part of the reproducibility contract: runs seeded with nantrace
# must get the same seeds after an upgrade. Changing these values is a breaking change.
GOLDEN = [
    ((1234,), {}, 6473194390097637460),
    ((1234, "epoch", 3, "worker", 1), {}, 9220005577492122427),
    ((0,), {"bits": 32}, 4174115298),
]


@pytest.mark.parametrize("args, kwargs, value", GOLDEN)
def test_derive_seed_golden_values(args, kwargs, value):
    assert derive_seed(*args, **kwargs) == value


def test_derive_seed_is_stable_across_processes_and_hash_seeds():
    code = "from nantrace.data import derive_seed; print(derive_seed(1234, 'epoch', 3, 'worker', 1))"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) == derive_seed(1234, "epoch", 3, "worker", 1)


@pytest.mark.parametrize("a, b", [
    ((0, "a", 1), (0, "a", "1")),
    ((0, 1, 2), (0, 12)),
    ((0, 1, 2), (0, 2, 1)),
    ((0, "ab"), (0, "a", "b")),
    ((0,), (1,)),
    ((0, "x"), (0, "x", 0)),
])
def test_related_paths_give_unrelated_seeds(a, b):
    assert derive_seed(*a) != derive_seed(*b)


def test_seeds_are_well_mixed():
    seeds = [derive_seed(42, "worker", i) for i in range(2000)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)
    for bit in (0, 1, 7, 31, 62):
        share = sum((s >> bit) & 1 for s in seeds) / len(seeds)
        assert 0.45 < share < 0.55, (bit, share)
    assert all(0 <= derive_seed(42, i, bits=32) < 2**32 for i in range(100))


@pytest.mark.parametrize("bad, exc", [((1.5,), TypeError), ((True,), TypeError), ((None,), TypeError)])
def test_derive_seed_rejects_ambiguous_parts(bad, exc):
    with pytest.raises(exc, match="int or str"):
        derive_seed(0, *bad)
    with pytest.raises(ValueError, match="bits"):
        derive_seed(0, bits=65)


def test_seed_chain():
    chain = SeedChain(7)
    assert chain.seed("epoch", 1, "crop") == derive_seed(7, "epoch", 1, "crop")
    assert chain.child("epoch", 1).seed("crop") == chain.seed("epoch", 1, "crop")
    a = torch.rand(4, generator=chain.generator("crop"))
    b = torch.rand(4, generator=chain.generator("crop"))
    c = torch.rand(4, generator=chain.generator("flip"))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert chain.numpy("noise").integers(0, 10**9) == chain.numpy("noise").integers(0, 10**9)
    with pytest.raises(TypeError):
        SeedChain(7, (1.5,))


# --------------------------------------------------------------------------- audit


def good(x, g):
    return x + torch.randn(x.shape, generator=g)


def uses_global_torch(x, g):
    return x + torch.randn_like(x)


def uses_python_random(x, g):
    return x * random.random()


def uses_numpy_global(x, g):
    return x + torch.from_numpy(np.random.rand(*x.shape)).float()


def fixed_internal_seed(x, g):
    own = torch.Generator().manual_seed(0)
    return x + torch.randn(x.shape, generator=own)


def reseeds_its_generator(x, g):
    g.manual_seed(0)
    return x + torch.randn(x.shape, generator=g)


_HIDDEN = torch.Generator().manual_seed(0)  # test helper: the stateful bug under audit


def hidden_state(x, g):
    return x + torch.randn(x.shape, generator=_HIDDEN)


def in_place(x, g):
    return x.add_(torch.randn(x.shape, generator=g))


def wastes_global_draws(x, g):
    random.random()
    return x + torch.randn(x.shape, generator=g)


def coin_flip(x, g):
    return x.flip(-1) if torch.rand(1, generator=g) < 0.5 else x


def crop_and_flip(sample, g):
    img = sample["image"]
    top = int(torch.randint(0, 3, (1,), generator=g))
    out = img[:, top:top + 4]
    if torch.rand(1, generator=g) < 0.5:
        out = out.flip(-1)
    return {"image": out, "label": sample["label"]}


AUDIT_CASES = [
    pytest.param(good, [], True, True, [], id="good"),
    pytest.param(coin_flip, [], True, True, [], id="low-entropy-coin-flip"),
    pytest.param(uses_global_torch, ["global_rng_use", "shared_random_stream"], False, False, ["torch"],
                 id="global-torch"),
    pytest.param(uses_python_random, ["global_rng_use", "shared_random_stream"], False, False, ["random"],
                 id="python-random"),
    pytest.param(uses_numpy_global, ["global_rng_use", "shared_random_stream"], False, False, ["numpy"],
                 id="numpy-global"),
    pytest.param(fixed_internal_seed, ["shared_random_stream"], True, False, [], id="fixed-internal-seed"),
    pytest.param(reseeds_its_generator, ["shared_random_stream"], True, True, [], id="reseeds-generator"),
    pytest.param(hidden_state, ["nondeterministic_augmentation"], False, False, [], id="hidden-state"),
    pytest.param(in_place, ["sample_mutated"], True, True, [], id="in-place"),
    pytest.param(wastes_global_draws, ["global_rng_use"], True, True, ["random"], id="wasted-global-draws"),
]


@pytest.mark.parametrize("fn, causes, reproducible, draws, global_rngs", AUDIT_CASES)
def test_audit_augmentation(fn, causes, reproducible, draws, global_rngs):
    torch_state, py_state = torch.get_rng_state(), random.getstate()
    report = audit_augmentation(fn, torch.arange(6.0).reshape(2, 3) + 1, seed=11, stages=("worker0", "worker1", "worker2"))
    assert report.causes == causes, str(report)
    assert report.reproducible is reproducible
    assert report.draws_from_generator is draws
    assert report.global_rngs_used == global_rngs
    # the caller's RNG streams are left where they were
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == py_state
    json.dumps(report.to_dict(), allow_nan=False)


def test_audit_messages_are_specific():
    report = audit_augmentation(uses_global_torch, torch.zeros(3), seed=0, stages=("crop", "flip"))
    glob = report.by_cause("global_rng_use")[0]
    assert "global torch RNG" in glob.summary and glob.details["output_changed"] is True
    shared = report.by_cause("shared_random_stream")[0]
    assert "'crop' and 'flip'" in shared.summary and "never draws from the generator" in shared.summary
    assert shared.details["seeds_tried"] == 16
    reseed = audit_augmentation(reseeds_its_generator, torch.zeros(3), seed=0).by_cause("shared_random_stream")[0]
    assert "re-seeds the generator" in reseed.summary


def test_audit_on_a_dict_sample():
    sample = {"image": torch.arange(48.0).reshape(1, 6, 8), "label": 3}
    report = audit_augmentation(crop_and_flip, sample, seed=5, stages=[("worker", i) for i in range(4)])
    assert report.ok, str(report)


def test_audit_bad_arguments():
    with pytest.raises(TypeError, match="augment_fn"):
        audit_augmentation(42, torch.zeros(1), seed=0)
    with pytest.raises(ValueError, match="distinct"):
        audit_augmentation(good, torch.zeros(1), seed=0, stages=("a", "a"))
    with pytest.raises(TypeError, match="int or str"):
        audit_augmentation(good, torch.zeros(1), seed=1.5)
