"""Seed chains and the augmentation reproducibility audit.

`derive_seed` maps a base seed and a path of stage names / numbers (``"epoch", 3,
"worker", 1, "crop"``) to a well-mixed 63-bit seed with BLAKE2b, so it is the same in
every process and on every machine (unlike ``hash()``), and related paths give unrelated
seeds (unlike ``base + worker_id``). `SeedChain` hands out generators along such paths.
`audit_augmentation` checks that an augmentation ``fn(sample, generator)`` draws its
randomness from the generator it is given, and only from it.
"""

from __future__ import annotations

import copy
import hashlib
import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..taxonomy import SEED_CAUSES
from .issues import DataIssue, IssueReport

__all__ = ["SEED_CAUSES", "AugmentationReport", "SeedChain", "audit_augmentation", "derive_seed"]


_MIN_PROBES = 16  # seeds tried before concluding that the output ignores the generator
_PERSON = b"nantrace.seed.v1"  # BLAKE2 personalisation (16 bytes): versioned derivation


def _encode_part(part: Any) -> bytes:
    if isinstance(part, bool):
        raise TypeError(f"seed path parts must be int or str, not bool ({part!r})")
    if isinstance(part, str):
        raw = part.encode("utf-8")
        return b"s" + str(len(raw)).encode() + b":" + raw
    try:
        value = operator.index(part)
    except TypeError:
        raise TypeError(f"seed path parts must be int or str; got {type(part).__name__} ({part!r})") from None
    return b"i" + str(value).encode() + b";"


def derive_seed(base_seed: int, *stages: str | int, bits: int = 63) -> int:
    """Deterministic, well-mixed seed for `stages` under `base_seed` (``0 <= seed < 2**bits``).

    Stable across processes, Python versions and ``PYTHONHASHSEED``; use ``bits=32`` for
    APIs that want a 32-bit seed (``numpy.random.seed``).
    """
    if not (isinstance(bits, int) and 1 <= bits <= 64):
        raise ValueError(f"bits must be an int in [1, 64]; got {bits!r}")
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    h.update(_encode_part(base_seed))
    for part in stages:
        h.update(_encode_part(part))
    return int.from_bytes(h.digest(), "little") >> (64 - bits)


@dataclass(frozen=True)
class SeedChain:
    """Per-stage seeds and generators derived from one base seed.

    ``chain = SeedChain(1234)``; ``chain.generator("epoch", 3, "worker", 0, "crop")`` is
    a `torch.Generator` that every process derives identically; ``chain.child("epoch",
    3)`` is the chain for one epoch.
    """

    base_seed: int
    prefix: tuple[str | int, ...] = ()

    def __post_init__(self) -> None:
        _encode_part(self.base_seed)
        for part in self.prefix:
            _encode_part(part)

    def seed(self, *stages: str | int, bits: int = 63) -> int:
        """The seed of this stage path."""
        return derive_seed(self.base_seed, *self.prefix, *stages, bits=bits)

    def generator(self, *stages: str | int, device: str | torch.device = "cpu") -> torch.Generator:
        """A fresh `torch.Generator` seeded for this stage path."""
        g = torch.Generator(device=device)
        g.manual_seed(self.seed(*stages))
        return g

    def numpy(self, *stages: str | int) -> np.random.Generator:
        """A fresh numpy `Generator` seeded for this stage path."""
        return np.random.default_rng(self.seed(*stages))

    def child(self, *stages: str | int) -> SeedChain:
        """The chain rooted at this stage path."""
        return SeedChain(self.base_seed, self.prefix + tuple(stages))


# --------------------------------------------------------------------------- audit


@dataclass
class AugmentationReport(IssueReport):
    """Result of `audit_augmentation`.

    `reproducible`: the same generator seed gave bit-identical output regardless of the
    global RNG state; `draws_from_generator`: the function advanced the generator it was
    given; `global_rngs_used`: global RNGs it consumed (``"torch"``, ``"random"``,
    ``"numpy"``).
    """

    reproducible: bool = True
    draws_from_generator: bool = True
    global_rngs_used: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.update(reproducible=self.reproducible, draws_from_generator=self.draws_from_generator,
                   global_rngs_used=list(self.global_rngs_used))
        return out


def _global_states() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "random": random.getstate(), "numpy": np.random.get_state()}


def _set_global_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["random"])
    np.random.set_state(states["numpy"])


def _seed_globals(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def _changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    used = []
    if not torch.equal(before["torch"], after["torch"]):
        used.append("torch")
    if before["random"] != after["random"]:
        used.append("random")
    b, a = before["numpy"], after["numpy"]
    if not (np.array_equal(b[1], a[1]) and b[2:] == a[2:]):
        used.append("numpy")
    return used


def same_bits(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of (nested) tensors, arrays, images and plain values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
            return False
        a8 = a.detach().contiguous().reshape(-1).view(torch.uint8)
        b8 = b.detach().contiguous().reshape(-1).view(torch.uint8)
        return torch.equal(a8, b8)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    if hasattr(a, "tobytes") and hasattr(b, "tobytes") and type(a) is type(b):  # PIL images and the like
        return a.tobytes() == b.tobytes() and getattr(a, "size", None) == getattr(b, "size", None)
    try:
        return bool(a == b)
    except Exception:
        return False


def audit_augmentation(
    augment_fn: Callable[[Any, torch.Generator], Any],
    sample: Any,
    *,
    seed: int,
    stages: Sequence[str | int | tuple[str | int, ...]] = ("stage0", "stage1"),
) -> AugmentationReport:
    """Check that ``augment_fn(sample, generator)`` is reproducible from its generator alone.

    Runs the augmentation on copies of `sample` with generators from ``SeedChain(seed)``:
    twice with the same seed but different global RNG states (the output must not
    change), twice with the same seed and the same global state (it must not change
    either: otherwise it is nondeterministic), and once per stage in `stages` plus extra
    probe seeds, 16 in all (if every seed gives the same output, the stages share one
    random stream: the function ignores or re-seeds its generator; a stage is a name, a
    number or a tuple of those such as ``("worker", 3)``). Also reports global RNGs
    the function consumes and in-place changes to the sample. The caller's global RNG
    states are restored afterwards.
    """
    if not callable(augment_fn):
        raise TypeError(f"augment_fn must be callable as augment_fn(sample, generator); got {augment_fn!r}")
    _encode_part(seed)
    stages = list(stages)
    for stage in stages:
        for part in stage if isinstance(stage, tuple) else (stage,):
            _encode_part(part)
    if len(set(map(repr, stages))) != len(stages):
        raise ValueError(f"stages must be distinct; got {stages}")
    chain = SeedChain(seed)
    pristine = copy.deepcopy(sample)
    saved = _global_states()
    issues: list[DataIssue] = []
    name = getattr(augment_fn, "__qualname__", type(augment_fn).__name__)
    try:
        def run(stage: Any, global_seed: int) -> tuple[Any, list[str], bool, Any]:
            _seed_globals(global_seed)
            gen = chain.generator("audit", *(stage if isinstance(stage, tuple) else (stage,)))
            gen_before = gen.get_state()
            before = _global_states()
            work = copy.deepcopy(pristine)
            out = augment_fn(work, gen)
            used = _changed(before, _global_states())
            drew = not torch.equal(gen_before, gen.get_state())
            return out, used, drew, work

        first = stages[0] if stages else "stage0"
        out_a, used_a, drew_a, work_a = run(first, 1)
        out_b, used_b, _, _ = run(first, 2)  # same generator seed, global RNG elsewhere
        out_c, _, _, _ = run(first, 2)  # same generator seed, same global RNG
        global_used = sorted(set(used_a) | set(used_b))
        ab, bc = same_bits(out_a, out_b), same_bits(out_b, out_c)
        reproducible = ab and bc

        if not same_bits(work_a, pristine):
            issues.append(DataIssue(
                "sample_mutated", "sample", [],
                f"{name} modified the sample it was given in place; a dataset that caches "
                "samples accumulates augmentation from epoch to epoch.",
                "Clone the input before augmenting (x = x.clone()) or use out-of-place ops.",
                {}, severity="warning",
            ))
        if not bc:
            issues.append(DataIssue(
                "nondeterministic_augmentation", "augment_fn", [],
                f"{name} gave different outputs for the same generator seed and the same global RNG "
                "state: its randomness comes from somewhere nantrace cannot reseed (a generator "
                "created once and kept in a closure or attribute, time, os.urandom, "
                "nondeterministic kernels).",
                "Draw every random number from the generator passed in (torch.rand(..., "
                "generator=g), torch.randint(..., generator=g)); seed per-sample generators with "
                "derive_seed(base, epoch, index).",
                {"same_seed_same_global_equal": False},
            ))
        if global_used and not ab:
            issues.append(DataIssue(
                "global_rng_use", "augment_fn", [],
                f"{name} draws from the global {', '.join(global_used)} RNG: with the same generator "
                "seed its output changed when only the global RNG state changed, so reseeding its "
                "generator alone does not reproduce it (and DataLoader workers each have their own "
                "global state).",
                "Pass generator=g to every torch random call and use a numpy Generator / "
                "random.Random(seed) derived from the same seed instead of the module-level RNGs.",
                {"global_rngs": global_used, "output_changed": True},
            ))
        elif global_used:
            issues.append(DataIssue(
                "global_rng_use", "augment_fn", [],
                f"{name} consumes draws from the global {', '.join(global_used)} RNG (its output did "
                "not depend on them here, but it shifts the random stream of everything else).",
                "Use the generator passed in for every random draw.",
                {"global_rngs": global_used, "output_changed": False},
                severity="warning",
            ))

        # A low-entropy augmentation (a coin flip) can give two seeds the same output by
        # chance, so one identical pair proves nothing: the stream is shared only when the
        # output does not change across all stage seeds plus extra probe seeds.
        probes = list(stages) + [("probe", k) for k in range(max(0, _MIN_PROBES - len(stages)))]
        reference = run(probes[0], 3)[0]
        if all(same_bits(reference, run(stage, 3)[0]) for stage in probes[1:]):
            why = ("it never draws from the generator it is given" if not drew_a else
                   "it overrides or re-seeds the generator it is given")
            shown = " and ".join(repr(s) for s in stages[:2]) if len(stages) >= 2 else repr(probes[0])
            issues.append(DataIssue(
                "shared_random_stream", "augment_fn", [],
                f"stages {shown} (and {len(probes) - min(len(stages), 2)} more seeds) all produced "
                f"bit-identical output from different seeds: {why}, so every stage/worker repeats "
                "the same random sequence.",
                "Use the generator argument (do not create a generator with a fixed seed inside "
                "the augmentation); give each stage/worker its own seed, e.g. "
                "SeedChain(base).generator('worker', worker_id, 'crop').",
                {"stages": [list(s) if isinstance(s, tuple) else s for s in stages],
                 "seeds_tried": len(probes), "draws_from_generator": drew_a},
            ))
    finally:
        _set_global_states(saved)
    return AugmentationReport(issues=issues, reproducible=reproducible, draws_from_generator=drew_a,
                              global_rngs_used=global_used)
