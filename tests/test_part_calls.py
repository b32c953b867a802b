"""Loss code that never calls the watched model itself, only its parts: a VAE trained through
``model.encode(x)`` / ``model.decode(z)``, a dual encoder whose loss calls ``model.query_encoder(q)``
and ``model.doc_encoder(d)``, a stack of layers run one by one from a ``ModuleList``. The model's own
forward never runs, so before ``StepRecorder.part_hooks`` nothing of the step was captured and the
incident named no op. Each part called from outside the model is now a recorded forward
(``ForwardRecord.module``), replayed by itself; calls inside the model's forward, or a checkpointed
part recomputed by the backward, are not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import nantrace
from origin_markers import points_at

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

BAD_STEP = 2
QUIET = nantrace.Config(outputs={"print_incidents": False})


class LogFeatures(nn.Module):
    """Count features on a log scale (no +1: a zero count is -inf)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # <origin:logcount>


class CountVAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(LogFeatures(), nn.Linear(6, 8))
        self.mu, self.logvar = nn.Linear(8, 2), nn.Linear(8, 2)
        self.decoder = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 6))

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.encoder(x)
        return self.mu(h), self.logvar(h)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # never called by the loop below
        mu, _ = self.encode(x)
        return self.decode(mu)


def _elbo(model: CountVAE, x: torch.Tensor) -> torch.Tensor:
    mu, logvar = model.encode(x)
    z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
    recon = model.decode(z)
    kl = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
    return F.mse_loss(recon, torch.log1p(x)) + kl


def _counts(step: int) -> torch.Tensor:
    x = torch.rand(5, 6, generator=torch.Generator().manual_seed(step)) * 9 + 1
    if step == BAD_STEP:
        x[3, 2] = 0.0  # a feature never seen in this sample
    return x


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_a_vae_trained_through_its_encode_and_decode_methods(replayable):
    model = CountVAE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nantrace.watch(model, opt, config=QUIET) as guard:
        loss_fn = guard.replayable(_elbo) if replayable else _elbo
        for step in range(4):
            opt.zero_grad()
            loss_fn(model, _counts(step)).backward()
            opt.step()
        (inc,) = guard.incidents
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        BAD_STEP, "nonfinite_loss", "forward", "aten.log.default", "encoder.0", "log_nonpositive", "skipped")
    assert points_at(inc.source, __file__, "logcount"), inc.source


class MeanPool(nn.Module):
    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).float()
        return (h * m).sum(1) / m.sum(1)  # <origin:pool>


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.pool = MeanPool()

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.pool(self.emb(ids), mask)


class DualEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query_encoder, self.doc_encoder = Encoder(), Encoder()
        self.log_temperature = nn.Parameter(torch.zeros(()))


def _in_batch_negatives(model: DualEncoder, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    q = model.query_encoder(batch["q"], batch["q_mask"])
    d = model.doc_encoder(batch["d"], batch["d_mask"])
    q, d = F.normalize(q, dim=-1), F.normalize(d, dim=-1)
    scores = q @ d.T / batch["temperature"]  # <origin:temperature>
    return F.cross_entropy(scores, torch.arange(len(q)))


def _pairs(step: int, *, empty_query: bool = False, temperature: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    q_mask = torch.ones(4, 5, dtype=torch.long)
    if empty_query:
        q_mask[1] = 0  # a query emptied by the cleaning
    return {"q": torch.randint(0, 30, (4, 5), generator=g), "q_mask": q_mask,
            "d": torch.randint(0, 30, (4, 7), generator=g), "d_mask": torch.ones(4, 7, dtype=torch.long),
            "temperature": torch.tensor(temperature)}


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
@pytest.mark.parametrize("failure", ["empty_query", "zero_temperature"])
def test_a_dual_encoder_whose_loss_calls_its_two_encoders(failure, replayable):
    model = DualEncoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nantrace.watch(model, opt, config=QUIET) as guard:
        loss_fn = guard.replayable(_in_batch_negatives) if replayable else _in_batch_negatives
        for step in range(4):
            bad = step == BAD_STEP
            batch = _pairs(step, empty_query=bad and failure == "empty_query",
                           temperature=0.0 if bad and failure == "zero_temperature" else 0.05)
            opt.zero_grad()
            loss_fn(model, batch).backward()
            opt.step()
        (inc,) = guard.incidents
    if failure == "empty_query":
        want = ("aten.div.Tensor", "query_encoder.pool", "div_by_zero", "pool")
    else:  # the division in the loss code: no module
        want = ("aten.div.Tensor", None, "div_by_zero", "temperature")
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause) == (
        BAD_STEP, "nonfinite_loss", "forward", *want[:3])
    assert points_at(inc.source, __file__, want[3]), inc.source


class RowLength(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.pow(2).sum(-1, keepdim=True).sqrt()  # <origin:sqrt>


class Stack(nn.Module):
    """Layers the loss code runs one by one (to take every layer's features)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(4, 4, bias=False), nn.Sequential(nn.Identity(), RowLength()),
                                     nn.Linear(1, 1)])


def _layerwise(model: Stack, x: torch.Tensor) -> torch.Tensor:
    feats = []
    for layer in model.layers:
        x = layer(x)
        feats.append(x)
    return x.pow(2).mean() + 0.01 * sum(f.abs().mean() for f in feats)


def test_a_module_list_run_layer_by_layer_from_the_loss_code():
    """The length of an all-zero row (a padded sample): a finite forward, then sqrt's infinite derivative
    at 0 times the square's zero derivative, 0 * inf = NaN, in the backward."""
    model = Stack()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nantrace.watch(model, opt, config=QUIET) as guard:
        for step in range(4):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
            if step == BAD_STEP:
                x[4] = 0.0
            opt.zero_grad()
            _layerwise(model, x).backward()
            if step == 0:
                assert [f.module for f in guard.recorder.capture.forwards] == ["layers.0", "layers.1", "layers.2"]
            opt.step()
        incs = list(guard.incidents)
    assert incs, "no incident"
    inc = incs[0]
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause) == (
        BAD_STEP, "nonfinite_grad", "backward", "aten.sqrt.default", "layers.1.1", "grad_singularity")
    assert points_at(inc.source, __file__, "sqrt"), inc.source


class LayerHolder(nn.Module):
    """A plain child holding the layer list (``model.encoder.layers``, as in a BERT or a ViT)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(4, 4, bias=False), nn.Sequential(nn.Identity(), RowLength())])


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = LayerHolder()
        self.heads = nn.ModuleDict({"regress": nn.Linear(1, 1)})


def _early_exit(model: Deep, x: torch.Tensor) -> torch.Tensor:
    """An early-exit / layer-wise loss: the encoder's layers run one by one, then a head from a dict."""
    hidden = []
    for layer in model.encoder.layers:
        x = layer(x)
        hidden.append(x)
    return model.heads["regress"](x).pow(2).mean() + 0.01 * sum(h.abs().mean() for h in hidden)


def test_layers_of_a_list_below_a_child_run_from_the_loss_code():
    """The layer list lives below a plain child (``model.encoder.layers[i]``) and the head in a dict:
    each is a recorded call, and the backward's sqrt at 0 is found inside the second layer."""
    model = Deep()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nantrace.watch(model, opt, config=QUIET) as guard:
        for step in range(4):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
            if step == BAD_STEP:
                x[4] = 0.0
            opt.zero_grad()
            _early_exit(model, x).backward()
            if step == 0:
                assert [f.module for f in guard.recorder.capture.forwards] == [
                    "encoder.layers.0", "encoder.layers.1", "heads.regress"]
            opt.step()
        incs = list(guard.incidents)
    assert incs, "no incident"
    inc = incs[0]
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause) == (
        BAD_STEP, "nonfinite_grad", "backward", "aten.sqrt.default", "encoder.layers.1.1", "grad_singularity")
    assert points_at(inc.source, __file__, "sqrt"), inc.source


class Residual(nn.Module):
    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.shared = shared
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.shared(x))


class Tied(nn.Module):
    """A part held by two parents (a tied embedding): called inside another part, it is not a call of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.blocks = nn.ModuleList([Residual(self.norm), Residual(self.norm)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.norm(x)


def test_only_calls_from_outside_the_model_are_recorded():
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(3, 4)
    with nantrace.watch(model, opt, config=QUIET) as guard:
        rec = guard.recorder
        assert rec.parts_hooked  # from the first step: a script may never call the model itself
        model(x).sum().backward()  # the forward, then checkpointed blocks recomputed by the backward
        assert [f.module for f in rec.capture.forwards] == [""]
        opt.step()
        assert not rec.parts_hooked  # the script calls the model itself: the parts cost nothing any more
        model.norm(model.blocks[0](x)).sum().backward()  # parts only: nothing captured, the hooks come back
        assert rec.capture.forwards == [] and rec.parts_hooked
        opt.step()
        h = model.blocks[0](x)  # a block called by the step's code: the shared norm inside it is not a call
        model.norm(h).sum().backward()
        assert [f.module for f in rec.capture.forwards] == ["blocks.0", "norm"]
        opt.step()
        assert rec.parts_hooked  # parts called from outside: kept
    hooked = [m for m in model.modules() if m._forward_pre_hooks or m._forward_hooks]
    assert not hooked, "close() left hooks on the model's parts"


def test_a_bundle_of_a_part_call_replays_to_the_same_diagnosis(tmp_path):
    model = CountVAE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nantrace.watch(model, opt, config=QUIET, run_dir=tmp_path) as guard:
        for step in range(4):
            opt.zero_grad()
            _elbo(model, _counts(step)).backward()
            opt.step()
        (inc,) = guard.incidents
    assert inc.bundle is not None
    again = nantrace.replay(inc.bundle, CountVAE())
    assert (again.op, again.module, again.cause) == ("aten.log.default", "encoder.0", "log_nonpositive")
