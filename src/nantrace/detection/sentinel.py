"""The per-step sentinel: one fused reduction, one host synchronisation.

Everything the guard needs to decide about a step (loss, every gradient's norm, the
parameters' norm, the model input/output finiteness flags, the loss scale) is reduced
on the device into one vector and copied to the host once, the way
``clip_grad_norm_`` and GradScaler's ``found_inf`` work.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import torch

from ..capture import _EXACT_IN_FLOAT32, _extend_extremes, extremes_ok, extremes_ok_on_host
from .scaler import unusable_scale

_F32_MAX = float(torch.finfo(torch.float32).max)


@dataclasses.dataclass
class StepHealth:
    """Host-side figures of one step, as read by the sentinel."""

    loss: float | None
    grad_norm: float | None
    param_norm: float | None
    inputs_finite: bool
    outputs_finite: bool
    local_grads_finite: bool
    """This rank's own gradients before the data-parallel all-reduce (True when not distributed)."""
    scale: float | None
    grad_norms: list[float]
    param_norms: list[float]

    @property
    def loss_finite(self) -> bool:
        return self.loss is None or math.isfinite(self.loss)

    @property
    def grads_finite(self) -> bool:
        return self.grad_norm is None or math.isfinite(self.grad_norm)

    @property
    def params_finite(self) -> bool:
        return self.param_norm is None or math.isfinite(self.param_norm)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2); the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def _norms(tensors: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Per-tensor L2 norms accumulated in ``dtype`` (float32 unless asked), in one foreach kernel
    where the tensors share a device (per tensor otherwise). DTensor shards are reduced as their local shard."""
    if not tensors:
        return []
    if any(map(hasattr, tensors, repeat("to_local"))):  # a C-level scan, no Python loop on plain tensors
        tensors = [local(t) for t in tensors]
    if dtype == torch.float32 and tensors[0].device.type == "cpu":
        large = _dot_candidates(tensors)
        if large and _dot_pays([tensors[i] for i in large]):
            return _norms_by_dot(tensors, large)
    return _foreach_norms(tensors, dtype)


def _foreach_norms(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    try:
        return list(torch._foreach_norm(list(tensors), 2, dtype=dtype))
    except (RuntimeError, TypeError):
        return [torch.linalg.vector_norm(t, dtype=dtype) for t in tensors]


DOT_MIN_NUMEL = 1 << 17
"""A contiguous float32 CPU tensor with at least this many elements (512 KiB) may take its sum of
squares from BLAS ``dot`` instead of ATen's norm kernel: measured on a 2-vCPU Xeon, ``dot`` reads
such tensors 1.4-2x faster (the MLP's gradient pass 360 → 240 µs, the tiny GPT's 1.6 → 1.2 ms),
while on smaller ones the extra call per tensor costs more than it saves (docs/benchmarks.md)."""

_DOT_VERDICT: list[bool] = []
"""Whether ``dot`` beat the norm kernel on this machine (decided once per process, at the first
step that has large tensors: :func:`_dot_pays`)."""


def _dot_candidates(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Indices of the tensors worth a ``dot``: contiguous float32, ``DOT_MIN_NUMEL`` elements or more."""
    return [i for i, t in enumerate(tensors)
            if t.dtype == torch.float32 and t.numel() >= DOT_MIN_NUMEL and t.is_contiguous()]


def _sums_of_squares(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``dot(x, x)`` per tensor: float32 sums of squares, like the norm kernel's accumulator (a
    NaN stays NaN, an Inf or a sum beyond float32 becomes Inf), so finiteness reads the same."""
    with torch.no_grad():
        flat = [t.view(-1) for t in tensors]
        return [torch.dot(f, f) for f in flat]


def _norms_by_dot(tensors: Sequence[torch.Tensor], large: list[int]) -> list[torch.Tensor]:
    """The norms in ``tensors``' order: the ``large`` ones as the root of a ``dot``, the rest from
    one ``_foreach_norm``."""
    squares = _sums_of_squares([tensors[i] for i in large])
    torch._foreach_sqrt_(squares)
    chosen = set(large)
    rest = [t for i, t in enumerate(tensors) if i not in chosen]
    small = iter(_foreach_norms(rest, torch.float32) if rest else ())
    big = iter(squares)
    return [next(big) if i in chosen else next(small) for i in range(len(tensors))]


def _dot_pays(large: Sequence[torch.Tensor]) -> bool:
    """Whether ``dot`` is faster than the norm kernel on these tensors, timed once per process
    (best of three each after a warm-up, alternated; a few milliseconds once). The answer never changes a verdict,
    only the time it takes: both are float32 sums of squares."""
    if not _DOT_VERDICT:
        import time

        def timed(fn: Any) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        by_dot, by_norm = [], []
        for _ in range(4):  # the first of each is a warm-up (BLAS sets itself up at its first call)
            by_norm.append(timed(lambda: torch._foreach_norm(list(large), 2, dtype=torch.float32)))
            by_dot.append(timed(lambda: _sums_of_squares(large)))
        _DOT_VERDICT.append(min(by_dot[1:]) < min(by_norm[1:]))
    return _DOT_VERDICT[0]


@dataclasses.dataclass
class StagedHealth:
    """The step's figures reduced on the device, not yet read (see :func:`stage`).

    ``vector`` is ``[loss, grad norm, param norm, inputs ok, outputs ok, local grads ok,
    scale, per-gradient norms..., per-parameter norms..., input extremes..., output extremes...]``
    in float32. The flags in the head are the explicit ones (1.0 when only extremes were given):
    the extremes are judged on the host by :func:`finish`, and on the device only when a caller
    asks for :attr:`local_flags` (the cross-rank agreement). A caller may add device work that
    depends on the vector before the one read.
    """

    vector: torch.Tensor
    grads: Sequence[torch.Tensor]
    params: Sequence[torch.Tensor]
    has_loss: bool
    grads_scaled: bool
    grad_norms: list[torch.Tensor]
    param_norms: list[torch.Tensor]
    n_input_extremes: int = 0
    """How many input extremes follow the per-parameter norms in ``vector`` (judged on the host)."""
    n_output_extremes: int = 0
    """How many output extremes follow them."""
    exact: bool = False
    """Norms accumulated in float64: a non-finite norm means a non-finite element (no recount)."""
    host_totals: bool = False
    """The totals (``vector[1:3]``) are NaN placeholders: :func:`finish` forms them on the host from
    the per-tensor norms (:func:`stage` with ``host_totals``). Device-side callers never ask for it."""
    squared: tuple[int, ...] = ()
    """Indices into the per-tensor values (gradients, then parameters, then inputs) that are sums of
    squares, not norms (a ``dot`` whose root is taken on the host)."""
    inputs: tuple[torch.Tensor, ...] = ()
    """Model inputs whose norms follow the per-parameter ones (host path only): a finite norm is a
    finite input; :func:`finish` judges a non-finite one by its extremes (an additive mask's ``-inf``
    is a valid input, a finite input can overflow a float32 sum of squares)."""
    input_policy: Any = None
    """The recorder's :class:`~nantrace.capture.InputPolicy`: told when an input's norm was not finite
    while its extremes were (an additive mask), so that later steps reduce the inputs to extremes."""

    @property
    def loss(self) -> torch.Tensor:
        return self.vector[0]

    @property
    def grad_norm(self) -> torch.Tensor:
        return self.vector[1]

    @property
    def param_norm(self) -> torch.Tensor:
        return self.vector[2]

    @property
    def scale(self) -> torch.Tensor:
        return self.vector[6]

    @property
    def local_flags(self) -> torch.Tensor:
        """``[inputs ok, outputs ok, local grads ok]`` (1.0 = finite), the extremes included
        (formed on the device here, on demand: a single process never asks)."""
        flags = self.vector[3:6]
        if not (self.n_input_extremes or self.n_output_extremes):
            return flags
        start = 7 + len(self.grad_norms) + len(self.param_norms) + len(self.inputs)
        values = self.vector[start:]
        n_in = self.n_input_extremes
        one = torch.ones((), dtype=torch.bool, device=flags.device)
        ok = torch.stack([extremes_ok(values[:n_in]).all() if n_in else one,
                          extremes_ok(values[n_in:]).all() if self.n_output_extremes else one, one])
        return flags * ok.to(flags.dtype)

    def unscaled_grad_norm64(self) -> torch.Tensor:
        """The total gradient norm in float64 as :func:`finish` computes it on the host (divided by the
        loss scale when the gradients are scaled), for device-side comparisons that must agree with the
        host's. A scale the gradients cannot be unscaled from (0, infinite, or one whose float32
        reciprocal overflows: :func:`~nantrace.detection.scaler.unusable_scale`) gives NaN for a finite
        scaled norm: unknown, so no device verdict counts it finite (the host reads it as ``None``)."""
        g = self.grad_norm.to(torch.float64)
        if not self.grads_scaled:
            return g
        s = self.scale.to(torch.float64)
        usable = torch.isfinite(s) & (s != 0) & (s.reciprocal().abs() <= _F32_MAX)
        divided = g / torch.where(usable, s.abs(), torch.ones_like(s))
        unknown = torch.where(torch.isfinite(g), torch.full_like(g, math.nan), g)
        return torch.where(usable, divided, torch.where(torch.isnan(s), g, unknown))  # NaN: no scale was read


def stage(
    *,
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    losses: Sequence[torch.Tensor],
    inputs_ok: torch.Tensor | None,
    outputs_ok: torch.Tensor | None,
    local_grads_ok: torch.Tensor | None = None,
    scale: torch.Tensor | None,
    grads_scaled: bool,
    input_extremes: Sequence[torch.Tensor] = (),
    output_extremes: Sequence[torch.Tensor] = (),
    accumulate: torch.dtype = torch.float32,
    host_totals: bool = False,
    input_tensors: Sequence[torch.Tensor] = (),
    input_policy: Any = None,
) -> StagedHealth:
    """Reduce the step's tensors to one device vector (no host read).

    Five kernels whatever the model: one ``_foreach_norm`` over gradients and parameters
    together, one stack of those norms with the inputs' and outputs' extremes (``aminmax``
    values kept by the forward hooks: a finite maximum and a minimum that is not NaN exactly when
    every element is finite or ``-inf``, as in an additive mask: ``capture.extremes_ok``), one more
    ``_foreach_norm`` for both totals, one stack of the head and one concatenation. No finiteness kernel runs: the extremes are
    judged on the host after the read. Constants come from a per-device cache; no tensor is
    made per gradient or parameter beyond its norm.

    ``accumulate=torch.float64`` makes the norms exact about finiteness (float16/bfloat16/float32
    elements cannot overflow a float64 sum of squares), for a verdict that must be final on the
    device (``sync_free.py``); the vector is float64 then.
   
    ``host_totals`` (a caller that reads the vector at once and needs nothing of it on the device:
    one process on the CPU): the totals are left to :func:`finish` and the large tensors' roots too,
    so the step's vector is one stack: on a CPU each kernel is a call of several microseconds.

    ``input_tensors``: model inputs not yet reduced (``StepCapture.take_inputs``). The host path takes
    their norms with the gradients' (a finite norm is a finite input; :func:`finish` judges any other
    exactly); any other path reduces them to extremes here.
    """
    device = _pick_device(grads, params, losses)
    nan, one = _constants(device)
    exact = accumulate == torch.float64 and device.type != "mps"
    if host_totals and not exact and device.type == "cpu":
        return _stage_for_host(grads=grads, params=params, losses=losses, inputs_ok=inputs_ok, outputs_ok=outputs_ok,
                               local_grads_ok=local_grads_ok, scale=scale, grads_scaled=grads_scaled,
                               input_extremes=input_extremes, output_extremes=output_extremes, device=device,
                               inputs=input_tensors, input_policy=input_policy)
    if input_tensors:
        reduced: list[torch.Tensor] = list(input_extremes)
        _extend_extremes(reduced, list(input_tensors))
        input_extremes = reduced
    dtype = torch.float64 if exact else torch.float32
    ng = len(grads)
    norms = _norms([*grads, *params], dtype)
    gn, pn = norms[:ng], norms[ng:]
    nvec = _stack_on([*norms, *input_extremes, *output_extremes], device)
    gvec = nvec[:ng] if gn else None
    pvec = nvec[ng:len(norms)] if pn else None
    if nvec is not None and nvec.dtype != dtype:  # extremes in another dtype than StepCapture keeps
        nvec = nvec.to(dtype)
    totals = _totals(gvec, pvec, nan)
    head = [
        _mean_loss(losses, device) if losses else nan,
        totals[0],
        totals[1],
        _flag_on(inputs_ok, device, one),
        _flag_on(outputs_ok, device, one),
        _flag_on(local_grads_ok, device, one),
        scale.detach().to(device, torch.float32).reshape(()) if scale is not None else nan,
    ]
    head_vec = torch.stack([x.to(dtype) for x in head] if exact else head)  # bool flags become 1.0 = finite
    vec = torch.cat([head_vec, nvec]) if nvec is not None else head_vec
    return StagedHealth(vec, grads, params, bool(losses), grads_scaled, gn, pn, exact=exact,
                        n_input_extremes=len(input_extremes), n_output_extremes=len(output_extremes))


def _stage_for_host(*, grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor], losses: Sequence[torch.Tensor],
                    inputs_ok: torch.Tensor | None, outputs_ok: torch.Tensor | None,
                    local_grads_ok: torch.Tensor | None, scale: torch.Tensor | None, grads_scaled: bool,
                    input_extremes: Sequence[torch.Tensor], output_extremes: Sequence[torch.Tensor],
                    device: torch.device, inputs: Sequence[torch.Tensor] = (), input_policy: Any = None) -> StagedHealth:
    """:func:`stage` for a vector read at once on the CPU: the per-tensor values (``dot`` sums of
    squares for the large tensors, one ``_foreach_norm`` for the rest) and the head in one stack;
    the roots and the totals are taken by :func:`finish` on the host (float64 there). The model's
    ``inputs`` come last among the per-tensor values, reduced in the same pass (no kernel of their own)."""
    nan, one = _constants(device)
    inputs = [t if t.dtype in _EXACT_IN_FLOAT32 else t.float() for t in inputs if t.device == device]
    tensors = [*grads, *params, *inputs]
    if any(map(hasattr, tensors, repeat("to_local"))):
        tensors = [local(t) for t in tensors]
    squared: list[int] = []
    values: list[torch.Tensor] = []
    if tensors:
        large = _dot_candidates(tensors)
        if large and _dot_pays([tensors[i] for i in large]):
            squared = large
            values = _squares_and_norms(tensors, large)
        else:
            values = _foreach_norms(tensors, torch.float32)
    head = [
        _mean_loss(losses, device) if losses else nan, nan, nan,
        _flag_on(inputs_ok, device, one), _flag_on(outputs_ok, device, one), _flag_on(local_grads_ok, device, one),
        scale.detach().to(device, torch.float32).reshape(()) if scale is not None else nan,
    ]
    vec = torch.stack([*head, *values, *input_extremes, *output_extremes])
    if vec.dtype != torch.float32:
        vec = vec.to(torch.float32)
    ng, nw = len(grads), len(grads) + len(params)
    return StagedHealth(vec, grads, params, bool(losses), grads_scaled, values[:ng], values[ng:nw],
                        n_input_extremes=len(input_extremes), n_output_extremes=len(output_extremes),
                        host_totals=True, squared=tuple(squared), inputs=tuple(inputs), input_policy=input_policy)


def _squares_and_norms(tensors: Sequence[torch.Tensor], large: list[int]) -> list[torch.Tensor]:
    """In ``tensors``' order: the ``large`` ones' ``dot`` sums of squares, the rest's norms (one
    ``_foreach_norm``)."""
    squares = iter(_sums_of_squares([tensors[i] for i in large]))
    chosen = set(large)
    rest = [t for i, t in enumerate(tensors) if i not in chosen]
    small = iter(_foreach_norms(rest, torch.float32) if rest else ())
    return [next(squares) if i in chosen else next(small) for i in range(len(tensors))]


def _total(norms: list[float]) -> float:
    """The L2 norm of per-tensor norms, in float64 on the host: NaN if any is NaN, else inf if any is."""
    total = math.fsum(n * n for n in norms)
    return math.sqrt(total) if not math.isnan(total) else math.nan


def read(staged: StagedHealth, extra: torch.Tensor | None = None) -> tuple[list[float], Any]:
    """The one host read of the step: the staged vector, and ``extra`` (e.g. the all-reduced
    agreement vector, ``world_size`` long) in the same transfer. Returns (staged values as a
    list, extra values as a float64 NumPy array: no Python float per rank)."""
    if extra is None:
        return staged.vector.tolist(), None  # the one host synchronisation of the step
    n = staged.vector.numel()
    both = torch.cat([staged.vector.to(extra.device, extra.dtype), extra.reshape(-1)])
    if both.device.type == "cpu":
        host = both.numpy()  # the one host read of the step (local figures and agreement)
    else:
        copied = both.cpu()  # the one host synchronisation of the step (local figures and agreement)
        from ..dynamics._readback import _host_side

        with _host_side():  # the copy above is host memory now
            host = copied.numpy()
    return host[:n].tolist(), host[n:]


def finish(staged: StagedHealth, host: list[float]) -> StepHealth:
    """The host-side figures from the read vector; the rare float64 recount when a float32
    norm overflowed while every element is finite."""
    grads, params, gn, pn = staged.grads, staged.params, staged.grad_norms, staged.param_norms
    loss, gnorm, pnorm, in_ok, out_ok, local_ok, sc = host[:7]
    end = 7 + len(gn) + len(pn)
    grad_norms = host[7 : 7 + len(gn)]
    param_norms = host[7 + len(gn) : end]
    if staged.host_totals:
        nw = len(gn) + len(pn)
        for i in staged.squared:  # sums of squares (never negative): the root of NaN is NaN, of inf inf
            if i < len(gn):
                grad_norms[i] = math.sqrt(grad_norms[i])
            elif i < nw:
                param_norms[i - len(gn)] = math.sqrt(param_norms[i - len(gn)])
        gnorm, pnorm = _total(grad_norms), _total(param_norms)
    if staged.inputs:  # the model's inputs, by their norms (the roots of sums of squares alike)
        in_ok = in_ok and _inputs_finite(staged.inputs, host[end : end + len(staged.inputs)], staged.input_policy)
        end += len(staged.inputs)
    if staged.n_input_extremes or staged.n_output_extremes:  # the model's inputs and outputs, judged here
        mid = end + staged.n_input_extremes
        in_ok = in_ok and extremes_ok_on_host(host[end:mid])
        out_ok = out_ok and extremes_ok_on_host(host[mid : mid + staged.n_output_extremes])
    scale_value = sc if not math.isnan(sc) else None
    # A float32 norm can overflow while every element is finite (large gradients, or a
    # GradScaler's factor): only on that rare path, check exactly and recount in float64.
    if gn and not staged.exact and not math.isfinite(gnorm) and _exactly_finite(grads):
        grad_norms = [float(n) for n in _norms64(grads)]
        gnorm = math.sqrt(sum(n * n for n in grad_norms))
    if pn and not staged.exact and not math.isfinite(pnorm) and _exactly_finite(params):
        param_norms = [float(n) for n in _norms64(params)]
        pnorm = math.sqrt(sum(n * n for n in param_norms))
    if staged.grads_scaled and scale_value is not None and gn:
        gnorm, grad_norms = _unscaled(gnorm, grad_norms, scale_value)
    return StepHealth(
        loss=loss if staged.has_loss else None,
        grad_norm=gnorm if gn else None,
        param_norm=pnorm if pn else None,
        inputs_finite=bool(in_ok),
        outputs_finite=bool(out_ok),
        local_grads_finite=bool(local_ok),
        scale=scale_value,
        grad_norms=grad_norms,
        param_norms=param_norms,
    )


def _unscaled(total: float, norms: list[float], scale: float) -> tuple[float | None, list[float]]:
    """The gradient norms with the loss scale divided out. A scale the gradients cannot be unscaled from
    (:func:`~nantrace.detection.scaler.unusable_scale`: 0, whose scaled gradients are all 0 while
    ``unscale_`` makes them NaN) leaves them unknown: ``None`` for the total (nothing is proven from it:
    the update is checked, the scaler's collapse is judged before it) and NaN per tensor, unless the
    scaled total is already non-finite, which it stays at any scale."""
    if unusable_scale(scale) is not None:
        return (total, norms) if not math.isfinite(total) else (None, [math.nan] * len(norms))
    divisor = abs(scale)
    return total / divisor, [g / divisor for g in norms]


def measure(
    *,
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    losses: Sequence[torch.Tensor],
    inputs_ok: torch.Tensor | None,
    outputs_ok: torch.Tensor | None,
    local_grads_ok: torch.Tensor | None = None,
    scale: torch.Tensor | None,
    grads_scaled: bool,
) -> StepHealth:
    """Reduce the step's tensors to one vector and read it with a single host transfer.

    ``inputs_ok``/``outputs_ok`` are boolean 0-dim tensors accumulated by the forward
    hooks (``None`` when not checked). ``grads_scaled`` says the gradients still carry the
    GradScaler's factor; their norms are divided by the scale on the host.
    (:func:`stage` + :func:`read` + :func:`finish`, for callers that add nothing to the read.)
    """
    staged = stage(grads=grads, params=params, losses=losses, inputs_ok=inputs_ok, outputs_ok=outputs_ok,
                   local_grads_ok=local_grads_ok, scale=scale, grads_scaled=grads_scaled)
    return finish(staged, read(staged)[0])


def _inputs_finite(inputs: Sequence[torch.Tensor], norms: list[float], policy: Any) -> bool:
    """Whether every model input is finite or ``-inf`` (an additive mask), from its norm (or sum of
    squares): a finite one settles it; any other is judged exactly by its extremes (``aminmax``, a second
    read: the step with a non-finite input, or the first with an input holding ``-inf``, after which the
    ``policy`` has later steps reduce the inputs to extremes as each forward begins)."""
    ok = True
    for t, norm in zip(inputs, norms):
        if not math.isfinite(norm):
            lo, hi = torch.aminmax(t.detach())
            if extremes_ok_on_host([float(lo), float(hi)]):
                if policy is not None:
                    policy.extremes_now = True
            else:
                ok = False
    return ok


def _exactly_finite(tensors: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(local(t)).all()) for t in tensors)


def _norms64(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.linalg.vector_norm(local(t), dtype=torch.float64) for t in tensors]


def _mean_loss(losses: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The mean of the step's losses as a 0-dim float32 tensor (one loss: no reduction kernel)."""
    if len(losses) == 1:  # the common step: no conversion kernel when the loss is float32 on the device already
        loss = losses[0].detach()
        if loss.dtype != torch.float32 or loss.device != device:
            loss = loss.to(device, torch.float32)
        return loss if loss.dim() == 0 else loss.reshape(())
    flat = [l.detach().to(device, torch.float32).reshape(()) for l in losses]
    return torch.stack(flat).mean()


_CONSTANTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """0-dim NaN and 1.0 on ``device``, made once (placeholders in the step's read vector)."""
    pair = _CONSTANTS.get(device)
    if pair is None:
        pair = _CONSTANTS[device] = (torch.full((), float("nan"), device=device), torch.ones((), device=device))
    return pair


def _totals(gvec: torch.Tensor | None, pvec: torch.Tensor | None, nan: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2 norms of the per-gradient and per-parameter norm vectors (the global norms), with the
    same foreach kernel the per-tensor norms just used (one call, no second kind of kernel)."""
    present = [v for v in (gvec, pvec) if v is not None]
    if not present:
        return nan, nan
    try:
        out = list(torch._foreach_norm(present, 2))
    except (RuntimeError, TypeError):
        out = [torch.linalg.vector_norm(v) for v in present]
    g = out.pop(0) if gvec is not None else nan
    p = out.pop(0) if pvec is not None else nan
    return g, p


def _flag_on(flag: torch.Tensor | None, device: torch.device, one: torch.Tensor) -> torch.Tensor:
    """A 0-dim finiteness flag on ``device`` for the head's stack (``one`` when not checked)."""
    if flag is None:
        return one
    if flag.device != device or flag.dim():
        flag = flag.to(device).reshape(())
    return flag if flag.dtype in (torch.bool, torch.float32) else flag.to(torch.float32)


def _stack_on(values: list[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The 0-dim norms as one vector on ``device`` (moved only when they are elsewhere). On an
    accelerator the values are gathered into a reused buffer by one ``_foreach_copy_`` kernel:
    ``torch.stack`` of a few hundred 0-dim tensors is a device-to-device copy per value there
    (GPT-2 small: 298 copies and ~1.5 ms of launches a step, measured on an H100)."""
    if not values:
        return None
    if all(v.device == device for v in values):
        if device.type != "cpu" and len(values) > 8:
            gathered = _gather(values, device)
            if gathered is not None:
                return gathered
        return torch.stack(values)
    return torch.stack([v.to(device) for v in values])


_GATHER: dict[tuple[torch.device, torch.dtype, int], tuple[torch.Tensor, list[torch.Tensor]]] = {}


def _gather(values: list[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """``values`` copied into a per-(device, dtype, length) buffer; ``None`` where the kernel is
    missing or the values differ in dtype. The buffer is reused by the next step: callers copy
    out of it (``torch.cat``) before the next stage, in stream order."""
    dtype = values[0].dtype
    if any(v.dtype != dtype for v in values) or not hasattr(torch, "_foreach_copy_"):
        return None
    key = (device, dtype, len(values))
    slot = _GATHER.get(key)
    if slot is None:
        flat = torch.empty(len(values), dtype=dtype, device=device)
        slot = _GATHER[key] = (flat, list(flat.unbind()))
    try:
        torch._foreach_copy_(slot[1], values)
    except (RuntimeError, TypeError):
        return None
    return slot[0]


def _pick_device(*groups: Sequence[torch.Tensor]) -> torch.device:
    for group in groups:
        for t in group:
            return t.device
    return torch.device("cpu")


def nonfinite_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> list[dict[str, object]]:
    """Exact per-tensor non-finite counts; only called after the sentinel saw trouble."""
    out: list[dict[str, object]] = []
    for name, t in named:
        if not (t.is_floating_point() or t.is_complex()):
            continue
        t = local(t.detach())
        nan = int(torch.isnan(t).sum())
        inf = int(torch.isinf(t).sum())
        if nan or inf:
            out.append({"name": name, "nan": nan, "inf": inf, "numel": t.numel(), "shape": list(t.shape)})
    return out
