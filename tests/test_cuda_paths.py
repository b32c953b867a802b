"""The CUDA paths: fp16 with a GradScaler, bf16 autocast, the CUDA RNG in a replay, the
sync-free mode, and the host synchronisations per step counted by CUDA itself.

Every test here runs the same program on the CPU and, where a GPU is present, on CUDA, and
asserts the same exact diagnosis on both: the CPU case checks the test itself on every
machine, the CUDA case checks nantrace's device paths (run them on a lent GPU with
``python -m pytest tests/test_cuda_paths.py``). The synchronisation count uses
``torch.cuda.set_sync_debug_mode``, an oracle that shares no code with
:mod:`nantrace.testing.host_reads`.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from nantrace.testing.host_reads import HostReadCounter

from test_amp_scaler import _fp16_run
from test_sync_free import FIRST, SCENARIOS, TinyGPT, _train, assert_same_as_sync

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a lent GPU machine)")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _quiet(**detection) -> nantrace.Config:
    return nantrace.Config(outputs={"print_incidents": False}, detection=detection)


def _first(guard) -> tuple:
    i = guard.incidents[0]
    return i.step, i.kind, i.cause, i.op, i.module, i.action


# ---------------------------------------------------------------------------------------------
# sync-free: the same weights and incidents as the synchronous check, on the device it is made for


@CUDA
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_sync_free_on_cuda_gives_the_synchronous_weights_and_the_designed_diagnosis(scenario):
    sync = _train(scenario, False, "cuda")
    auto = _train(scenario, "auto", "cuda")  # "auto" is sync-free on a GPU with a fused optimizer
    assert_same_as_sync(auto, sync, scenario)
    if scenario != "healthy":
        assert sync["incidents"][0] == FIRST[scenario]


def _bn_mlp(device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def _count_syncs(device: str, sync_free: bool | str | None, steps: int = 60) -> tuple[list[list[str]], list[int], object]:
    """Per step: where CUDA reports a synchronisation (``set_sync_debug_mode``: the Python line
    that caused it) and how many reads the counter sees; ``sync_free=None``: no guard at all."""
    model, opt = _bn_mlp(device)
    guard = None if sync_free is None else nantrace.watch(model, opt, config=_quiet(sync_free=sync_free))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=gen).to(device), torch.randn(16, 1, generator=gen).to(device))
               for _ in range(steps)]
    if device == "cuda":
        torch.cuda.synchronize()
    syncs, reads_per_step = [], []
    with HostReadCounter() as reads:
        for x, y in batches:
            reads.reset()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    opt.zero_grad()
                    F.mse_loss(model(x), y).backward()
                    opt.step()
                finally:
                    if device == "cuda":
                        torch.cuda.set_sync_debug_mode("default")
            syncs.append([f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno}" for w in caught
                          if "synchroniz" in str(w.message)])
            reads_per_step.append(reads.count)
    if guard is not None:
        guard.close()
    return syncs, reads_per_step, guard


@CUDA
def test_cuda_itself_counts_one_sync_per_step_and_none_in_sync_free_mode():
    """CUDA's own count: the loop without nantrace synchronises nowhere after its first step
    (torch's one-time set-up, which a guard's ``watch()`` has already done); the synchronous
    mode adds one synchronisation a step, the sync-free mode none after the first step."""
    plain, _, _ = _count_syncs("cuda", None)
    assert plain[1:] == [[]] * 59, plain[:3]
    sync, reads, guard = _count_syncs("cuda", False)
    assert guard.sync_free is None and guard.incidents == []
    assert reads == [1] * 60
    assert [len(s) for s in sync] == [1] * 60, f"synchronous mode: {[(i, s) for i, s in enumerate(sync) if len(s) != 1]}"
    free, reads, guard = _count_syncs("cuda", "auto")
    assert guard.sync_free is not None and guard.incidents == []
    assert reads == [1] + [0] * 59
    assert [len(s) for s in free] == [1] + [0] * 59, f"sync-free: {[(i, s) for i, s in enumerate(free) if s]}"


@pytest.mark.parametrize("device", DEVICES)
def test_the_counter_agrees_on_every_device(device):
    _, reads, guard = _count_syncs(device, False, steps=30)
    assert reads == [1] * 30 and guard.incidents == []


# ---------------------------------------------------------------------------------------------
# fp16 with a GradScaler


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_scaler_calibration_is_not_an_incident(device):
    guard, scaler, error = _fp16_run(2.0**24, 30, config=_quiet(), device=device)
    assert error is None and guard.incidents == []
    assert guard.scaler_monitor.total_skips == 6 and scaler.get_scale() == 2.0**18
    assert guard.sync_free is None, "a GradScaler owns found_inf: the synchronous check"


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_persistent_overflow_is_called_at_its_first_skip(device):
    guard, _, error = _fp16_run(2.0**16, 50, config=_quiet(), collapse_at=30, device=device)
    first = guard.incidents[0]
    assert (first.step, first.kind, first.cause, first.phase, first.action, first.op, first.module) == (
        30, "scaler_collapse", "scaler_collapse", "backward", "skipped", "aten.mm.default", "0")
    assert first.details["replayed_at_scale_one"] == "non-finite"
    assert first.details["origin_cause"] == "precision_overflow"
    assert [t["name"] for t in first.details["nonfinite_grads"]] == ["0.weight"]
    assert isinstance(error, nantrace.NonFiniteError)


class Wide(nn.Module):
    """A projection whose output leaves float16's range when its input grows."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.proj(x)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("row, op", [
    (1e5, "aten._to_copy.default"),  # the row itself leaves float16's range where autocast casts it
    (2e4, "aten.addmm.default"),  # the row fits; its projection (16 × 2e4 × w ≥ 0.1) does not
])
def test_fp16_forward_overflow_under_a_scaler_names_the_projection(device, row, op):
    torch.manual_seed(0)
    model = Wide().to(device)
    with torch.no_grad():
        model.proj.weight.abs_().add_(0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
    guard = nantrace.watch(model, opt, scaler, config=_quiet())
    gen = torch.Generator().manual_seed(2)
    for step in range(6):
        x = torch.randn(32, 16, generator=gen)
        if step == 4:
            x[5] = row  # an unnormalised feature row
        x = x.to(device)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), torch.zeros(32, 1, device=device))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    guard.close()
    inc = guard.incidents[0]
    assert (inc.step, inc.kind, inc.cause, inc.op, inc.module, inc.phase, inc.action) == (
        4, "nonfinite_loss", "precision_overflow", op, "proj", "forward", "skipped")


# ---------------------------------------------------------------------------------------------
# bf16 autocast


class LogFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_gpt_loss_code_division_is_localised(device):
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = nantrace.watch(model, opt, config=_quiet())
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        ids = torch.randint(0, 32, (4, 8), generator=gen).to(device)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(ids).float()
        if step == 4:
            logits = logits / (logits - logits)
        F.cross_entropy(logits.reshape(-1, 32), torch.roll(ids, -1, 1).reshape(-1)).backward()
        opt.step()
    guard.close()
    assert _first(guard) == (4, "nonfinite_loss", "div_by_zero", "aten.div.Tensor", None, "skipped")
    assert len(guard.incidents) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_forward_log_of_a_negative_names_the_module(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), LogFeatures(), nn.Linear(16, 1)).to(device)
    with torch.no_grad():
        model[0].bias.fill_(1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = nantrace.watch(model, opt, config=_quiet())
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        x = torch.rand(16, 8, generator=gen) * 0.01
        if step == 3:
            x = x - 1e4  # every ReLU output is 0: log(0) = -inf
        x = x.to(device)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16):
            out = model(x)
        F.mse_loss(out.float(), torch.zeros(16, 1, device=device)).backward()
        opt.step()
    guard.close()
    inc = guard.incidents[0]
    assert (inc.step, inc.kind, inc.cause, inc.op, inc.module, inc.phase) == (
        3, "nonfinite_loss", "log_nonpositive", "aten.log.default", "2", "forward")


# ---------------------------------------------------------------------------------------------
# the RNG in a replay


class MaskedLog(nn.Module):
    """A log whose argument is negative only for rare dropout masks (a row keeping 20 of 64 or
    fewer: 3 % of the steps of a batch of 16): the replay reproduces the failure only if it
    draws the very masks the step drew."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.lin = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = self.drop(torch.ones_like(x)).sum(1, keepdim=True)  # 2 × Binomial(64, 0.5)
        return self.lin(x) + 1e-3 * torch.log(kept - 41.0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_failure_that_depends_on_the_dropout_mask_reproduces_in_the_replay(device):
    torch.manual_seed(0)
    model = MaskedLog().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = nantrace.watch(model, opt, config=_quiet())
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)).to(device)
    for step in range(300):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if guard.incidents:
            break
    else:
        pytest.fail("no row kept 20 of 64 or fewer (the odds are 3 % a step)")
    # the next forward draws from the RNG where the failing step left it: the replay put it back
    expected_next = model.drop(torch.ones(16, 64, device=device))
    guard.close()
    inc = guard.incidents[0]
    assert (inc.cause, inc.op, inc.module, inc.phase) == ("log_nonpositive", "aten.log.default", "", "forward")
    assert inc.transient is not True, "the replay drew another mask: the RNG of the step was not restored"
    torch.manual_seed(0)
    replica = MaskedLog().to(device)
    for _ in range(inc.step + 1):
        replica(x)
    assert torch.equal(replica.drop(torch.ones(16, 64, device=device)), expected_next), \
        "the RNG after the step differs from a run without nantrace"


@pytest.mark.parametrize("device", DEVICES)
def test_the_norms_gather_into_a_reused_buffer_with_the_values_of_a_stack(device):
    """The accelerator's gather (one ``_foreach_copy_`` instead of a copy per value) gives what
    ``torch.stack`` gives, step after step, in the same buffer; mixed dtypes fall back."""
    from nantrace.detection import sentinel

    dev = torch.device(device)
    first = [torch.tensor(float(i), device=dev) for i in range(300)]
    got = sentinel._gather(first, dev)
    assert torch.equal(got, torch.stack(first))
    second = [torch.tensor(float("nan") if i == 7 else -float(i), device=dev) for i in range(300)]
    again = sentinel._gather(second, dev)
    assert again.data_ptr() == got.data_ptr()
    assert torch.equal(torch.nan_to_num(again, 9.0), torch.nan_to_num(torch.stack(second), 9.0))
    assert sentinel._gather([torch.ones((), device=dev), torch.ones((), dtype=torch.float64, device=dev)], dev) is None
    if device == "cuda":
        assert torch.equal(sentinel._stack_on(second[:20], dev).cpu().nan_to_num(9.0),
                           torch.stack(second[:20]).cpu().nan_to_num(9.0))
