"""Zero-code mode (``nantrace run``'s AutoWatch) pairs a model that runs only inside ``optimizer.step(closure)``.

Lightning's automatic optimisation calls ``optimizer.step(closure)`` and runs ``training_step`` (the model's
first forward) inside the closure, after torch's step pre-hooks; a plain L-BFGS script does the same. At the
first step's pre-hook no model has been called yet, so AutoWatch wraps the closure
(``AutoWatch._closure_pairing``): the first training forward inside it pairs the optimizer as at any first
forward, and the guard's closure check decides the step before the update. An optimizer whose parameters
belong to no model run in the closure (temperature scaling over a frozen classifier) keeps the note and is not
watched.

Every program is first run WITHOUT nantrace under a small op recorder (``Made``: the first op that turned finite
inputs into a non-finite output, with its optimizer step and the innermost module running it), which fixes
the expected step, op and module; the quiet programs stay finite in every step, and train to the same weights
under AutoWatch as without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace
from conftest import same_state
from nantrace.autowatch import AutoWatch
from origin_markers import points_at

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                         "ignore::FutureWarning")]
QUIET = nantrace.Config(outputs={"print_incidents": False})
STEPS = 5


# ------------------------------------------------------------------ the record without nantrace
def _bad(tree: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel()
               and not bool(torch.isfinite(t).all()) for t in tree_leaves(tree))


class Made(TorchDispatchMode):
    """The first op that made a non-finite value from finite inputs: (optimizer step, op, innermost module's
    path under ``root``). Steps are counted by a global step post-hook (each ``optimizer.step()`` call)."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self.root, self.stack, self.step = root, [], 0
        self.first: tuple[int, str, str | None] | None = None

    def __enter__(self) -> "Made":
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.handles = [register_module_forward_pre_hook(self._enter_module),
                        register_module_forward_hook(self._leave_module, always_call=True),
                        register_optimizer_step_post_hook(self._stepped)]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        super().__exit__(*exc)

    def _enter_module(self, module: nn.Module, args: Any) -> None:
        self.stack.append(module)

    def _leave_module(self, module: nn.Module, args: Any, output: Any) -> None:
        self.stack.pop()

    def _stepped(self, *_: Any) -> None:
        self.step += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.first is None and _bad(out) and not _bad((args, kwargs)):
            names = {id(m): n for n, m in self.root.named_modules()}
            module = names.get(id(self.stack[-1])) if self.stack else None
            self.first = (self.step, f"aten.{func._schema.name.split('::')[-1]}.{func._overloadname}", module)
        return out


@dataclasses.dataclass
class Outcome:
    incidents: list[Any] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    guards: list[Any] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    """The loss of each step's (first) evaluation, as the program computed it."""
    changed: dict[int, bool] = dataclasses.field(default_factory=dict)
    """Step -> whether the step changed the optimizer's parameters."""
    state: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    first: tuple[int, str, str | None] | None = None


def _run(script: Callable[[], None], root: nn.Module, mode: str, out: Outcome) -> Outcome:
    """``plain``: the script under the op recorder, no nantrace; ``auto``: under AutoWatch (``nantrace run``)."""
    if mode == "plain":
        with Made(root) as made:
            script()
        out.first = made.first
    else:
        with AutoWatch(config=QUIET) as auto:
            script()
        out.incidents, out.notes, out.guards = list(auto.incidents), list(auto.notes), list(auto.guards)
    return out


# ------------------------------------------------------------------ Lightning programs
def _pl() -> Any:
    return pytest.importorskip("lightning", reason="lightning is not installed (pip install 'nantrace[lightning]')")


class LogExposure(nn.Module):
    def forward(self, exposure: torch.Tensor) -> torch.Tensor:
        return torch.log(exposure)  # <origin:log_exposure>


class MaskedMean(nn.Module):
    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # <origin:masked_mean>


def _poisson_glm(losses: list[float]) -> Any:
    """A Poisson GLM of claim counts with a log-exposure offset (an actuarial frequency model)."""
    L = _pl()

    class PoissonGLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.rate = nn.Linear(3, 1)
            self.offset = LogExposure()

        def forward(self, x: torch.Tensor, exposure: torch.Tensor) -> torch.Tensor:
            return self.rate(x).squeeze(-1) + self.offset(exposure)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, exposure, counts = batch
            log_mu = self(x, exposure)
            loss = (torch.exp(log_mu) - counts * log_mu).mean()
            losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return PoissonGLM()


def _poisson_batches(fail: int | None) -> list[Any]:
    g = torch.Generator().manual_seed(3)
    out = []
    for step in range(STEPS):
        x = torch.randn(8, 3, generator=g)
        exposure = torch.rand(8, generator=g) * 0.9 + 0.1
        counts = torch.randint(1, 4, (8,), generator=g).float()
        if step == fail:
            exposure[5] = 0.0  # a policy cancelled on its first day: zero exposure
        out.append((x, exposure, counts))
    return out


def _tagger(losses: list[float]) -> Any:
    """A sequence classifier pooling token states with a masked mean."""
    L = _pl()

    class Tagger(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(4, 8)
            self.pool = MaskedMean()
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.head(self.pool(torch.tanh(self.enc(x)), mask))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, mask, y = batch
            loss = F.cross_entropy(self(x, mask), y)
            losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    return Tagger()


def _tagger_batches(fail: int | None) -> list[Any]:
    g = torch.Generator().manual_seed(5)
    out = []
    for step in range(STEPS):
        x, mask, y = torch.randn(4, 6, 4, generator=g), torch.ones(4, 6), torch.randint(0, 2, (4,), generator=g)
        mask[:, 4:] = 0.0
        if step == fail:
            mask[2] = 0.0  # an empty document (all padding)
        out.append((x, mask, y))
    return out


def pl_program(build: Callable[[list[float]], Any], batches: list[Any]) -> Callable[[Path, str], Outcome]:
    def run(tmp: Path, mode: str) -> Outcome:
        L = _pl()
        torch.manual_seed(0)
        out = Outcome()
        model = build(out.losses)

        class Steps(L.Callback):
            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                self.before = [p.detach().clone() for p in pl_module.parameters()]

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
                out.changed[batch_idx] = any(not torch.equal(a, p) for a, p in zip(self.before, pl_module.parameters()))

        def script() -> None:
            trainer = L.Trainer(max_steps=len(batches), accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                num_sanity_val_steps=0, callbacks=[Steps()], default_root_dir=str(tmp))
            trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))

        _run(script, model, mode, out)
        out.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return out

    return run


# ------------------------------------------------------------------ plain L-BFGS scripts
class LogDose(nn.Module):
    def forward(self, dose: torch.Tensor) -> torch.Tensor:
        return torch.log(dose)  # <origin:log_dose>


class DoseResponse(nn.Module):
    """A log-linear dose-response curve."""

    def __init__(self) -> None:
        super().__init__()
        self.log_dose = LogDose()
        self.head = nn.Linear(1, 1)

    def forward(self, dose: torch.Tensor) -> torch.Tensor:
        return self.head(self.log_dose(dose)[:, None]).squeeze(-1)


def _assay(step: int, fail: int | None, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    dose = torch.rand(16, generator=g) * 9.0 + 1.0
    if step == fail:
        dose[0] = 0.0  # the plate's control well, dose 0, left in the batch
    return dose, 0.7 * torch.log(dose.clamp_min(1e-3)) + 0.2 + 0.05 * torch.randn(16, generator=g)


def lbfgs_program(fail: int | None, *, noise_param: bool) -> Callable[[Path, str], Outcome]:
    """One plate per step, fitted with L-BFGS; the model is called only inside the closure. ``noise_param``: a
    heteroscedastic Gaussian NLL whose noise scale the optimizer steps too (a partial owner of its parameters)."""

    def run(tmp: Path, mode: str) -> Outcome:
        torch.manual_seed(0)
        out = Outcome()
        model = DoseResponse()

        def script() -> None:
            g = torch.Generator().manual_seed(7)
            log_sigma = nn.Parameter(torch.zeros(()))
            params = [*model.parameters(), *([log_sigma] if noise_param else [])]
            optimizer = torch.optim.LBFGS(params, lr=0.5, max_iter=4)
            for step in range(STEPS):
                dose, y = _assay(step, fail, g)
                evaluations: list[float] = []

                def closure() -> torch.Tensor:
                    optimizer.zero_grad()
                    residual = model(dose) - y
                    if noise_param:
                        loss = (residual ** 2 / (2 * torch.exp(2 * log_sigma)) + log_sigma).mean()
                    else:
                        loss = (residual ** 2).mean()
                    loss.backward()
                    evaluations.append(float(loss.detach()))
                    return loss

                before = [p.detach().clone() for p in params]
                optimizer.step(closure)
                out.losses.append(evaluations[0])
                out.changed[step] = any(not torch.equal(a, p) for a, p in zip(before, params))

        _run(script, model, mode, out)
        out.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return out

    return run


def temperature_scaling(tmp: Path, mode: str) -> Outcome:
    """Post-hoc calibration: L-BFGS fits a temperature on a frozen classifier's logits, the classifier called
    (in eval mode, without grad) inside the closure. The optimizer steps no model's parameters: noted, unwatched."""
    torch.manual_seed(0)
    out = Outcome()
    classifier = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).eval()

    def script() -> None:
        g = torch.Generator().manual_seed(11)
        x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
        temperature = nn.Parameter(torch.ones(1))
        optimizer = torch.optim.LBFGS([temperature], lr=0.1, max_iter=10)
        for step in range(STEPS):
            def closure() -> torch.Tensor:
                optimizer.zero_grad()
                with torch.no_grad():
                    logits = classifier(x)
                loss = F.cross_entropy(logits / temperature, y)
                loss.backward()
                return loss

            before = temperature.detach().clone()
            out.losses.append(float(optimizer.step(closure)))
            out.changed[step] = not torch.equal(before, temperature)
        out.state = {"temperature": temperature.detach().clone()}

    _run(script, classifier, mode, out)
    return out


# ------------------------------------------------------------------ the programs
@dataclasses.dataclass(frozen=True)
class Want:
    step: int
    kind: str
    phase: str
    op: str
    module: str | None
    cause: str
    tag: str


PROGRAMS: dict[str, tuple[Callable[[Path, str], Outcome], Want | None]] = {
    "pl_poisson_glm_zero_exposure_log_offset_step2": (
        pl_program(_poisson_glm, _poisson_batches(2)),
        Want(2, "nonfinite_loss", "forward", "aten.log.default", "offset", "log_nonpositive", "log_exposure")),
    "pl_masked_mean_empty_document_first_step": (
        pl_program(_tagger, _tagger_batches(0)),
        Want(0, "nonfinite_loss", "forward", "aten.div.Tensor", "pool", "div_by_zero", "masked_mean")),
    "lbfgs_script_dose_response_control_well_step1": (
        lbfgs_program(1, noise_param=False),
        Want(1, "nonfinite_loss", "forward", "aten.log.default", "log_dose", "log_nonpositive", "log_dose")),
    "lbfgs_script_noise_scale_stepped_too_control_well_step2": (
        lbfgs_program(2, noise_param=True),
        Want(2, "nonfinite_loss", "forward", "aten.log.default", "log_dose", "log_nonpositive", "log_dose")),
    "quiet_pl_poisson_glm": (pl_program(_poisson_glm, _poisson_batches(None)), None),
    "quiet_lbfgs_script_dose_response": (lbfgs_program(None, noise_param=False), None),
    "quiet_temperature_scaling_of_no_model": (temperature_scaling, None),
}
WATCHED = {name for name in PROGRAMS if name != "quiet_temperature_scaling_of_no_model"}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_construction_without_nantrace(name: str, tmp_path: Path) -> None:
    run, want = PROGRAMS[name]
    out = run(tmp_path, "plain")
    assert len(out.losses) == STEPS
    if want is None:
        assert out.first is None and all(torch.isfinite(torch.tensor(out.losses))), (out.first, out.losses)
        return
    assert out.first == (want.step, want.op, want.module), out.first
    finite = [bool(torch.isfinite(torch.tensor(v))) for v in out.losses]
    assert finite[:want.step + 1] == [True] * want.step + [False], out.losses


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_zero_code_mode_pairs_a_model_run_inside_the_closure(name: str, tmp_path: Path) -> None:
    run, want = PROGRAMS[name]
    out = run(tmp_path, "auto")
    if name in WATCHED:
        assert len(out.guards) == 1 and out.guards[0].step == STEPS and not out.notes, out.notes
    else:
        assert out.guards == [] and out.notes == [
            "a LBFGS optimizer steps parameters of no model the script called; it is not watched"]
    blocking = [i for i in out.incidents if i.action != "logged"]
    if want is None:
        assert blocking == [], [i.summary for i in blocking]
        plain = run(tmp_path / "plain", "plain")
        assert same_state(out.state, plain.state)  # trains exactly as without nantrace
        return
    first = blocking[0]
    got = (first.step, first.kind, first.phase, first.op, first.module, first.cause, first.action)
    assert got == (want.step, want.kind, want.phase, want.op, want.module, want.cause, "skipped"), first.summary
    assert points_at(first.source, __file__, want.tag), first.source
    assert out.changed[want.step] is False  # the update was blocked
    assert all(out.changed[s] for s in range(STEPS) if s != want.step), out.changed
