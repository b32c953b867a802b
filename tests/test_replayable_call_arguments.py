"""A ``guard.replayable`` call that changes the dict or list it received: the re-run reads what the real call read.

Two mechanisms:

- the call's dict and list arguments are kept as shallow copies of what they held at the call's entry
  (``step_capture.entry_copy``, in ``StepRecorder.replayable``'s wrapper; no tensor is copied), and each re-run gets
  a fresh copy of those (``rerun._run_unit``): HF's ``compute_loss`` idiom ``labels = inputs.pop("labels")`` re-runs
  with its labels, a loss that appends to a history list it was passed re-runs on the history it met;
- when the re-run of a replayable call raises an exception that is not the step's own (another type or message:
  a ``KeyError`` of a key popped from a NESTED dict, which the shallow copy shares), an exception is diagnosed from
  the step's forwards and taped loss code (``details["replayable_call_raised"]``), as a NaN already was
  (``localiser.localise_incident``).

Each case is a small script shaped like a real program; ``test_construction`` checks it without nantrace: the plain
loop first fails at the expected step (raising the expected error, or with a non-finite loss), and an independent
dispatch mode written here names the op that raised or first made a non-finite value, the module running (none: the
loss code) and the marked line.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import nantrace
from heldout_harness import MODES, Judge, describe, same, snapshot, sgd
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]

FAIL = 3
STEPS = 5
VOCAB = 32
JUDGE = Judge(__file__)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.out = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.emb(input_ids))
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        return self.out(h)


# 1. An HF-style compute_loss: pops the labels and a per-example quality weight from the collated inputs (the usual
#    idiom: the model must not see them), gathers the next-token log-probabilities with the labels as they come and
#    masks the padding after the gather. The batch of step 3 holds documents' short ends, padded with -100 by the
#    collator: gather(-1, -100) raises.
def pop_gather_loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    labels = inputs.pop("labels")
    quality = inputs.pop("quality")
    logp = F.log_softmax(model(**inputs)[:, :-1], dim=-1)
    targets = labels[:, 1:]
    mask = (targets != -100).float()
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # <origin:pop_gather>
    per_example = -(token_logp * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return (per_example * quality).sum() / quality.sum()


# 1q. QUIET twin: the gather reads labels.clamp(min=0), the mask removes the padding.
def pop_gather_clamped_loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    labels = inputs.pop("labels")
    quality = inputs.pop("quality")
    logp = F.log_softmax(model(**inputs)[:, :-1], dim=-1)
    targets = labels[:, 1:]
    mask = (targets != -100).float()
    token_logp = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per_example = -(token_logp * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return (per_example * quality).sum() / quality.sum()


# 2. The same popping compute_loss with the padding clamped, but each example's mean over its real tokens divides by
#    their count unguarded: in step 3 one row is padding only (an empty document the packer let through), 0 / 0.
def pop_empty_mean_loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    labels = inputs.pop("labels")
    quality = inputs.pop("quality")
    logp = F.log_softmax(model(**inputs)[:, :-1], dim=-1)
    targets = labels[:, 1:]
    mask = (targets != -100).float()
    token_logp = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per_example = -(token_logp * mask).sum(-1) / mask.sum(-1)  # <origin:pop_empty_mean>
    return (per_example * quality).sum() / quality.sum()


# 3. Multi-task targets nested in the inputs (a detection- or multi-head-style collator): compute_loss pops the
#    targets dict, then the token labels FROM it. The entry copy is shallow: the nested dict is shared, so the re-run
#    meets it without its labels (KeyError) and the step is diagnosed from its forwards and taped loss code.
def nested_pop_gather_loss(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    targets = inputs.pop("targets")
    labels = targets.pop("tokens")
    quality = targets.pop("quality")
    logp = F.log_softmax(model(**inputs)[:, :-1], dim=-1)
    shifted = labels[:, 1:]
    mask = (shifted != -100).float()
    token_logp = logp.gather(-1, shifted.unsqueeze(-1)).squeeze(-1)  # <origin:nested_gather>
    per_example = -(token_logp * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return (per_example * quality).sum() / quality.sum()


def _lm_batches(kind: str) -> list[dict[str, Any]]:
    out = []
    for s in range(STEPS):
        g = _gen(1300 + s)
        ids = torch.randint(3, VOCAB, (4, 10), generator=g)
        mask = torch.ones(4, 10, dtype=torch.long)
        labels = ids.clone()
        if s == FAIL:
            if kind == "empty_row":  # a document that is padding only
                ids[2], mask[2], labels[2] = 0, 0, -100
            else:  # the short ends of documents, padded by the collator
                ids[:, 7:], mask[:, 7:], labels[:, 7:] = 0, 0, -100
        quality = 0.5 + torch.rand(4, generator=g)
        if kind == "nested":
            out.append({"input_ids": ids, "attention_mask": mask, "targets": {"tokens": labels, "quality": quality}})
        else:
            out.append({"input_ids": ids, "attention_mask": mask, "labels": labels, "quality": quality})
    return out


# 4. Dynamic Weight Average (Liu et al., MTAN) over two heads: the loss function is passed the list of past per-task
#    losses, weighs each task by the ratio of its last two losses and appends this step's. The auxiliary task's
#    labels are missing from the batch of step 1: its masked loss is exactly 0 there, and in step 3 the ratio over
#    it is x / 0 = inf, and the softmax of the weights NaN. The call's re-run must meet the history it met, not the
#    one with its own loss appended.
class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.main = nn.Linear(16, 1)
        self.aux = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.main(h).squeeze(-1), self.aux(h).squeeze(-1)


def dwa_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, aux: torch.Tensor, has_aux: torch.Tensor,
             history: list[torch.Tensor], temperature: float = 2.0) -> torch.Tensor:
    main_out, aux_out = model(x)
    losses = torch.stack([F.mse_loss(main_out, y),
                          ((aux_out - aux) ** 2 * has_aux).sum() / has_aux.sum().clamp(min=1)])
    if len(history) >= 2:
        ratio = history[-1] / history[-2]  # <origin:dwa_ratio>
        weights = 2 * torch.softmax(ratio / temperature, dim=0)
    else:
        weights = torch.ones(2)
    history.append(losses.detach())
    return (weights * losses).sum()


def _dwa_batches() -> list[tuple[torch.Tensor, ...]]:
    out = []
    for s in range(STEPS):
        g = _gen(1400 + s)
        has_aux = torch.zeros(8) if s == 1 else (torch.rand(8, generator=g) < 0.7).float()
        has_aux[0] = 1.0 if s != 1 else 0.0
        out.append((torch.randn(8, 6, generator=g), torch.randn(8, generator=g), torch.randn(8, generator=g), has_aux))
    return out


# ----------------------------------------------------------------------------------- the programs
class Case:
    """A program: its model, batches, the loss function and how the loop calls it."""

    def __init__(self, build: Callable[[], nn.Module], batches: Callable[[], list[Any]], loss: Callable[..., Any],
                 call: Callable[[Callable[..., Any], nn.Module, Any, list[Any]], torch.Tensor], want: Want | None,
                 raises: type | None = None) -> None:
        self.build, self.batches, self.loss, self.call = build, batches, loss, call
        self.want, self.raises = want, raises


def _hf_call(loss_fn: Callable[..., Any], model: nn.Module, batch: Any, state: list[Any]) -> torch.Tensor:
    return loss_fn(model, batch)


def _dwa_call(loss_fn: Callable[..., Any], model: nn.Module, batch: Any, history: list[Any]) -> torch.Tensor:
    x, y, aux, has_aux = batch
    return loss_fn(model, x, y, aux, has_aux, history)


CASES: dict[str, Case] = {
    "hf_compute_loss_pops_labels_gather_minus100_raises":
        Case(TinyLM, lambda: _lm_batches("short_ends"), pop_gather_loss, _hf_call,
             Want("exception", "forward", "aten.gather.default", None, "pop_gather", "label_out_of_range",
                  action="raised"), raises=RuntimeError),
    "hf_compute_loss_pops_labels_empty_document_mean":
        Case(TinyLM, lambda: _lm_batches("empty_row"), pop_empty_mean_loss, _hf_call,
             Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "pop_empty_mean", "div_by_zero")),
    "compute_loss_pops_nested_targets_gather_minus100_raises":
        Case(TinyLM, lambda: _lm_batches("nested"), nested_pop_gather_loss, _hf_call,
             Want("exception", "forward", "aten.gather.default", None, "nested_gather", "label_out_of_range",
                  action="raised"), raises=RuntimeError),
    "dwa_loss_appends_to_history_list_argument_zero_aux_loss":
        Case(TwoHeads, _dwa_batches, dwa_loss, _dwa_call,
             Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "dwa_ratio", "div_by_zero")),
    # must not fire: the labels clamped for the gather, the padding masked
    "quiet_hf_compute_loss_pops_labels_clamped":
        Case(TinyLM, lambda: _lm_batches("short_ends"), pop_gather_clamped_loss, _hf_call, None),
}


def _train(case: Case, mode: str | None) -> tuple[list[Any], BaseException | None, int | None, bool | None,
                                                  list[Any], Any]:
    """The loop (``mode`` None: without nantrace). Returns (incidents, error, error step, weights unchanged by the
    first blocked or raising step, the batches as the run left them, the guard)."""
    model = case.build()
    opt = sgd(model)
    batches, state = case.batches(), []
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) if mode else None
    loss_fn = guard.replayable(case.loss) if mode == "replayable" else case.loss
    error, error_step, unchanged = None, None, None
    try:
        for step, batch in enumerate(batches):
            before = snapshot(model)
            seen = len([i for i in guard.incidents if i.action != "logged"]) if guard else 0
            try:
                opt.zero_grad()
                loss = case.call(loss_fn, model, batch, state)
                if guard is None and not bool(torch.isfinite(loss)):
                    error, error_step = FloatingPointError("non-finite loss"), step
                    break
                loss.backward()
                opt.step()
            except Exception as exc:  # the script would have died here
                error, error_step = exc, step
                unchanged = same(before, snapshot(model)) if unchanged is None else unchanged
                break
            if guard is not None and unchanged is None and len([i for i in guard.incidents
                                                                if i.action != "logged"]) > seen:
                unchanged = same(before, snapshot(model))
    finally:
        if guard is not None:
            guard.close()
    return (list(guard.incidents) if guard else []), error, error_step, unchanged, batches, guard


# ----------------------------------------------------------------------------------- the check without nantrace
class FirstBad(TorchDispatchMode):
    """The op that raised, or the first op whose output holds NaN its inputs did not or an infinity from finite
    inputs (inputs read before the op runs); whether a module was running (torch's global module hooks) and the
    deepest line of this file on the stack."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.found: tuple[str, bool, int | None] | None = None

    def __enter__(self) -> "FirstBad":
        self._hooks = (nn.modules.module.register_module_forward_pre_hook(self._push),
                       nn.modules.module.register_module_forward_hook(self._pop))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)

    def _push(self, *_: Any) -> None:
        self.depth += 1

    def _pop(self, *_: Any) -> None:
        self.depth -= 1

    def _note(self, func: Any) -> None:
        frame, line = sys._getframe(), None
        while frame is not None and line is None:
            if frame.f_code.co_filename == __file__ and frame.f_code.co_name not in ("__torch_dispatch__", "_note"):
                line = frame.f_lineno
            frame = frame.f_back
        self.found = (str(func), self.depth > 0, line)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.found is None:
            flat = tree_flatten((args, kwargs))[0]
            ins = [t for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()]
            in_nan = any(bool(t.isnan().any()) for t in ins)
            in_bad = in_nan or any(not bool(t.isfinite().all()) for t in ins) or any(
                isinstance(v, float) and not math.isfinite(v) for v in flat)
        try:
            out = func(*args, **kwargs)
        except Exception:
            if self.found is None:
                self._note(func)
            raise
        if self.found is None:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if (any(bool(t.isnan().any()) for t in outs) and not in_nan) or (
                    any(bool(t.isinf().any()) for t in outs) and not in_bad):
                self._note(func)
        return out


@pytest.mark.parametrize("name", list(CASES))
def test_construction(name: str) -> None:
    """Plain torch: the loop first fails at step 3 (raising the case's error, or a non-finite loss), the batch is
    finite; replayed from copies of what the step received, the op that raised or first made a non-finite value is
    the expected one, outside the model, on the marked line. The quiet case trains through."""
    case = CASES[name]
    model, history = case.build(), []
    opt = sgd(model)
    for step, batch in enumerate(case.batches()):
        assert all(bool(torch.isfinite(t).all()) for t in tree_flatten(batch)[0]
                   if isinstance(t, torch.Tensor) and t.is_floating_point())
        received = _received(batch)
        state, past = {k: v.clone() for k, v in model.state_dict().items()}, list(history)
        opt.zero_grad()
        try:
            loss = case.call(case.loss, model, batch, history)
        except Exception as exc:
            assert case.raises is not None and type(exc) is case.raises, exc
            break
        if not bool(torch.isfinite(loss)):
            assert case.raises is None
            break
        loss.backward()
        opt.step()
    else:
        assert case.want is None, "the program never failed"
        return
    want = case.want
    assert want is not None and step == want.step
    model.load_state_dict(state)
    mode = FirstBad()
    with mode, torch.no_grad():
        try:
            case.call(case.loss, model, received, past)
        except Exception:
            pass
    assert mode.found == (want.op, False, JUDGE.marked(want.tag)[1])


def _received(batch: Any) -> Any:
    """A copy of the batch's containers (not its tensors), as the step received it."""
    if isinstance(batch, dict):
        return {k: _received(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_received(v) for v in batch)
    return batch


def _got(incidents: list[Any]) -> dict[str, Any] | None:
    return JUDGE.got(incidents)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_diagnosis(name: str, mode: str) -> None:
    case = CASES[name]
    incidents, error, error_step, unchanged, _, _ = _train(case, mode)
    if case.want is None:
        assert not incidents, [describe(i) for i in incidents]
        assert error is None, repr(error)
        return
    got = _got(incidents)
    assert got is not None, ("no incident", repr(error))
    assert got == JUDGE.want(case.want), [describe(i) + " | " + i.summary for i in incidents]
    if case.raises is not None:
        assert type(error) is case.raises and error_step == case.want.step, (error, error_step)
    else:
        assert error is None, repr(error)
    assert unchanged is True
    details = [i for i in incidents if i.action != "logged"][0].details
    if mode == "replayable":  # the call itself re-ran as it ran, except where a nested dict it popped is shared
        fell_back = {k for k in ("replayable_call_raised", "replayable_call_finite", "rerun_skipped") if k in details}
        assert fell_back == ({"replayable_call_raised"} if name.startswith("compute_loss_pops_nested") else set()), \
            details


@pytest.mark.parametrize("name", ["hf_compute_loss_pops_labels_gather_minus100_raises",
                                  "hf_compute_loss_pops_labels_empty_document_mean",
                                  "dwa_loss_appends_to_history_list_argument_zero_aux_loss"])
def test_the_users_containers_are_left_as_a_plain_run_left_them(name: str) -> None:
    """The re-runs pop from and append to copies: after the run each batch dict (its keys, the same tensor objects)
    and the history list are what the same loop left without nantrace."""
    case = CASES[name]
    plain = _train(case, None)
    watched = _train(case, "replayable")
    assert watched[0], "no incident"
    for a, b in zip(plain[4][:FAIL + 1], watched[4][:FAIL + 1]):  # the plain loop stopped at the failure
        if isinstance(a, dict):
            assert list(a) == list(b)
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_dwa_history_list_is_left_as_a_plain_run_left_it() -> None:
    case = CASES["dwa_loss_appends_to_history_list_argument_zero_aux_loss"]
    histories: list[list[Any]] = []

    def call(loss_fn: Callable[..., Any], model: nn.Module, batch: Any, history: list[Any]) -> torch.Tensor:
        if not histories or histories[-1] is not history:
            histories.append(history)
        return _dwa_call(loss_fn, model, batch, history)

    case = Case(case.build, case.batches, case.loss, call, case.want)
    _train(case, None)
    _train(case, "replayable")
    plain, watched = histories
    assert len(plain) == FAIL + 1 and len(watched) == STEPS  # one entry a real call, none from the re-runs
    assert all(torch.equal(a, b) for a, b in zip(plain, watched[:FAIL + 1]))


def test_entry_copies_are_shallow_and_bounded() -> None:
    """The record keeps the dict as received (the popped keys with the very same tensors, no tensor copied); the
    user's dict is the one the call popped from; a list longer than ``ENTRY_COPY_MAX`` is kept as it is."""
    from nantrace.step_capture import ENTRY_COPY_MAX

    model = TinyLM()
    opt = sgd(model)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    seen: dict[str, Any] = {}

    def loss(model: nn.Module, inputs: dict[str, torch.Tensor], big: list[int]) -> torch.Tensor:
        labels = inputs.pop("labels")
        inputs.pop("quality")
        big.append(0)
        return F.cross_entropy(model(**inputs).flatten(0, 1), labels.flatten())

    try:
        batch = _lm_batches("short_ends")[0]
        kept = dict(batch)
        big = list(range(ENTRY_COPY_MAX + 1))
        opt.zero_grad()
        guard.replayable(loss)(model, batch, big).backward()
        record = guard.recorder.capture.calls[-1]
        seen["args"] = record.args
        opt.step()
    finally:
        guard.close()
    inputs, big_kept = seen["args"][1], seen["args"][2]
    assert inputs is not batch and list(batch) == ["input_ids", "attention_mask"]
    assert list(inputs) == list(kept) and all(inputs[k] is kept[k] for k in kept)
    assert big_kept is big
