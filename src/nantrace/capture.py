"""What a step leaves behind for a replay: model inputs, RNG and autocast state,
buffers as they were, and the gradient that arrived at the model's outputs.

Nothing here copies a tensor the user already holds; buffers (small: BatchNorm
statistics, masks) are the only copies, and only when ``Config.snapshot_buffers``.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
from typing import Any

import torch


@dataclasses.dataclass
class AutocastState:
    cpu_enabled: bool
    cpu_dtype: torch.dtype
    cuda_enabled: bool
    cuda_dtype: torch.dtype

    @classmethod
    def current(cls) -> "AutocastState":
        """The autocast state now. With no autocast on anywhere (one query), the dtypes only
        describe the state: one shared state, made with the dtypes of the first time autocast was
        found off, is returned (a forward and a loss tape take this twice a step; nothing writes it)."""
        if not _any_autocast_enabled():
            global _AUTOCAST_OFF
            if _AUTOCAST_OFF is None:
                _AUTOCAST_OFF = cls(cpu_enabled=False, cpu_dtype=torch.get_autocast_dtype("cpu"),
                                    cuda_enabled=False, cuda_dtype=torch.get_autocast_dtype("cuda"))
            return _AUTOCAST_OFF
        return cls(
            cpu_enabled=torch.is_autocast_enabled("cpu"),
            cpu_dtype=torch.get_autocast_dtype("cpu"),
            cuda_enabled=torch.is_autocast_enabled("cuda"),
            cuda_dtype=torch.get_autocast_dtype("cuda"),
        )

    @property
    def low_precision(self) -> bool:
        return self.cpu_enabled or self.cuda_enabled

    def contexts(self) -> list[Any]:
        out = []
        if self.cpu_enabled:
            out.append(torch.autocast("cpu", dtype=self.cpu_dtype))
        if self.cuda_enabled:
            out.append(torch.autocast("cuda", dtype=self.cuda_dtype))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "cpu_enabled": self.cpu_enabled,
            "cpu_dtype": str(self.cpu_dtype),
            "cuda_enabled": self.cuda_enabled,
            "cuda_dtype": str(self.cuda_dtype),
        }


_AUTOCAST_OFF: AutocastState | None = None
"""The state :meth:`AutocastState.current` returns while autocast is off everywhere."""


def _any_autocast_enabled() -> bool:
    """Whether autocast is on for any device (one call into torch where it has the query)."""
    query = getattr(torch._C, "_is_any_autocast_enabled", None)
    if query is not None:
        return bool(query())
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


@dataclasses.dataclass
class RngState:
    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None
    python: Any = None
    """``random.getstate()`` (``current(host=True)``: a ``replayable`` call's entry, a re-run's scope), else None."""
    numpy: Any = None
    """``numpy.random.get_state()`` when numpy was already imported (``host=True``), else None."""

    @classmethod
    def current(cls, host: bool = False) -> "RngState":
        """torch's generators; with ``host`` also Python's ``random`` and NumPy's global stream (the user's loss
        code draws from them: mixup's ``np.random.beta``), taken per ``replayable`` call only: about 60 us, most of it
        ``np.random.get_state()`` copying its 624-word key (torch's alone: about 2 us)."""
        cuda = None
        if torch.cuda.is_initialized():  # initialised implies available, and the test is ten times cheaper
            cuda = torch.cuda.get_rng_state_all()
        if not host:
            return cls(cpu=torch.get_rng_state(), cuda=cuda)
        np = sys.modules.get("numpy")  # not imported for this: a program without numpy draws nothing from it
        return cls(cpu=torch.get_rng_state(), cuda=cuda, python=random.getstate(),
                   numpy=np.random.get_state() if np is not None else None)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.python is not None:
            random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)


@dataclasses.dataclass
class ForwardRecord:
    """One call of the watched model's forward during a training step."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: RngState
    autocast: AutocastState
    buffers: dict[str, torch.Tensor] | None
    output_grads: list[tuple[int, torch.Tensor]] = dataclasses.field(default_factory=list)
    outputs: list[Any] = dataclasses.field(default_factory=list)
    """Weak references to the forward's floating outputs, so a replay of the loss code can be
    fed the replayed outputs in their place (one dataflow graph from the model to the loss)."""
    call_site: str | None = None
    """The user's line that called the model (``path:LINE``): where a replay attributes the model's
    ops when no line of the user's own runs inside the model (a bare ``nn.Sequential``)."""
    grad_enabled: bool = True
    """False for a forward run under ``torch.no_grad()`` inside the step (pseudo-labels, a PPO
    policy's old log-probabilities, a DPO reference pass): replayed under no_grad too, so that its
    outputs feed the replayed loss code without adding a gradient path the real step did not have."""
    tape_at: int = 0
    """How many loss-code calls the step's tape had kept when this forward began: a replay of the
    whole step issues them first (the real order: a part of the model called on a value the loss
    code made, a micro-batch's forward after the previous one's loss)."""
    substitutes: dict[str, Any] | None = None
    """The tensors that stood in for the model's parameters during this call (``torch.func.functional_call``
    with fast weights: MAML's inner loop, SAM's perturbed weights), by parameter name; ``None`` when the
    model ran on its own parameters. A replay runs the call with them (replayed where the step's code
    made them)."""
    abandoned_loss: tuple[Any, torch.Tensor] | None = None
    """(the loss tape's :class:`~nantrace.loss_tape.Ref`, the value) of the last scalar the step's code made from
    this forward before it went on to another forward with no ``backward()`` in between: the loss of a sub-step
    a loop may have abandoned (``if not torch.isfinite(loss): continue``). Judged by the step's check only when
    no gradient reached this forward's outputs."""
    module: str = ""
    """The dotted path of the part of the watched model this call ran, ``""`` for the model itself:
    loss code that calls ``model.query_encoder(...)`` or a root method such as ``model.encode(x)``
    never runs the model's own forward, and its parts' calls are what the step is replayed from."""


@dataclasses.dataclass
class CallRecord:
    """One call of a ``guard.replayable`` loss function during a training step."""

    fn: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: RngState
    autocast: AutocastState
    buffers: dict[str, torch.Tensor] | None
    loss: torch.Tensor | None = None
    entry_values: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    """(argument, a copy of it as the call received it) for each tensor argument the call wrote in place (taken
    from the step's tapes' before-write copies, :attr:`nantrace.loss_tape.LossTape.before_write`): a re-run starts
    from these values, not from what the call left (``rewards.sub_(mean).div_(std)`` on the batch's tensor)."""


class InputPolicy:
    """How a recorder's captures reduce the model's inputs: their norms, in the step check's own pass
    (the default), or their extremes as each forward begins (``extremes_now``: set for good by the check
    the first time an input's norm was not finite and its extremes were, an additive ``-inf`` mask)."""

    __slots__ = ("extremes_now",)

    def __init__(self) -> None:
        self.extremes_now = False


class StepCapture:
    """Everything the guard gathered between two optimizer steps.

    The model's input and output finiteness is kept as each floating tensor's minimum and
    maximum (one ``aminmax`` kernel per tensor in the forward hooks, no flag arithmetic there):
    the step's check reads them in its one host transfer and judges them on the host
    (:func:`nantrace.detection.sentinel.stage`), so a healthy step runs no finiteness kernel at all.
    :attr:`inputs_ok` / :attr:`outputs_ok` form a device flag on demand (bundle, localiser).
    """

    __slots__ = ("losses", "forwards", "calls", "_input_extremes", "_pending_inputs", "output_extremes", "inputs_flag",
                 "outputs_flag", "local_grads_ok", "tape", "prelude", "gradient_tape", "input_policy",
                 "abandoned")

    def __init__(self, losses: list[torch.Tensor] | None = None, forwards: list[ForwardRecord] | None = None,
                 calls: list[CallRecord] | None = None, inputs_ok: torch.Tensor | None = None,
                 outputs_ok: torch.Tensor | None = None, local_grads_ok: torch.Tensor | None = None,
                 tape: Any = None, prelude: Any = None, gradient_tape: Any = None) -> None:
        self.losses: list[torch.Tensor] = [] if losses is None else losses
        self.forwards: list[ForwardRecord] = [] if forwards is None else forwards
        self.calls: list[CallRecord] = [] if calls is None else calls
        self._input_extremes: list[torch.Tensor] = []
        self._pending_inputs: list[tuple[torch.Tensor, int]] = []  # (input, its version when the forward began)
        self.input_policy = InputPolicy()
        """How the inputs are reduced (shared by a recorder's captures: what one step learned holds for the next)."""
        self.output_extremes: list[torch.Tensor] = []
        """The same for the model's floating outputs."""
        self.inputs_flag: torch.Tensor | None = inputs_ok
        """An explicit 0-dim bool input flag (``and_inputs``), on top of the extremes; usually ``None``."""
        self.outputs_flag: torch.Tensor | None = outputs_ok
        """An explicit 0-dim bool output flag (a replay sets the one its bundle recorded); usually ``None``."""
        self.local_grads_ok = local_grads_ok
        self.tape = tape
        """The step's :class:`~nantrace.loss_tape.LossTape` (the loss code's calls), when one is kept."""
        self.prelude = prelude
        """The step's code before the model's forward, taped (a prelude :class:`~nantrace.loss_tape.LossTape`)."""
        self.gradient_tape = gradient_tape
        """The step's code between ``backward()`` and ``optimizer.step()``, taped (a gradient
        :class:`~nantrace.loss_tape.LossTape`)."""
        self.abandoned = False
        """A forward of the step kept the loss its code left without ``backward()`` (:attr:`ForwardRecord.abandoned_loss`)."""

    def note_inputs(self, tensors: list[torch.Tensor]) -> None:
        """Keep the forward's floating inputs to be judged by the step's check: no kernel here. The check
        of one process on the CPU takes their norms in the same pass as the gradients' (a finite norm: a
        finite input; any other, judged exactly), any other check their extremes (:attr:`input_extremes`).
        An input written in place after the forward began (its version moved) is not judged. Once a run's
        inputs held ``-inf`` (an additive mask: its norm is never finite), they are reduced to extremes here,
        as the forward begins, so that no step needs a second read to judge them."""
        if self.input_policy.extremes_now:
            _extend_extremes(self._input_extremes, tensors)
            return
        other = [t for t in tensors if t.is_nested or t.layout != torch.strided]
        if other:  # a nested or sparse tensor has no norm kernel: its extremes now, through its stored values
            _extend_extremes(self._input_extremes, other)
            tensors = [t for t in tensors if not (t.is_nested or t.layout != torch.strided)]
        self._pending_inputs.extend((t, t._version) for t in tensors if t.numel())

    def take_inputs(self) -> list[torch.Tensor]:
        """The noted inputs not yet reduced and still as the forward received them (for the check that
        judges them itself: :func:`nantrace.detection.sentinel.stage`'s ``input_tensors``)."""
        pending, self._pending_inputs = self._pending_inputs, []
        return [t for t, version in pending if t._version == version]

    @property
    def input_extremes(self) -> list[torch.Tensor]:
        """Minimum and maximum of every floating model input, in pairs: float32/16/bf16 as they are
        (NaN/Inf propagate into them), other dtypes as 0.0/NaN in float32 (finiteness only); the noted
        inputs are reduced here, at the first ask (one ``aminmax`` each, no sync)."""
        if self._pending_inputs:
            _extend_extremes(self._input_extremes, self.take_inputs())
        return self._input_extremes

    @input_extremes.setter
    def input_extremes(self, extremes: list[torch.Tensor]) -> None:
        self._input_extremes, self._pending_inputs = extremes, []

    def note_outputs(self, tensors: list[torch.Tensor]) -> None:
        """Keep the extremes of the forward's floating outputs (one ``aminmax`` each, no sync)."""
        _extend_extremes(self.output_extremes, tensors)

    @property
    def inputs_ok(self) -> torch.Tensor | None:
        """0-dim bool: every model input of the step was finite (``None``: none checked)."""
        return _combine_flag(self.inputs_flag, self.input_extremes)

    @inputs_ok.setter
    def inputs_ok(self, flag: torch.Tensor | None) -> None:
        self.inputs_flag, self.input_extremes = flag, []

    @property
    def outputs_ok(self) -> torch.Tensor | None:
        """0-dim bool: every model output of the step was finite (``None``: none checked)."""
        return _combine_flag(self.outputs_flag, self.output_extremes)

    @outputs_ok.setter
    def outputs_ok(self, flag: torch.Tensor | None) -> None:
        self.outputs_flag, self.output_extremes = flag, []

    def and_inputs(self, flag: torch.Tensor) -> None:
        self.inputs_flag = flag if self.inputs_flag is None else self.inputs_flag & flag

    def and_outputs(self, flag: torch.Tensor) -> None:
        self.outputs_flag = flag if self.outputs_flag is None else self.outputs_flag & flag

    def and_local_grads(self, flag: torch.Tensor) -> None:
        self.local_grads_ok = flag if self.local_grads_ok is None else self.local_grads_ok & flag.to(self.local_grads_ok.device)

    def with_forwards(self, forwards: list[ForwardRecord]) -> "StepCapture":
        """A copy of this capture with other forward records (e.g. rescaled inputs), the rest shared."""
        return self._copy(forwards, self.calls)

    def abandoned_sub_step(self, k: int) -> "StepCapture":
        """The step up to the loss of its forward ``k``, which the step's code made and left without
        ``backward()`` (:attr:`ForwardRecord.abandoned_loss`): forwards ``0..k`` and the loss tape up to that loss,
        as a capture a replay can localise (its check: that loss alone)."""
        record = self.forwards[k]
        assert record.abandoned_loss is not None and self.tape is not None
        ref, value = record.abandoned_loss
        out = self._copy(self.forwards[:k + 1], [])
        out.tape = self.tape.sub_step(ref.entry + 1, ref)
        out.losses = [value]
        return out

    def without_calls(self) -> "StepCapture":
        """A copy of this capture without its ``replayable`` calls: the step as zero-code mode sees it
        (the model's forwards and the loss tape), the rest shared."""
        return self._copy(self.forwards, [])

    def _copy(self, forwards: list[ForwardRecord], calls: list[CallRecord]) -> "StepCapture":
        out = StepCapture(losses=self.losses, forwards=forwards, calls=calls, inputs_ok=self.inputs_flag,
                          outputs_ok=self.outputs_flag, local_grads_ok=self.local_grads_ok, tape=self.tape,
                          prelude=self.prelude, gradient_tape=self.gradient_tape)
        out.input_extremes, out.output_extremes = self.input_extremes, self.output_extremes  # the inputs reduced first
        out.input_policy = self.input_policy
        return out


_EXACT_IN_FLOAT32 = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes whose values keep their finiteness in float32 (the step's read vector)."""


def _extend_extremes(into: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        if t.is_nested:  # (a model that returns or takes a nested tensor): its components, flattened
            parts = [p.reshape(-1) for p in t.detach().unbind()]
            t = torch.cat(parts) if parts else torch.zeros(0, dtype=t.dtype)
        elif t.layout == torch.sparse_coo:  # a sparse tensor (a graph's adjacency): its stored values
            t = t.detach()._values()
        elif t.layout != torch.strided:  # compressed layouts (CSR, CSC, BSR, BSC)
            t = t.detach().values()
        if t.numel():
            lo, hi = torch.aminmax(t.detach())
            if lo.dtype not in _EXACT_IN_FLOAT32:  # float64: 1e300 is finite but not in float32; keep 0.0/NaN
                lo, hi = torch.where(lo == float("-inf"), 0.0, lo * 0).float(), (hi * 0).float()
            into.append(lo)
            into.append(hi)


def extremes_ok(extremes: torch.Tensor) -> torch.Tensor:
    """Per (minimum, maximum) pair: the tensor counts as finite. The maximum must be finite (no NaN,
    no +inf); the minimum may be ``-inf``: an additive attention mask (``-inf`` where a position is
    hidden) is a valid input and output, and what it does to the loss or the gradients is judged there."""
    return torch.isfinite(extremes[1::2])


def extremes_ok_on_host(values: list[float]) -> bool:
    """:func:`extremes_ok` for the pairs read to the host, all of them together."""
    return all(map(math.isfinite, values[1::2]))


def _combine_flag(flag: torch.Tensor | None, extremes: list[torch.Tensor]) -> torch.Tensor | None:
    """An explicit flag and'ed with the finiteness of the kept extremes (``None``: nothing checked)."""
    if not extremes:
        return flag
    device = extremes[0].device
    ok = extremes_ok(torch.stack([e.to(device) for e in extremes])).all()
    return ok if flag is None else flag.to(device) & ok


def floating_tensors(obj: Any, _depth: int = 0) -> list[torch.Tensor]:
    """Floating-point tensors inside a (nested) structure of args/outputs."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if _depth > 4:
        return []
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in floating_tensors(v, _depth + 1)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in floating_tensors(v, _depth + 1)]
    if hasattr(obj, "__dataclass_fields__") or hasattr(obj, "to_tuple"):
        values = obj.to_tuple() if hasattr(obj, "to_tuple") else [getattr(obj, f) for f in obj.__dataclass_fields__]
        return [t for v in values for t in floating_tensors(v, _depth + 1)]
    return []


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor, True when every element of ``t`` (non-empty) is finite; no sync.

    One min/max pass: a NaN propagates into both, an infinity lands in one of them. On the
    CPU this is about ten times cheaper than ``isfinite(t).all()``, which writes a mask.
    """
    lo, hi = torch.aminmax(t.detach())
    return torch.isfinite(lo) & torch.isfinite(hi)


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """A 0-dim bool tensor, True when every element of every tensor is finite; no sync."""
    flags = [finite_flag(t) for t in tensors if t.numel()]
    if not flags:
        return None
    if len(flags) == 1:
        return flags[0]
    device = flags[0].device
    return torch.stack([f.to(device) for f in flags]).all()


class BufferPlan:
    """Which buffers a replay needs as they were before a forward, and the copy of them.

    Copy-on-write in spirit: a buffer is copied before a forward only if the forward
    changes it (learned from version counters on the first captured forward) *and* its old
    value can change what the forward computes. A BatchNorm in training mode normalises with
    the batch's own statistics: its running mean, variance and batch counter are written but
    never read, so they are not copied (a replay saves and puts back every buffer around itself,
    so the running statistics end as they were). What remains (a spectral norm's power-iteration
    vector, a step counter, an EMA the forward reads) is copied from a cached list of
    ``(module, name)`` slots: no walk over the module tree per forward.
    """

    def __init__(self, root: torch.nn.Module, enabled: bool) -> None:
        self.root = root
        self.enabled = enabled
        self._learning = True
        self._slots: list[tuple[str, torch.nn.Module, str]] = []
        self._versions: dict[str, int] = {}

    def snapshot(self) -> dict[str, torch.Tensor] | None:
        """The buffers to keep for this forward (``None`` when buffers are not captured)."""
        if not self.enabled:
            return None
        if self._learning:  # first forward: every buffer, with its version, to learn which ones change
            out = {}
            for name, buf in self.root.named_buffers():
                out[name] = buf.detach().clone()
                self._versions[name] = buf._version
            return out
        out = {}
        for name, module, attr in self._slots:
            buf = module._buffers.get(attr)
            if buf is None or _reads_batch_statistics(module, attr):
                continue
            out[name] = buf.detach().clone()
        return out

    def learn(self) -> None:
        """After the first captured forward: keep the slots of the buffers it changed."""
        if not self._learning or not self.enabled:
            return
        self._learning = False
        modules = dict(self.root.named_modules())
        for name, buf in self.root.named_buffers():
            if name in self._versions and buf._version != self._versions[name]:
                owner, _, attr = name.rpartition(".")
                self._slots.append((name, modules[owner], attr))
        self._versions.clear()

    @property
    def mutable(self) -> set[str] | None:
        """Names of the buffers the forward changes (``None`` before the first forward)."""
        return None if self._learning else {name for name, _, _ in self._slots}


_BN_STATS = frozenset({"running_mean", "running_var", "num_batches_tracked"})


class RunningStatistics:
    """A copy of the model's running statistics (a norm layer's ``running_mean``/``running_var``) as the last
    applied step left them, so that a blocked step can put back what its forward averaged a NaN into.

    A training-mode BatchNorm writes its running statistics in the forward, before nantrace has judged the step:
    a batch with a NaN (or a sqrt of a negative before the norm) leaves them NaN, and skipping the update does
    not undo that; every later evaluation-mode forward would be NaN. The copy is refreshed after each applied
    step by one ``_foreach_copy_`` (no allocation; nothing for a model without such buffers); a blocked step
    puts back, exactly, the statistics it left non-finite (one read, on that step only)."""

    def __init__(self, root: torch.nn.Module) -> None:
        self._slots = [(path, module, name) for path, module in root.named_modules()
                       if isinstance(module, torch.nn.modules.batchnorm._NormBase) and module.track_running_stats
                       for name in ("running_mean", "running_var") if module._buffers.get(name) is not None]
        self._live: list[torch.Tensor] = []
        self._kept: list[torch.Tensor] = []

    def __bool__(self) -> bool:
        return bool(self._slots)

    def _current(self) -> list[torch.Tensor] | None:
        live = [module._buffers.get(name) for _, module, name in self._slots]
        if any(t is None or not t.is_floating_point() for t in live):
            return None
        return live  # type: ignore[return-value]

    def keep(self) -> None:
        """After an applied step: copy the statistics as they are now."""
        live = self._current()
        if live is None:
            self._live, self._kept = [], []
            return
        with torch.no_grad():
            if len(live) != len(self._live) or any(a is not b for a, b in zip(live, self._live)) or any(
                    a.shape != b.shape or a.dtype != b.dtype or a.device != b.device for a, b in zip(live, self._kept)):
                self._live, self._kept = live, [t.detach().clone() for t in live]
            else:
                torch._foreach_copy_(self._kept, live)

    def put_back_nonfinite(self) -> list[str]:
        """After a blocked step: the statistics it left non-finite get their kept values back. Returns their names."""
        live = self._current()
        if not self._kept or live is None or any(a is not b for a, b in zip(live, self._live)):
            return []
        bad = [i for i, t in enumerate(live) if not bool(torch.isfinite(t).all())]
        with torch.no_grad():
            for i in bad:
                live[i].copy_(self._kept[i])
        return [f"{self._slots[i][0]}.{self._slots[i][2]}".lstrip(".") for i in bad]


def _reads_batch_statistics(module: torch.nn.Module, attr: str) -> bool:
    """True for a BatchNorm running statistic in training mode: written, not read, by the forward."""
    return attr in _BN_STATS and module.training and isinstance(module, torch.nn.modules.batchnorm._NormBase)
