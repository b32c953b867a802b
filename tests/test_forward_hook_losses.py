"""Loss terms computed in a forward hook the USER registered on a submodule of the watched model, stored where the
loss code reads them (a list, a dict), and added to the loss by the loss code: a sparse autoencoder's KL sparsity
penalty, an activation-magnitude regulariser, attention-transfer maps of a student network, an activation-energy
regulariser on a transformer layer.

Two mechanisms are checked (docs/diagnosis.md):

- zero-intrusive mode: the loss code receives a tensor the model's forward made without returning it. It is not
  the batch: the replayed forward re-runs the user's hook and re-makes it, and the loss code's replay reads that
  twin (``loss_replay._Decoder.forward_twin``: the tensor the replayed forward made with the same autograd
  history), so the trace goes on into the hook;
- both modes: torch runs the process-wide forward hooks before a module's own, so the replay's module stack
  (``localisation/modules.ModuleStack``) ends a module that carries forward hooks of its own with a hook after
  them: the hook's ops belong to the hooked module (the code runs inside its ``__call__``).

Expectations were derived from /work/shared/API.md before nantrace ran: the origin is the first op that made a
non-finite value from finite inputs; module = the hooked module; source = the marked line in the hook; a zero count
or a ``1 - rho_hat`` of 0 is ``div_by_zero``; a norm of a zero vector is ``zero_variance_norm``; a NaN target of
the batch (no autograd history) stays ``nonfinite_input``. Each construction is checked with plain torch
(``test_construction``): the step that fails first, and the first op that made a non-finite value from finite
inputs with the line that issued it.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from heldout_harness import Judge, Program, aligned, assert_diagnosis, case_params, describe, run_step, train
from origin_markers import origin_line
from test_programs import Want

from nantrace.localisation.modules import ModuleStack

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

HERE = os.path.abspath(__file__)
JUDGE = Judge(__file__)
FAIL_STEP = 3
N_STEPS = 5

CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
QUIET: dict[str, Callable[[], Program]] = {}


def case(name: str, want: Want) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        CASES[name] = (build, want)
        return build
    return register


def quiet(name: str) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        QUIET[name] = build
        return build
    return register


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- 1. sparse autoencoder, KL penalty in a hook
# The hook sits on the encoder's Sigmoid ("encoder.1"). The batch of FAIL_STEP repeats one sensor reading that
# drives hidden unit 5 past 17 on every row: sigmoid rounds to exactly 1.0, rho_hat = 1 and (1 - rho) / (1 - rho_hat)
# (a Python float over a tensor: reciprocal) divides by 0.
class SparseAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(10, 20), nn.Sigmoid())
        self.decoder = nn.Linear(20, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def _sparse_ae(seed: int, clamp: bool) -> Program:
    torch.manual_seed(1)
    model = SparseAE()
    rho, penalties = 0.05, []

    def kl_sparsity(module: nn.Module, inputs: Any, out: torch.Tensor) -> None:
        rho_hat = out.mean(0)
        if clamp:
            rho_hat = rho_hat.clamp(1e-4, 1 - 1e-4)
        kl = rho * torch.log(rho / rho_hat) + (1 - rho) * torch.log((1 - rho) / (1 - rho_hat))  # <origin:kl_hook>
        penalties.append(kl.sum())

    model.encoder[1].register_forward_hook(kl_sparsity)

    def loss(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        penalties.clear()
        recon = m(x)
        return F.mse_loss(recon, x) + 1e-3 * sum(penalties)

    stuck = aligned(lambda v: model.encoder[0](v)[:, 5] - 25.0, 10, 1.0, 40.0, seed + 1)
    g = _gen(seed)
    batches = []
    for step in range(N_STEPS):
        x = torch.randn(32, 10, generator=g)
        if step == FAIL_STEP:
            x = stuck.expand(32, 10) + 0.01 * x
        batches.append(x)
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), batches, loss)


@case("sparse_ae_kl_hook_on_sigmoid_saturated_unit",
      Want("nonfinite_loss", "forward", "aten.reciprocal.default", "encoder.1", "kl_hook", "div_by_zero",
           file=HERE))
def _sae_case() -> Program:
    return _sparse_ae(31, clamp=False)


@quiet("sparse_ae_kl_hook_clamped")
def _sae_quiet() -> Program:
    return _sparse_ae(31, clamp=True)


# ---------------------------------------------------------------- 2. activation-magnitude regulariser in a hook
# A tagger's hidden ReLU block, biases initialised negative (sparse features); a hook on it collects the mean
# magnitude of the ACTIVE units, |h|.sum() / (h > 0).sum(), into a list the loss sums. The batch of FAIL_STEP is all
# padding (zero feature vectors): no unit is active, 0 / 0.
class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 5)
        nn.init.constant_(self.features[0].bias, -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _tagger(seed: int, nan_weight: bool = False) -> Program:
    torch.manual_seed(2)
    model = Tagger()
    magnitudes: list[torch.Tensor] = []
    floor = 1 if nan_weight else 0  # with the NaN weight, a guarded count: the hook's term stays finite

    def active_l1(module: nn.Module, inputs: Any, h: torch.Tensor) -> None:
        magnitudes.append(h.abs().sum() / (h > 0).sum().clamp(min=floor))  # <origin:active_l1>

    model.features.register_forward_hook(active_l1)

    def loss(m: nn.Module, b: Any, step: int) -> torch.Tensor:
        magnitudes.clear()
        x, y, w = b
        logits = m(x)
        return (w * F.cross_entropy(logits, y, reduction="none")).mean() + 1e-2 * torch.stack(magnitudes).sum()

    g = _gen(seed)
    batches = []
    for step in range(N_STEPS):
        x, y, w = 3 * torch.randn(24, 16, generator=g), torch.randint(0, 5, (24,), generator=g), torch.ones(24)
        if step == FAIL_STEP:
            if nan_weight:
                w[7] = float("nan")  # a per-example weight read from a CSV with an empty cell
            else:
                x = torch.zeros(24, 16)
        batches.append((x, y, w))
    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9), batches, loss)


@case("tagger_active_unit_l1_hook_all_padding_batch",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "features", "active_l1", "div_by_zero", file=HERE))
def _tagger_case() -> Program:
    return _tagger(41)


# Must not be taken for the hook's: the batch's own per-example weight is NaN (no autograd history, no twin).
@case("tagger_hook_present_nan_example_weight_of_batch",
      Want("nonfinite_input", "data", None, None, None, "nonfinite_input", file=HERE))
def _tagger_nan_weight() -> Program:
    return _tagger(42, nan_weight=True)


# ---------------------------------------------------------------- 3. attention transfer: maps stored by a hook
# A bias-free conv student; a hook on its second block stores the spatial attention map (Zagoruyko & Komodakis),
# normalised by hand, a / ||a||, into a dict the loss compares with the teacher's maps (part of the batch). A blank
# (all-black) image of FAIL_STEP gives zero features and a zero map: 0 / 0.
class Student(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.ReLU())
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)).mean((2, 3)))


def _student(seed: int) -> Program:
    torch.manual_seed(3)
    model = Student()
    maps: dict[str, torch.Tensor] = {}

    def attention_map(module: nn.Module, inputs: Any, out: torch.Tensor) -> None:
        a = out.pow(2).mean(1).flatten(1)
        maps["block"] = a / a.norm(dim=1, keepdim=True)  # <origin:at_norm>

    model.block.register_forward_hook(attention_map)

    def loss(m: nn.Module, b: Any, step: int) -> torch.Tensor:
        x, y, teacher_at = b
        logits = m(x)
        return F.cross_entropy(logits, y) + 10.0 * (maps["block"] - teacher_at).pow(2).mean()

    g = _gen(seed)
    batches = []
    for step in range(N_STEPS):
        x = torch.rand(6, 1, 8, 8, generator=g)
        if step == FAIL_STEP:
            x[2] = 0.0  # a blank image
        teacher = F.normalize(torch.rand(6, 64, generator=g), dim=1)
        batches.append((x, torch.randint(0, 10, (6,), generator=g), teacher))
    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-2), batches, loss)


@case("student_attention_transfer_hook_blank_image",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "block", "at_norm", "zero_variance_norm", file=HERE))
def _student_case() -> Program:
    return _student(51)


# ---------------------------------------------------------------- 4. a hook on a TransformerEncoderLayer
# An activation-energy regulariser on the first encoder layer, averaged over the real tokens (padding embeds to
# zero rows: a bias-free embedding), collected into a list the loss sums. The batch of FAIL_STEP is all padding:
# the count of real tokens is 0.
class TinyEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16, bias=False)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def _tiny_encoder(seed: int, floor: int) -> Program:
    torch.manual_seed(4)
    model = TinyEncoder()
    energies: list[torch.Tensor] = []

    def energy(module: nn.Module, inputs: Any, out: torch.Tensor) -> None:
        real = (inputs[0].abs().sum(-1) > 0).sum().clamp(min=floor)
        energies.append(out.pow(2).mean(-1).sum() / real)  # <origin:tel_energy>

    model.encoder.layers[0].register_forward_hook(energy)

    def loss(m: nn.Module, b: Any, step: int) -> torch.Tensor:
        energies.clear()
        tokens, y = b
        return F.cross_entropy(m(tokens), y) + 1e-3 * sum(energies)

    g = _gen(seed)
    batches = []
    for step in range(N_STEPS):
        tokens = torch.randn(4, 7, 6, generator=g)
        if step == FAIL_STEP and floor == 0:
            tokens = torch.zeros(4, 7, 6)
        batches.append((tokens, torch.randint(0, 3, (4,), generator=g)))
    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches, loss)


@case("transformer_layer_energy_hook_all_padding_batch",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "encoder.layers.0", "tel_energy", "div_by_zero",
           file=HERE))
def _tel_case() -> Program:
    return _tiny_encoder(61, floor=0)


@quiet("transformer_layer_energy_hook_count_floored")
def _tel_quiet() -> Program:
    return _tiny_encoder(61, floor=1)


# ====================================================================== the construction, in plain torch
class FirstBad(TorchDispatchMode):
    """The first op whose floating inputs were all finite and whose output is not, with the line of this file
    that issued it."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.made: list[tuple[int, str, int | None]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        finite_in = all(bool(torch.isfinite(a).all()) for a in tensors)
        out = func(*args, **kwargs)
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.is_floating_point()]
        if finite_in and not all(bool(torch.isfinite(o).all()) for o in outs):
            frame, line = sys._getframe(1), None
            while frame is not None:
                if os.path.abspath(frame.f_code.co_filename) == HERE:
                    line = frame.f_lineno
                    break
                frame = frame.f_back
            self.made.append((self.step, f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}",
                              line))
        return out


def plain_run(program: Program) -> tuple[int | None, FirstBad]:
    """Without nantrace: the first step whose loss or gradients are non-finite."""
    rec = FirstBad()
    with rec:
        for step, batch in enumerate(program.batches):
            rec.step = step
            program.optimizer.zero_grad()
            loss = run_step(program, program.loss, batch, step)
            grads = [p.grad for p in program.model.parameters() if p.grad is not None]
            if not math.isfinite(float(loss)) or not all(bool(torch.isfinite(g).all()) for g in grads):
                return step, rec
            program.optimizer.step()
    return None, rec


@pytest.mark.parametrize("name", list(CASES))
def test_construction(name: str) -> None:
    build, want = CASES[name]
    step, rec = plain_run(build())
    assert step == want.step, (step, rec.made[:3])
    assert not [m for m in rec.made if m[0] < want.step], rec.made[:3]
    if want.op is None:  # the batch's own NaN: no op of the step made a non-finite value
        assert not rec.made, rec.made[:3]
        return
    first = rec.made[0]
    assert first == (want.step, want.op, origin_line(HERE, want.tag)), rec.made[:3]


@pytest.mark.parametrize("name", list(QUIET))
def test_quiet_construction(name: str) -> None:
    step, rec = plain_run(QUIET[name]())
    assert step is None and not rec.made, (step, rec.made[:3])


@pytest.mark.parametrize("name,mode", case_params(CASES, {}))
def test_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    assert_diagnosis(train(build(), replayable=mode == "replayable"), want, JUDGE)


@pytest.mark.parametrize("name,mode", case_params(QUIET, {}))
def test_quiet(name: str, mode: str) -> None:
    run = train(QUIET[name](), replayable=mode == "replayable")
    blocking = [describe(i) + " | " + i.summary for i in run.incidents if i.action != "logged"]
    assert not blocking and run.error is None, (blocking, repr(run.error))


# ====================================================================== the module stack on hooked modules
def test_module_stack_attributes_a_modules_own_forward_hook_to_it() -> None:
    """Code in a module's own forward hook runs inside that module (torch calls the process-wide hooks first);
    the stack's hook goes last, on modules that already carry forward hooks only, and leaves with the stack."""
    torch.manual_seed(0)
    model = SparseAE()
    seen: list[str | None] = []
    stack = ModuleStack(model)
    model.encoder.register_forward_hook(lambda m, i, o: seen.append(stack.current))
    model.encoder[0].register_forward_pre_hook(lambda m, i: seen.append(stack.current))
    with stack:
        assert len(model.encoder._forward_hooks) == 2 and not model.decoder._forward_hooks
        assert not model.encoder[0]._forward_hooks  # a pre-hook only: nothing added
        model(torch.randn(2, 10))
        assert stack.current is None
    assert seen == ["encoder.0", "encoder"]
    assert len(model.encoder._forward_hooks) == 1


def test_module_stack_pops_a_hooked_module_that_raised() -> None:
    torch.manual_seed(0)
    model = SparseAE()
    stack = ModuleStack(model)

    def refuse(m: nn.Module, i: Any, o: torch.Tensor) -> None:
        raise ValueError("refused")

    model.encoder.register_forward_hook(refuse)
    with stack:
        with pytest.raises(ValueError):
            model(torch.randn(2, 10))
        assert stack.current is None


@pytest.mark.parametrize("hooked", ["layer", "sublayer", "none"])
def test_module_stack_keeps_transformer_layer_numerics(hooked: str) -> None:
    """A replay's module stack changes no fused-path decision of an nn.TransformerEncoderLayer in inference: one
    with no hook stays unhooked (fused path), one with a user hook (on it or on a sublayer) gets one more; the
    outputs are bitwise those of the real call, and the user's hook runs inside its module."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    model = nn.Sequential(layer)
    seen: list[str | None] = []
    stack = ModuleStack(model)
    target = {"layer": layer, "sublayer": layer.linear1, "none": None}[hooked]
    if target is not None:
        target.register_forward_hook(lambda m, i, o: seen.append(stack.current))
    x = torch.randn(3, 5, 16)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, 3:] = True
    with torch.no_grad():
        real = model[0](x, src_key_padding_mask=mask)
        seen.clear()
        with stack:
            hooks = [len(m._forward_hooks) for m in layer.modules()]
            replayed = model[0](x, src_key_padding_mask=mask)
    assert torch.equal(torch.nan_to_num(real, 1.0), torch.nan_to_num(replayed, 1.0))
    if target is None:
        assert hooks == [0] * len(hooks)
        assert seen == []
    else:
        assert sum(hooks) == 2
        assert seen == [{"layer": "0", "sublayer": "0.linear1"}[hooked]]
