"""The sync-free mode (nantrace/sync_free.py): each step decided on the device, handed to a fused
optimizer as ``found_inf``, read by the host one step later. Asserted against the synchronous
mode run on the same data: the same weights and optimizer state bit for bit, the same incidents
(step, kind, cause, op, module, action), the same exceptions before the same update; zero host
reads per step in the steady state; a clear refusal where the mode cannot be exact."""

from __future__ import annotations

import copy
import functools
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from nantrace.detection.divergence import DivergenceDetector
from nantrace.testing.host_reads import HostReadCounter

SENTINEL = "tolist@nantrace/detection/sentinel.py"


class TinyGPT(nn.Module):
    """Token embedding, one pre-norm attention block, a head: the shape of a small GPT."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(8, dim))
        self.block = nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.1, batch_first=True, norm_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        return self.head(self.block(self.emb(ids) + self.pos[: ids.shape[1]], src_mask=mask, is_causal=True))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))


# scenario -> (model, policy, steps, what goes wrong)
SCENARIOS = {
    "nan_input": ("mlp", "skip", 40),
    "loss_code_log_of_negative": ("mlp", "skip", 40),
    "backward_sqrt_at_zero": ("mlp", "skip", 40),
    "loss_spike": ("mlp", "skip", 60),
    "divergence": ("mlp", "skip", 50),
    "gpt_nan_logits": ("gpt", "skip", 30),
    "raise_policy": ("mlp", "raise", 40),
    "ladder_pauses": ("mlp", "skip", 40),
    "param_written_between_steps": ("mlp", "skip", 40),
    "healthy": ("gpt", "skip", 30),
}


@functools.lru_cache(maxsize=None)
def _train(scenario: str, sync_free: bool | str, device: str = "cpu") -> dict:
    """One run of the scenario (cached: the tests below only read the result). The batches are
    drawn on the CPU and moved to ``device`` (tests/test_cuda_paths.py runs these on a GPU)."""
    kind, policy, steps = SCENARIOS[scenario]
    torch.manual_seed(0)
    model = (TinyGPT() if kind == "gpt" else _mlp()).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    cfg = nantrace.Config(outputs={"print_incidents": False}, detection={"sync_free": sync_free})
    guard = nantrace.watch(model, opt, config=cfg, on_anomaly=policy)
    gen = torch.Generator().manual_seed(1)
    raised_at = None
    for step in range(steps):
        if kind == "gpt":
            x = torch.randint(0, 32, (4, 8), generator=gen)
            y = torch.roll(x, -1, 1)
        else:
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
        x, y = x.to(device), y.to(device)
        if scenario in ("nan_input", "raise_policy") and step in (7, 20):
            x[3, 2] = float("nan")
        if scenario == "ladder_pauses" and 10 <= step < 18:
            x[0, 0] = float("nan")
        if scenario == "loss_spike" and step == 45:
            y = y * 1000
        if scenario == "divergence" and step >= 36:
            y = y * 6.0 ** (step - 35)
        if scenario == "param_written_between_steps" and step == 15:
            with torch.no_grad():
                model[0].weight[0, 0] = float("inf")
        opt.zero_grad()
        try:
            out = model(x)
            if kind == "gpt":
                logits = out.float()
                if scenario == "gpt_nan_logits" and step == 12:
                    logits = logits / (logits - logits)  # 0/0 in the loss code
                loss = F.cross_entropy(logits.reshape(-1, 32), y.reshape(-1))
            elif scenario == "loss_code_log_of_negative":
                margin = out - 10.0 if step == 9 else out.abs() + 10.0  # negative only at step 9
                loss = F.mse_loss(out, y) + 1e-3 * torch.log(margin).mean()
            elif scenario == "backward_sqrt_at_zero":
                z = (out * 0).sum() if step == 12 else out.pow(2).mean()
                loss = F.mse_loss(out, y) + 0.0 * torch.sqrt(z)
            else:
                loss = F.mse_loss(out, y)
            loss.backward()
            opt.step()
        except nantrace.NonFiniteError:
            raised_at = step
            break
    guard.close()
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": copy.deepcopy(opt.state_dict()["state"]),
        "incidents": [(i.step, i.kind, i.cause, i.op, i.module, i.action) for i in guard.incidents],
        "raised_at": raised_at,
        "device_steps": guard.sync_free.steps if guard.sync_free is not None else 0,
        "mismatch": [i.details.get("sync_free_mismatch") for i in guard.incidents if "sync_free_mismatch" in i.details],
    }


def _same_tensors(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if not _same_tensors(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not (x.shape == y.shape and torch.equal(torch.nan_to_num(x, 7.0, 8.0, -8.0), torch.nan_to_num(y, 7.0, 8.0, -8.0))):
                return False
        elif x != y:
            return False
    return True


def assert_same_as_sync(free: dict, sync: dict, scenario: str) -> None:
    """A sync-free run against the synchronous one of the same scenario: the same incidents,
    weights and optimizer state, no host-device disagreement, a stop one step later."""
    assert free["device_steps"] >= 0.8 * SCENARIOS[scenario][2] if free["raised_at"] is None else free["device_steps"] > 5
    assert free["mismatch"] == []
    assert free["incidents"] == sync["incidents"]
    assert _same_tensors(free["state"], sync["state"]) and _same_tensors(free["opt"], sync["opt"])
    if scenario == "healthy":
        assert sync["incidents"] == []
    else:
        assert sync["incidents"], "the scenario must produce an incident"
    # a stopping action raises one step later, before that step's update lands
    assert free["raised_at"] == (None if sync["raised_at"] is None else sync["raised_at"] + 1)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_sync_free_gives_the_synchronous_weights_and_incidents(scenario):
    assert_same_as_sync(_train(scenario, sync_free=True), _train(scenario, sync_free=False), scenario)


FIRST = {
    "nan_input": (7, "nonfinite_input", "nonfinite_input", None, None, "skipped"),
    "loss_code_log_of_negative": (9, "nonfinite_loss", "log_nonpositive", "aten.log.default", None, "skipped"),
    "backward_sqrt_at_zero": (12, "nonfinite_grad", "grad_singularity", "aten.sqrt.default", None, "skipped"),
    "gpt_nan_logits": (12, "nonfinite_loss", "div_by_zero", "aten.div.Tensor", None, "skipped"),
    "loss_spike": (45, "loss_spike", "loss_divergence", None, None, "skipped"),
    "divergence": (36, "loss_spike", "loss_divergence", None, None, "skipped"),
    "raise_policy": (7, "nonfinite_input", "nonfinite_input", None, None, "raised"),
    "ladder_pauses": (10, "nonfinite_input", "nonfinite_input", None, None, "skipped"),
    "param_written_between_steps": (15, "nonfinite_param", "nonfinite_param", None, "0", "raised"),
}
"""Each scenario's first incident: (step, kind, cause, op, module, action)."""


@pytest.mark.parametrize("scenario, first", list(FIRST.items()))
def test_the_scenarios_are_diagnosed_as_designed(scenario, first):
    """The incidents both modes agree on are the right ones (not only the same ones): found one
    step late, the sync-free step is still localised (op, cause) from what was kept of it."""
    assert _train(scenario, sync_free=True)["incidents"][0] == first
    if scenario == "ladder_pauses":  # the escalation ladder stops the run after 5 skips in a row
        assert _train(scenario, sync_free=True)["incidents"][1][::5] == (15, "paused")


def test_zero_host_reads_per_step_in_the_steady_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    auto = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    assert auto.sync_free is None  # "auto" on the CPU: a read drains no queue, the synchronous check is cheaper
    auto.close()
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False},
                                                              detection={"sync_free": True}))
    gen = torch.Generator().manual_seed(1)
    ours = []
    with HostReadCounter() as reads:
        for _ in range(60):  # covers every sampled statistic of the default preset
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
            reads.reset()
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            ours.append([f"{e.how}@{e.where.rsplit(':', 1)[0]}" for e in reads.events])
    guard.close()
    # the first step is read (no update has landed yet); every later one is decided on the device
    assert ours == [[SENTINEL]] + [[]] * 59
    assert guard.sync_free.summary() == {"device_steps": 59, "host_steps": {
        "no update has landed yet (the optimizer state is made by the first one)": 1}}
    assert guard.step == 60 and guard.last_step["step"] == 59 and guard.incidents == []


@pytest.mark.parametrize("make, why", [
    (lambda m: dict(optimizer=torch.optim.AdamW(m.parameters())), "is not a fused optimizer"),
    (lambda m: dict(optimizer=torch.optim.SGD(m.parameters(), lr=0.1, foreach=True)), "is not a fused optimizer"),
    (lambda m: dict(optimizer=torch.optim.AdamW(m.parameters(), fused=True), on_anomaly="rollback"), "rollback"),
    (lambda m: dict(optimizer=torch.optim.AdamW(m.parameters(), fused=True),
                    scaler=torch.amp.GradScaler("cpu")), "GradScaler"),
])
def test_sync_free_true_is_refused_clearly_where_it_cannot_be_exact(make, why):
    from nantrace import patches

    model = _mlp()
    kwargs = make(model)
    before = patches.installed()
    cfg = nantrace.Config(outputs={"print_incidents": False}, detection={"sync_free": True})
    with pytest.raises(ValueError, match=why):
        nantrace.watch(model, config=cfg, **kwargs)
    assert patches.installed() == before and not model._forward_hooks and not model._forward_pre_hooks
    # "auto" simply keeps the synchronous check there
    cfg = nantrace.Config(outputs={"print_incidents": False}, detection={"sync_free": "auto"})
    guard = nantrace.watch(model, config=cfg, **kwargs)
    assert guard.sync_free is None
    guard.close()


def test_an_incident_found_at_the_last_step_is_recorded_at_close():
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    guard = nantrace.watch(model, opt, on_anomaly="raise", config=nantrace.Config(
        outputs={"print_incidents": False}, detection={"sync_free": True}))
    for step in range(5):
        x = torch.randn(4, 8)
        if step == 4:
            x[0, 0] = float("nan")
        opt.zero_grad()
        F.mse_loss(model(x), torch.zeros(4, 1)).backward()
        opt.step()  # step 4 is skipped on the device; the host learns it only at close()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    guard.close()  # records, never raises
    [incident] = guard.incidents
    assert (incident.step, incident.kind, incident.action) == (4, "nonfinite_input", "raised")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


def test_divergence_firing_ranges_agree_with_the_detector_itself():
    """The fast mechanism (bounds computed from the state) against the slow reference (a copy of
    the detector fed the value): every verdict the same on random runs that grow, fluctuate and spike."""
    rnd = random.Random(0)
    agree = fired = 0
    runs = 60  # 36,000 verdicts compared (each against a deep copy of the detector: the test's whole cost)
    for _ in range(runs):
        det = DivergenceDetector(min_steps=4, min_factor=4.0)
        mode = rnd.choice(["noise", "grow", "growgrad", "spiky"])
        loss, g = 2.0, 1.0
        for step in range(100):
            if mode == "grow" and step > rnd.randint(10, 60):
                loss *= rnd.uniform(0.9, 3)
            elif mode == "growgrad" and step > 40:
                g *= rnd.uniform(0.8, 3)
                loss *= rnd.uniform(0.95, 1.1)
            elif mode == "spiky":
                loss = 2 * rnd.lognormvariate(0, 1)
            else:
                loss *= rnd.uniform(0.85, 1.15)
                g *= rnd.uniform(0.8, 1.25)
            ranges = det.firing_ranges()
            for value_loss, value_g in ((loss, g), (loss * rnd.uniform(1, 50), g), (loss, g * rnd.uniform(1, 50)),
                                        (None, g), (-1.0, g * rnd.uniform(1, 50)), (math.nan, g)):
                reference = copy.deepcopy(det).update(step, value_loss, value_g, 1e-3) is not None
                assert ranges.fires(value_loss, value_g) == reference, (mode, step, value_loss, value_g)
                agree += 1
                fired += reference
            det.update(step, loss, g, 1e-3)
    assert agree == runs * 100 * 6 and fired > 2500  # the verdicts that fire are well represented


RANK1 = {  # scenario -> (bad step, rank 1's incident: kind, cause, op, module)
    "ddp": (5, ("nonfinite_input", "nonfinite_input", None, None)),
    "fsdp": (5, ("nonfinite_input", "nonfinite_input", None, None)),
    "fsdp_log_rank1": (3, ("nonfinite_loss", "log_nonpositive", "aten.log.default", "0")),
    "fsdp_sqrt_rank1": (3, ("nonfinite_grad", "grad_singularity", "aten.sqrt.default", "2")),
    "ddp_sqrt_rank1": (3, ("nonfinite_grad", "grad_singularity", "aten.sqrt.default", "2")),
}


@pytest.mark.parametrize("scenario", list(RANK1))
def test_two_gloo_ranks_sync_free_matches_sync_with_zero_reads(tmp_path, scenario):
    """A NaN made by rank 1's step only: every rank skips the same step on the device (DDP: the
    verdicts ride in the step's all-reduce; FSDP2: judged on the global norms it yields, then
    combined by one more all-reduce on the device); read one step later, the incident names rank 1
    on both ranks and is localised on rank 1 (every rank replaying together under FSDP2) exactly as
    the synchronous run localises it; the weights equal the synchronous run's and each other's, and
    no step after the first reads the host."""
    from pathlib import Path

    from test_distributed import _torchrun

    bad, expected = RANK1[scenario]
    results = _torchrun(tmp_path, scenario, script=Path(__file__).with_name("sync_free_script.py"))
    for res in results:
        sync, free = res["sync"], res["free"]
        assert free["device_steps"] == 11 and sync["device_steps"] == 0
        assert free["replicas_equal"] and sync["replicas_equal"]
        assert free["weights"] == sync["weights"]
        assert free["incidents"] == sync["incidents"]
        for run in (sync, free):  # the optimizer-state monitor works on shards too (combined across ranks)
            assert run["monitor_failures"] == [] and run["adam_stats_match"] is (True if "fsdp" in scenario else None)
        assert [i[:3] for i in free["incidents"]] == [[bad, free["incidents"][0][1], 1]]
        # healthy steps (the incident's own reads, bundle and localisation, come at its step, or the next when read late)
        assert sync["reads"][:bad] + sync["reads"][bad + 1:] == [1] * 11
        assert free["reads"][:bad + 1] + free["reads"][bad + 2:] == [1] + [0] * 10
    kind, cause, op, module = expected
    assert results[1]["free"]["incidents"][0][1] == kind and results[1]["free"]["incidents"][0][4:7] == [cause, op, module]
    assert results[0]["free"]["incidents"][0][1] == "nonfinite_grad"  # rank 0 only received them


def test_an_update_beyond_its_proven_bound_is_withheld_and_reported():
    """Spikes only logged (finite_anomaly_action='log'), then a gradient of norm ~1e30 at step 10:
    Adam's second moment would overflow float32. The device withholds the update (beyond the
    largest norm the update is proven finite for) and the host reports it; the synchronous mode
    applies it, finds the state non-finite and undoes it: the same weights either way."""
    def run(sync_free: bool) -> tuple[dict, list]:
        torch.manual_seed(0)
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        cfg = nantrace.Config(outputs={"print_incidents": False}, detection={"sync_free": sync_free},
                              response={"finite_anomaly_action": "log"})
        guard = nantrace.watch(model, opt, config=cfg)
        gen = torch.Generator().manual_seed(1)
        for step in range(14):
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
            opt.zero_grad()
            (F.mse_loss(model(x), y) * (1e30 if step == 10 else 1.0)).backward()
            opt.step()
        guard.close()
        return model.state_dict(), [(i.step, i.kind, i.cause, i.phase, i.action, i.details.get("sync_free"))
                                    for i in guard.incidents if i.action != "logged"]

    sync_state, sync_incidents = run(False)
    free_state, free_incidents = run(True)
    assert all(torch.equal(sync_state[k], free_state[k]) for k in sync_state)
    # the replay of the fused update names the kernel whose second moment overflowed (as it names the
    # for-loop update's op): finite inputs, a result beyond float32
    assert sync_incidents == [(10, "optimizer_state", "overflow", "optimizer", "skipped", None)]
    assert free_incidents == [(10, "grad_explosion", "gradient_explosion", "backward", "skipped", "withheld on the device")]


def test_asking_for_the_figures_reads_the_pending_step_and_a_stop_comes_before_the_next_update():
    """``guard.last_step`` right after ``optimizer.step()`` is the step's own figures (a natural
    read); under ``raise`` the incident is recorded then, and the next ``optimizer.step()`` raises
    before its update lands."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = nantrace.watch(model, opt, on_anomaly="raise", config=nantrace.Config(
        outputs={"print_incidents": False}, detection={"sync_free": True}))
    gen = torch.Generator().manual_seed(1)
    logged = []
    with pytest.raises(nantrace.NonFiniteError):
        for step in range(10):
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
            if step == 6:
                x[0, 0] = float("nan")
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            if step == 7:
                before = {k: v.clone() for k, v in model.state_dict().items()}
            opt.step()
            row = guard.last_step
            logged.append((row["step"], row["skipped"]))
            if step == 6:
                assert [(i.step, i.action) for i in guard.incidents] == [(6, "raised")]
    assert logged == [(s, s == 6) for s in range(7)]  # each step's own row, read right after its update
    assert step == 7 and all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # 7 never landed
    guard.close()


def test_a_divergence_of_one_ranks_loss_stops_every_rank_together(tmp_path):
    """Only rank 1's targets grow (×8 a step): its divergence detector flags its loss, which the
    other rank cannot see. Each rank publishes its divergence verdict (judged on the device from
    the detector's firing ranges) in the agreement word, so both ranks skip the same steps and the
    escalation ladder pauses both at the same step; replicas stay identical. The sync-free run
    reaches the same weights and incidents and stops one step later, before that update."""
    from pathlib import Path

    from test_distributed import _torchrun

    results = _torchrun(tmp_path, "ddp_divergence", script=Path(__file__).with_name("sync_free_script.py"))
    for rank, res in enumerate(results):
        sync, free = res["sync"], res["free"]
        assert sync["replicas_equal"] and free["replicas_equal"] and free["weights"] == sync["weights"]
        assert free["incidents"] == sync["incidents"] and (sync["raised"], free["raised"]) == (10, 11)
        assert [i[:4] for i in sync["incidents"]] == [[5, "loss_spike", 1, "skipped"], [10, "loss_spike", 1, "paused"]]
        assert [i[4] for i in sync["incidents"]] == (["loss_divergence"] * 2 if rank == 1 else ["unknown"] * 2)
        assert sync["peer"] == ([None, None] if rank == 1 else [1, 1])
        if rank == 0:  # a finite anomaly of rank 1's own loss, not values it sent
            assert all("The anomaly is rank 1's own (its loss)" in s for s in sync["summaries"])


def test_a_pending_step_holds_no_model_output_nor_its_gradient():
    """The step decided one step late keeps what a replay needs, not the logits: its tape names the
    model's outputs by position (a replay makes them again) and the gradients kept at the outputs
    are dropped; once the training loop lets go of them, they are freed (GPT-2 small on an H100:
    +1.5 GiB of peak memory before, docs/benchmarks.md)."""
    import gc
    import weakref

    from nantrace.loss_tape import OutputRef
    from nantrace.storage.tape_codec import decode_tape, encode_tape

    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False},
                                                              detection={"sync_free": True}))
    gen = torch.Generator().manual_seed(1)
    refs = []
    for step in range(3):
        ids = torch.randint(0, 32, (4, 8), generator=gen)
        opt.zero_grad()
        logits = model(ids)
        loss = F.cross_entropy(logits.float().reshape(-1, 32), torch.roll(ids, -1, 1).reshape(-1))
        loss.backward()
        opt.step()
        refs.append(weakref.ref(logits))
        del logits, loss
    gc.collect()
    pending = guard.sync_free.pending
    assert pending is not None and pending.capture.tape.usable
    assert refs[-1]() is None, "the pending step kept the model's output alive"
    assert all(not f.output_grads for f in pending.capture.forwards)
    assert any(isinstance(a, OutputRef) for e in pending.capture.tape.entries for a in e.args)
    data = encode_tape(pending.capture.tape, pending.capture.forwards)  # a bundle can still be written
    assert any(isinstance(a, OutputRef) for e in decode_tape(data).entries for a in e.args)
    guard.close()
    assert guard.incidents == []


class TinyVAE(nn.Module):
    """An encoder to (mu, logvar), a decoder: three outputs the loss code reads."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.dec = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.dec(z), mu, logvar


def _vae_run(sync_free: bool) -> list[tuple]:
    torch.manual_seed(0)
    model = TinyVAE()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False},
                                                              detection={"sync_free": sync_free}))
    gen = torch.Generator().manual_seed(1)
    for step in range(12):
        x = torch.randn(16, 8, generator=gen)
        opt.zero_grad()
        recon, mu, logvar = model(x)
        if step == 7:
            logvar = logvar * 1e4  # an encoder blow-up: exp(logvar) overflows in the KL term
        kl = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
        (F.mse_loss(recon, x) + kl).backward()
        opt.step()
    guard.close()
    return [(i.step, i.kind, i.cause, i.op, i.module, i.action) for i in guard.incidents]


def test_a_step_decided_late_replays_a_loss_code_that_reads_several_model_outputs():
    """Written after the pending tape started naming outputs by position: a VAE's loss code reads
    the model's second and third outputs; decided one step late, the diagnosis is the synchronous one."""
    sync = _vae_run(False)
    assert sync[:1] == [(7, "nonfinite_loss", "exp_overflow", "aten.exp.default", None, "skipped")]
    assert _vae_run(True) == sync
