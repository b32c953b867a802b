"""The two mechanisms behind round 8b's fixes, each on programs of different shapes.

1. **A write through ``p.data`` is a mark.** ``.data`` hands out an alias with a version counter of
   its own, so an in-place write into it moves neither the parameter's version nor its storage: the
   parameter provenance (nantrace/detection/param_provenance.py) used to carry a bound that no longer
   held until the next full read. The step's tapes see ``.data`` taken (they sit on the
   torch-function stack between steps, in the loss code and after ``backward()``); the provenance
   keeps the alias and its version, and a moved version marks the parameter for a read at the next
   check. Shown on checkpoint surgery (new vocabulary rows loaded into an embedding from a corrupted
   shard, rows no forward reads) and on a hand-written nGPT-style weight normalisation (a zero
   padding row divided by its zero norm), each never read by the forward: ``nonfinite_param`` at the
   first check after the write, ``raised`` before any parameter changed. An alias only read (an
   EMA) marks nothing; an alias held across steps is still watched; without tapes
   (``record_loss_code=False``) the write is found at the next full read, as documented.
2. **A loss scale the gradients cannot be unscaled from is a collapse before the update.** At scale
   0 the scaled gradients are all 0 (finite) and ``unscale_`` multiplies them by 1/0: NaN, which
   the scaler's own overflow check (made on the scaled values) misses. The step's figures make the
   gradients unknown (never proven), and ``scaler.step`` reports ``scaler_collapse`` at that step
   with the update withheld. Shown with ``init_scale=0`` (bfloat16 autocast), a scale set to 0 by
   ``scaler.update(new_scale=0.)`` mid-run (float16), the user's own ``unscale_`` + clipping at scale
   0, and a usable scale below ``scaler_min_scale`` on a step the scaler would apply.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from conftest import same_state, snapshot
from nantrace.detection.scaler import ScalerMonitor, unusable_scale
from nantrace.detection.sentinel import finish, stage
from nantrace.response.update_bounds import param_bound_after

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")]


def _quiet(**groups: Any) -> nantrace.Config:
    return nantrace.Config.preset("default", outputs={"print_incidents": False}, **groups)


def _key(incident: Any) -> tuple[int, str, str, str]:
    return incident.step, incident.kind, incident.cause, incident.action


# ============================================================================ 1. writes through .data
class Tagger(nn.Module):
    """A bag-of-words tagger whose vocabulary was extended: ids >= ``used`` exist in the table but no
    batch holds them yet (the forward never reads their rows)."""

    def __init__(self, vocab: int = 48, used: int = 40, dim: int = 12) -> None:
        super().__init__()
        self.used = used
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


class NormalisedLM(nn.Module):
    """An nGPT-style model: embedding rows kept on the unit sphere by hand after each update; row 0 is
    the padding token (zero from its initialisation, never in a batch)."""

    def __init__(self, vocab: int = 30, dim: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, padding_idx=0)
        self.mix = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim))
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.mix(self.tok(ids)).mean(1))


def load_extra_rows(model: Tagger, shard: dict[str, torch.Tensor]) -> None:
    """Checkpoint surgery: the rows of the new tokens come from a separate shard, copied in through
    ``.data`` (no autograd, no version bump on the parameter)."""
    model.emb.weight.data[model.used:] = shard["extra_rows"]


def normalise_rows(model: NormalisedLM) -> None:
    """The hand-written weight normalisation of nGPT: every embedding row divided by its norm (the zero
    padding row becomes 0/0 = NaN)."""
    table = model.tok.weight.data
    table.div_(table.norm(dim=-1, keepdim=True))


def _tagger_batch(g: torch.Generator, model: Tagger) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, model.used, (8, 5), generator=g), torch.randint(0, 4, (8,), generator=g)


def _lm_batch(g: torch.Generator, model: NormalisedLM) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(1, 30, (6, 7), generator=g), torch.randint(1, 30, (6,), generator=g)


def _run_plain_loop(model: nn.Module, batch: Callable[[torch.Generator, Any], Any], *, steps: int,
                    between: Callable[[int], None], config: nantrace.Config | None = None,
                    after_step: Callable[[int, Any], None] | None = None) -> dict[str, Any]:
    """A plain AdamW loop (decoupled decay: the provenance tracker is on). ``between(step)`` runs before
    the step's forward (the code between two steps), ``after_step(step, guard)`` after its update. Stops
    at the first ``NonFiniteError``; returns the incidents, the step it raised at, and whether the
    weights and optimizer state at the raise are the ones right before that step's ``optimizer.step()``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    guard = nantrace.watch(model, opt, config=config or _quiet())
    g = torch.Generator().manual_seed(7)
    out: dict[str, Any] = {"raised_at": None, "unchanged": None, "guard": guard}
    try:
        for step in range(steps):
            with torch.no_grad():
                between(step)
            x, y = batch(g, model)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            before = snapshot(model, opt)
            try:
                opt.step()
            except nantrace.NonFiniteError:
                out["raised_at"], out["unchanged"] = step, same_state(before, snapshot(model, opt))
                break
            if after_step is not None:
                with torch.no_grad():
                    after_step(step, guard)
    finally:
        guard.close()
    out["incidents"] = [_key(i) for i in guard.incidents]
    out["first"] = guard.incidents[0] if guard.incidents else None
    return out


def _surgery(model: Tagger, at: int, busy: int = 0) -> Callable[[int], None]:
    """Load the corrupted rows at step ``at``, after ``busy`` small torch calls (an evaluation between the
    steps: enough of them, and the prelude stops recording, while staying on the torch-function stack)."""
    extra = len(model.emb.weight) - model.used
    shard = {"extra_rows": torch.full((extra, model.emb.embedding_dim), math.nan)}  # a corrupted shard

    def between(step: int) -> None:
        if step == at:
            total = torch.zeros(())
            for _ in range(busy):
                total = total + 1.0
            load_extra_rows(model, shard)

    return between


@pytest.mark.parametrize("busy", [0, 3100])
def test_checkpoint_surgery_through_data_is_reported_at_the_next_check(busy):
    from nantrace.loss_tape import PRELUDE_ENTRIES, PRELUDE_RESTARTS

    assert busy == 0 or busy > PRELUDE_ENTRIES * (PRELUDE_RESTARTS + 1)
    torch.manual_seed(0)
    model = Tagger()
    run = _run_plain_loop(model, _tagger_batch, steps=10, between=_surgery(model, 3, busy))
    assert run["incidents"] == [(3, "nonfinite_param", "nonfinite_param", "raised")]
    assert run["raised_at"] == 3 and run["unchanged"] is True  # raised before the update touched anything
    first = run["first"]
    assert first.module == "emb" and first.phase is None
    assert "left it finite" in first.summary and "params_last_read" not in first.details  # a mark, not a stale bound
    assert torch.isnan(model.emb.weight[model.used:]).all() and torch.isfinite(model.emb.weight[:model.used]).all()


def test_hand_written_weight_normalisation_through_data_is_reported_at_the_next_check():
    torch.manual_seed(1)
    model = NormalisedLM()
    assert not model.tok.weight[0].any()  # the padding row starts at zero

    def normalise(step: int, guard: Any) -> None:
        if step >= 4:  # normalisation switched on after a warm-up, right after the update
            normalise_rows(model)

    run = _run_plain_loop(model, _lm_batch, steps=9, between=lambda step: None, after_step=normalise)
    assert run["incidents"] == [(5, "nonfinite_param", "nonfinite_param", "raised")]
    assert run["raised_at"] == 5 and run["unchanged"] is True
    assert run["first"].module == "tok"
    assert torch.isnan(model.tok.weight[0]).all() and torch.isfinite(model.tok.weight[1:]).all()


def test_an_alias_held_across_steps_is_still_watched():
    """A surgery helper keeps ``model.emb.weight.data`` from step 2 and writes into it at step 6: the alias
    taken while the prelude recorded is looked at, weakly, at every check until it is dropped."""
    torch.manual_seed(2)
    model = Tagger()
    held: dict[str, torch.Tensor] = {}

    def between(step: int) -> None:
        if step == 2:
            held["table"] = model.emb.weight.data
        if step == 6:
            held["table"][model.used:] = math.inf

    run = _run_plain_loop(model, _tagger_batch, steps=10, between=between)
    assert run["incidents"] == [(6, "nonfinite_param", "nonfinite_param", "raised")]
    assert run["raised_at"] == 6 and run["unchanged"] is True


def test_reading_data_marks_nothing():
    """An EMA of the weights read through ``.data`` every step: no write, so the checks between the full
    reads read no parameter at all."""
    torch.manual_seed(3)
    model = Tagger()
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    marked: list[list[int] | None] = []

    def between(step: int) -> None:
        for name, p in model.named_parameters():
            ema[name].mul_(0.9).add_(p.data, alpha=0.1)

    run = _run_plain_loop(model, _tagger_batch, steps=12, between=between,
                          after_step=lambda step, guard: marked.append(guard.judge.provenance.marked))
    prov = run["guard"].judge.provenance
    assert run["incidents"] == [] and prov.enabled
    assert marked[1:] == [[]] * 11  # known finite from step 1 on: nothing written outside the optimizer
    assert (prov.full_steps, prov.partial_steps) == (1, 11)


def test_without_tapes_a_data_write_waits_for_the_next_full_read():
    """What stays uncovered: with ``record_loss_code=False`` no tape sees ``.data`` taken, so the write
    is found at the next full read (``param_check_every`` = 16), and the incident says since when the
    parameters were only known from their provenance."""
    torch.manual_seed(0)
    model = Tagger()
    run = _run_plain_loop(model, _tagger_batch, steps=18, between=_surgery(model, 3),
                          config=_quiet(localisation={"record_loss_code": False}))
    assert run["incidents"] == [(16, "nonfinite_param", "nonfinite_param", "raised")]
    assert run["raised_at"] == 16 and run["unchanged"] is True
    assert run["first"].details["params_last_read"] == 0


# ============================================================================ 2. unusable loss scales
class Meter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 24), nn.Linear(24, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x))).float()


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 6, 3, padding=1)
        self.norm = nn.LayerNorm(6 * 10)
        self.head = nn.Linear(6 * 10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(F.relu(self.conv(x)).flatten(1))).float()


def _meter_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :1] - x[:, 1:2]


def _conv_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 2, 10, generator=g), torch.randint(0, 3, (8,), generator=g)


def _amp_loop(model: nn.Module, batch: Callable[[torch.Generator], Any], loss: Callable[..., torch.Tensor], *,
              dtype: torch.dtype, init_scale: float, steps: int, config: nantrace.Config | None = None,
              before: Callable[[int, torch.amp.GradScaler], None] | None = None,
              unscale_and_clip: bool = False) -> dict[str, Any]:
    """A CPU autocast loop with a GradScaler handed to ``watch``; per step, whether the weights changed."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    guard = nantrace.watch(model, opt, scaler=scaler, config=config or _quiet())
    g = torch.Generator().manual_seed(5)
    changed, error = [], None
    try:
        for step in range(steps):
            if before is not None:
                before(step, scaler)
            x, y = batch(g)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                value = loss(model(x), y)
            scaler.scale(value).backward()
            if unscale_and_clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            start = snapshot(model)
            try:
                scaler.step(opt)
            except nantrace.NonFiniteError as exc:
                error = exc
                changed.append(not same_state(start, snapshot(model)))
                break
            scaler.update()
            changed.append(not same_state(start, snapshot(model)))
    finally:
        guard.close()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {"incidents": [_key(i) for i in guard.incidents], "changed": changed, "finite": finite, "error": error,
            "first": guard.incidents[0] if guard.incidents else None, "scaler": scaler}


def test_init_scale_zero_is_a_collapse_at_step_0_and_nothing_is_applied():
    torch.manual_seed(0)
    model = Meter()
    start = snapshot(model)
    run = _amp_loop(model, _meter_batch, F.mse_loss, dtype=torch.bfloat16, init_scale=0.0, steps=4)
    assert run["incidents"] == [(0, "scaler_collapse", "scaler_collapse", "skipped")]
    assert run["error"] is None and run["changed"] == [False] * 4 and same_state(start, snapshot(model))
    assert "loss scale is 0" in run["first"].summary and run["first"].details["scale"] == 0.0
    assert run["first"].details["count"] == 4  # every later step joins the collapse: still withheld


def test_a_scale_set_to_zero_mid_run_is_a_collapse_at_that_step():
    """``scaler.update(new_scale=0.)`` from a config that meant "dynamic": the steps before train, the first
    step at scale 0 is the collapse, and no update lands from there on."""
    torch.manual_seed(1)
    model = ConvNet()
    weights: dict[int, dict[str, Any]] = {}

    def before(step: int, scaler: torch.amp.GradScaler) -> None:
        weights[step] = snapshot(model)
        if step == 3:
            scaler.update(new_scale=0.0)

    run = _amp_loop(model, _conv_batch, F.cross_entropy, dtype=torch.float16, init_scale=2.0**8, steps=6,
                    before=before)
    assert run["incidents"] == [(3, "scaler_collapse", "scaler_collapse", "skipped")]
    assert run["changed"] == [True, True, True, False, False, False] and run["finite"]
    assert same_state(weights[3], snapshot(model))


def test_unscale_and_clip_at_scale_zero_is_a_collapse_not_a_calibration_skip():
    """The user unscales before clipping: the gradients the step's check reads are already NaN (0 × inf),
    which alone would read as the scaler's calibration; the scaler would not skip (its overflow check saw
    zeros), so the scale itself is the collapse, and the update is withheld."""
    torch.manual_seed(2)
    model = Meter()
    start = snapshot(model)
    run = _amp_loop(model, _meter_batch, F.mse_loss, dtype=torch.bfloat16, init_scale=0.0, steps=3,
                    unscale_and_clip=True)
    assert run["incidents"] == [(0, "scaler_collapse", "scaler_collapse", "skipped")]
    assert run["changed"] == [False] * 3 and same_state(start, snapshot(model))


def test_a_usable_scale_below_the_floor_is_a_collapse_before_its_update():
    """``init_scale=0.5``: the gradients unscale exactly, but the scaler shrinks them (``scaler_min_scale``
    = 1): a collapse at step 0, judged before the update it withholds; with the floor at 0 the run trains."""
    torch.manual_seed(3)
    model = Meter()
    start = snapshot(model)
    run = _amp_loop(model, _meter_batch, F.mse_loss, dtype=torch.bfloat16, init_scale=0.5, steps=2)
    assert run["incidents"] == [(0, "scaler_collapse", "scaler_collapse", "skipped")]
    assert run["changed"] == [False, False] and same_state(start, snapshot(model))
    assert "below the floor 1" in run["first"].summary
    free = _amp_loop(Meter(), _meter_batch, F.mse_loss, dtype=torch.bfloat16, init_scale=0.5, steps=2,
                     config=_quiet(detection={"scaler_min_scale": 0.0}))
    assert free["incidents"] == [] and free["changed"] == [True, True]


def test_a_collapse_under_raise_books_the_step_and_changes_nothing():
    torch.manual_seed(4)
    model = Meter()
    start = snapshot(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=0.0)
    guard = nantrace.watch(model, opt, scaler=scaler, config=_quiet(), on_anomaly="raise")
    x, y = _meter_batch(torch.Generator().manual_seed(0))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value = F.mse_loss(model(x), y)
        scaler.scale(value).backward()
        with pytest.raises(nantrace.NonFiniteError) as err:
            scaler.step(opt)
    finally:
        guard.close()
    assert _key(err.value.incident) == (0, "scaler_collapse", "scaler_collapse", "raised")
    assert guard.step == 1 and same_state(start, snapshot(model))


# ---------------------------------------------------------------------------- the parts
@pytest.mark.parametrize("scale, unusable", [
    (0.0, True), (-0.0, True), (1e-40, True), (math.inf, True), (2.0**-120, False), (0.5, False), (65536.0, False),
    (None, False), (math.nan, False),
])
def test_which_scales_cannot_be_unscaled_from(scale, unusable):
    assert (unusable_scale(scale) is not None) is unusable


def test_a_zero_scale_leaves_the_step_gradient_norm_unknown_and_the_update_unproven():
    """The step's figures at scale 0: the scaled gradients are 0, their unscaled norm is unknown (``None``
    on the host, NaN on the device), so no bound proves the update; a usable scale divides as before."""
    grads = [torch.zeros(4, 3), torch.zeros(3)]
    params = [torch.ones(4, 3), torch.ones(3)]
    for scale, expect in ((0.0, None), (4.0, 0.5)):
        staged = stage(grads=[g + (2.0 if scale else 0.0) for g in grads], params=params, losses=[torch.tensor(1.0)],
                       inputs_ok=None, outputs_ok=None, scale=torch.tensor(scale), grads_scaled=True)
        health = finish(staged, staged.vector.tolist())
        device = float(staged.unscaled_grad_norm64())
        if expect is None:
            assert health.grad_norm is None and all(math.isnan(n) for n in health.grad_norms) and math.isnan(device)
        else:
            assert health.grad_norm == pytest.approx(math.sqrt(15) * 2 / scale) and device == pytest.approx(
                health.grad_norm)
    opt = torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=0.1)
    assert param_bound_after(opt, opt.param_groups[0], grad=None, param=1.0, state=0.0) is None


def test_the_monitor_books_a_step_it_judged_before_the_update_as_a_skip():
    m = ScalerMonitor(max_skips=4, min_scale=1.0)
    first = m.before_update(scale=0.0, skipping=False)
    assert first is not None and not first.continuing and m.collapsed
    assert m.update(skipped=False, scale=0.0) is None and m.consecutive_skips == 1 and m.level is None
    again = m.before_update(scale=0.0, skipping=False)
    assert again is not None and again.continuing and again.consecutive_skips == 2
    m.update(skipped=False, scale=0.0)
    assert m.before_update(scale=256.0, skipping=False) is None
    assert m.update(skipped=False, scale=256.0) is None and not m.collapsed and m.level == 256.0
    assert m.before_update(scale=0.25, skipping=True) is None  # the scaler skips: judged with the skip, after
