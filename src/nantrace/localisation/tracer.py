"""The op tracer: a dispatch mode that, during a replay only, checks every ATen op's
outputs and keeps the provenance of every non-finite value.

For each op whose output is non-finite it records which inputs carried NaN/Inf and which
op produced them, so the origin can later be found by following dataflow (not just
execution order). Forward ops are mapped to the autograd node they create, so backward
ops are attributed to the forward op, module and source line they run for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import functools
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from .attention import mask_position
from .modules import ModuleStack

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_NANTRACE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_USER_CODE_IN_NANTRACE = (_NANTRACE_DIR + "demo" + os.sep,)  # the demo's model is user code


def nested_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The dense tensors a nested tensor holds its elements in (``values()`` of a jagged one, the components
    of a strided one): most ops, ``aminmax`` and ``any`` included, have no nested kernel, so a nested tensor
    (``nn.TransformerEncoder``'s inference path packs a padded batch into one) is read through them."""
    return [t.values()] if t.layout == torch.jagged else list(t.unbind())


_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def dense_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The dense (strided) tensors that hold ``t``'s stored values: ``t`` itself when it is dense, the parts of
    a nested tensor (:func:`nested_parts`), the values of a sparse one (a COO tensor coalesced first, so that
    duplicate entries are read as the one value they add up to; CSR/CSC/BSR/BSC: ``values()``). Sparse
    gradients (``nn.Embedding(sparse=True)``, ``EmbeddingBag``) and the optimizers' sparse paths have no
    kernel for ``aminmax``, comparisons or storage access, so every finiteness check and statistic reads a
    tensor through these: the evidence of an op on a sparse tensor is about the values it stores (a stored
    zero is a zero; an element not stored is no value of the op's)."""
    if t.is_nested:
        return nested_parts(t)
    layout = t.layout
    if layout not in _COMPRESSED and layout != torch.sparse_coo:  # strided (or a layout without stored values)
        return [t]
    with _disable_current_modes():  # nantrace's own reading, never an op of the program's (a traced replay)
        x = t.detach()
        if layout in _COMPRESSED:
            return [x.values()]
        return [(x if x.is_coalesced() else x.coalesce())._values()]


def _parted(t: torch.Tensor) -> list[torch.Tensor] | None:
    """``t``'s dense parts when it is not a plain dense tensor itself, else ``None``."""
    if t.layout == torch.strided and not t.is_nested:
        return None
    return dense_parts(t)


def _all_finite(t: torch.Tensor) -> bool:
    """One min/max pass instead of a mask: a NaN reaches both, an infinity one of them."""
    parts = _parted(t)
    if parts is not None:
        return all(_all_finite(part) for part in parts if part.numel())
    if t.is_complex():
        return bool(torch.isfinite(t).all())
    lo, hi = torch.aminmax(t.detach())
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value ``t`` holds is finite, whatever its layout (a sparse gradient or graph adjacency is read
    through its stored values, :func:`dense_parts`); an empty or integer tensor is."""
    return all(bool(torch.isfinite(part).all()) for part in dense_parts(t))


def has_nan(t: torch.Tensor) -> bool:
    """Whether ``t`` (of any layout: :func:`dense_parts`) holds a NaN."""
    parts = _parted(t)
    if parts is not None:
        return any(has_nan(part) for part in parts)
    return bool(torch.isnan(t).any())


def has_inf(t: torch.Tensor) -> bool:
    """Whether ``t`` (of any layout: :func:`dense_parts`) holds an infinity."""
    parts = _parted(t)
    if parts is not None:
        return any(has_inf(part) for part in parts)
    return bool(torch.isinf(t).any())


def _nan_inf(t: torch.Tensor) -> tuple[bool, bool]:
    """(holds NaN, holds ±inf), with the cheap finite test first (most tensors are finite)."""
    if t.is_complex() or t.dtype == torch.bool or not t.is_floating_point():
        return (has_nan(t), has_inf(t)) if t.is_complex() else (False, False)
    if _all_finite(t):
        return False, False
    return has_nan(t), has_inf(t)


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, a nested tensor padded with zeros into one dense tensor, or a sparse one as the dense
    tensor it stands for (the evidence reads its elements by position)."""
    if t.is_nested:
        return torch.nested.to_padded_tensor(t, 0.0)
    return t if t.layout == torch.strided else t.to_dense()


def readable(t: torch.Tensor) -> bool:
    """Whether the tensor's storage still holds its elements: FSDP2 frees the storage of an
    unsharded parameter (resizes it to 0 bytes) when it reshards, and a replay may still hold it.
    A nested tensor is readable (its elements are read through its parts, :func:`nested_parts`), a sparse one
    when the values it stores are (:func:`dense_parts`)."""
    if t.is_nested or t.numel() == 0:
        return True
    if t.layout != torch.strided:
        return all(readable(part) for part in dense_parts(t))
    extent = t.storage_offset() + 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return t.untyped_storage().nbytes() >= extent * t.element_size()


def format_source(filename: str, lineno: int) -> str:
    """``path:LINE``, relative to the working directory when the file lies below it."""
    return f"{_display_path(filename, os.getcwd())}:{lineno}"


@functools.lru_cache(maxsize=1024)
def _display_path(filename: str, cwd: str) -> str:
    """``filename`` relative to ``cwd`` when it lies below it (cached: the tapes ask once per call they keep)."""
    try:
        rel = os.path.relpath(filename, cwd)
        if not rel.startswith(".."):
            return rel
    except ValueError:
        pass
    return filename


def _is_library(name: str) -> bool:
    """Whether a frame's file is torch's, nantrace's own, frozen, or a compiled graph's generated code
    (remembered per file name: every forward and every kept loss-code call walks a few frames)."""
    known = _LIBRARY_FILES.get(name)
    if known is None:
        if name.startswith(("<frozen", "<eval_with_key>")):
            known = True
        else:
            ours = name.startswith(_NANTRACE_DIR) and not name.startswith(_USER_CODE_IN_NANTRACE)
            known = ours or name.startswith(_TORCH_DIR)
        if len(_LIBRARY_FILES) < 4096:
            _LIBRARY_FILES[name] = known
    return known


_LIBRARY_FILES: dict[str, bool] = {}


_REPLAY_SITES: list[tuple[Any, str | None]] = []
"""(frame, call site) of each replay in progress (:func:`replay_site`)."""


@contextlib.contextmanager
def replay_site(frame: Any, call_site: str | None) -> Iterator[None]:
    """Inside the block, a search for the user's line that reaches ``frame`` (the replay's own
    entry) answers ``call_site`` (the line that called the model in the real step) instead of going
    on into the frames that called the replay: a model made only of torch modules (an
    ``nn.Sequential``) has no line of its own, and the frames beyond the replay are the guard's
    hook and the user's ``optimizer.step()``, which issued no op of the model."""
    _REPLAY_SITES.append((frame, call_site))
    try:
        yield
    finally:
        _REPLAY_SITES.pop()


def user_source(skip: int = 2) -> str | None:
    """The innermost frame outside torch and nantrace: the user's line that issued the op."""
    frame = sys._getframe(skip)
    stop = _REPLAY_SITES[-1] if _REPLAY_SITES else None
    while frame is not None:
        if stop is not None and frame is stop[0]:
            return stop[1]
        if not _is_library(frame.f_code.co_filename):
            return format_source(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None


_AUTOGRAD_DIR = _TORCH_DIR + "autograd" + os.sep
_ENGINE_ENTRIES = frozenset({"_engine_run_backward", "backward", "grad"})
"""Functions in ``torch/autograd/`` that hand control to the C++ autograd engine: a backward
op with one of them as its innermost Python caller was issued by the engine itself."""


def backward_code_source(skip: int = 2) -> str | None:
    """The user's line that issued a backward-phase op when user code issued it (a custom
    ``autograd.Function``'s backward, a tensor or module hook, a checkpoint's recomputation);
    None when autograd's engine ran a built-in derivative (no user frame below the engine's entry)."""
    frame = sys._getframe(skip)
    while frame is not None:
        code = frame.f_code
        if code.co_name in _ENGINE_ENTRIES and code.co_filename.startswith(_AUTOGRAD_DIR):
            return None
        if not _is_library(code.co_filename):
            return format_source(code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None


_MASKING_OPS = frozenset({
    "add", "sub", "where", "masked_fill", "maximum", "minimum", "baddbmm", "_softmax", "_log_softmax",
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention"})
"""Ops through which a ``-inf`` tensor from outside is applied as an additive mask (to attention
scores, logits); a ``-inf`` input first met by a matmul, a convolution or a normalisation is a bad
value of the batch instead. A fused attention op's mask operand is one too (:mod:`.attention`)."""
def _running_statistics_written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The running mean and variance a batch norm in training mode updates: it normalises with the batch's own
    statistics, so their old values (NaN after an earlier forward of the step averaged a NaN into them) are
    written, never read for its output; in evaluation mode they are read."""
    schema = func._schema
    names = [a.name for a in schema.arguments]
    if "running_mean" not in names:
        return ()
    values = dict(zip(names, args))
    values.update(kwargs)
    training = values.get("training", "with_update" in schema.name or "_update" in schema.overload_name)
    if training is not True:
        return ()
    return tuple(values[k] for k in ("running_mean", "running_var") if isinstance(values.get(k), torch.Tensor))


_OVERWRITES = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_",
                         "geometric_", "log_normal_", "cauchy_"})
"""In-place ops that replace every value of the tensor they write (``self``): its old values are not an
operand of theirs (``p.data.copy_(new)`` does not carry ``p``'s old NaN into ``p``)."""


def _is_custom_function(node: Any) -> bool:
    """Whether an autograd node is a custom ``autograd.Function``'s: its backward is Python code,
    not one ATen op's derivative."""
    return isinstance(node, torch.autograd.function.BackwardCFunction)


def op_name(func: Any) -> str:
    """``aten.log.default`` for an OpOverload."""
    return f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}"


def tensor_stats(t: torch.Tensor, arg: str) -> dict[str, Any]:
    """dtype, shape, min, max, smallest |x|, counts of zeros, negatives, NaN and Inf (of a nested tensor: its
    padded shape, and the counts over its elements; of a sparse one: its shape, and the counts over the values
    it stores, ``numel`` their number)."""
    shape = list(torch.nested.to_padded_tensor(t, 0.0).shape) if t.is_nested else list(t.shape)
    out: dict[str, Any] = {"arg": arg, "dtype": str(t.dtype).removeprefix("torch."), "shape": shape}
    if t.layout == torch.strided and not t.is_nested:
        x = t.detach()
    else:
        x = torch.cat([part.detach().reshape(-1) for part in dense_parts(t)])
    if x.numel() == 0 or not readable(x):
        return out
    if x.is_floating_point():
        x = x.double()
        nan = torch.isnan(x)
        valid = x[~nan]
        out.update(
            min=float(valid.min()) if valid.numel() else math.nan,
            max=float(valid.max()) if valid.numel() else math.nan,
            min_abs=float(valid.abs().min()) if valid.numel() else math.nan,
            zeros=int((x == 0).sum()),
            negatives=int((x < 0).sum()),
            nan=int(nan.sum()),
            inf=int(torch.isinf(x).sum()),
            numel=x.numel(),
        )
    elif x.dtype == torch.bool:
        out.update(true=int(x.sum()), numel=x.numel(), min=int(x.min()), max=int(x.max()))
    elif not x.is_complex():
        out.update(min=int(x.min()), max=int(x.max()), numel=x.numel(), negatives=int((x < 0).sum()), zeros=int((x == 0).sum()))
    return out


@dataclasses.dataclass(eq=False)
class OpInfo:
    """A forward op call, kept so backward ops can be attributed to it."""

    op: str
    module: str | None
    source: str | None
    index: int
    record: "OpRecord | None" = None
    args: tuple[Any, ...] | None = None
    kwargs: dict[str, Any] | None = None
    func: Any = None
    """The ATen overload itself, so evidence can re-run it in float64."""
    parents: "list[OpInfo | None]" = dataclasses.field(default_factory=list)
    """For each tensor argument, the forward op that made it (provenance; in-place ops keep their source)."""


@dataclasses.dataclass(eq=False)
class InputRef:
    """One tensor argument of a recorded op: what it carried and where it came from."""

    position: str
    nan: bool
    inf: bool
    producer: "OpRecord | None"
    external: str | None
    mask: bool = False
    """A tensor from outside the traced ops whose only non-finite values are ``-inf``, applied by an
    op in ``_MASKING_OPS`` (an additive attention mask passed to the forward): intentional, like a
    ``-inf`` fill, never the origin."""


_LOW = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(eq=False)
class OpRecord:
    """An op whose output held NaN or Inf."""

    index: int
    op: str
    phase: str
    module: str | None
    source: str | None
    node: str | None
    forward: OpInfo | None
    out_nan: bool
    out_inf: bool
    inputs: list[InputRef]
    scalar_nonfinite: bool
    args: tuple[Any, ...] | None = None
    kwargs: dict[str, Any] | None = None
    output: torch.Tensor | None = None
    func: Any = None
    user_code: bool = False
    """A backward-phase op the user's code issued (a custom Function's backward, a hook), not a
    built-in derivative: it is judged as the op itself, at its own source line."""
    absorbed_by: str | None = None
    """The first op with a finite result that read this op's non-finite output, directly or through ops
    that kept it non-finite (``1 / (1 + exp(z))``: the reciprocal absorbs the exp's infinity through the
    add): its short name (:meth:`OpTracer._note_absorbed`)."""
    absorbed: bool = False
    """An op with a finite floating output read this op's non-finite output (a ``where``, a
    ``masked_fill_``, an overwrite): there the value was masked or dropped. With no later record
    reading it, it went nowhere (``origin.backward_start``)."""

    @property
    def in_nan(self) -> bool:
        return any(i.nan for i in self.inputs)

    @property
    def in_inf(self) -> bool:
        return any(i.inf for i in self.inputs)

    @property
    def creates_nan(self) -> bool:
        return self.out_nan and not self.in_nan

    @property
    def creates_nonfinite(self) -> bool:
        return not self.in_nan and not self.in_inf

    @property
    def is_constant(self) -> bool:
        """Made an infinity on purpose: from an explicit inf scalar (a -inf mask fill), not by overflowing."""
        return self.creates_nonfinite and self.scalar_nonfinite and not self.out_nan

    def describe(self) -> dict[str, Any]:
        return {
            "op": self.forward.op if self.phase == "backward" and self.forward else self.op,
            "aten": self.op,
            "phase": self.phase,
            "node": self.node,
            "module": self.module,
            "source": self.source,
            "produces": "NaN" if self.out_nan else "Inf",
        }


_SHAPE_ONLY = frozenset({"zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like",
                         "randint_like", "new_zeros", "new_ones", "new_full", "new_empty", "new_empty_strided"})
"""Ops that read only a tensor's shape and dtype: a finite result of theirs masks nothing."""
_NLL_FORWARD = {"nll_loss_forward", "nll_loss2d_forward"}
_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "fsdp", "_dtensor"})
"""Namespaces of the ops FSDP2 and DTensor issue to move values between ranks (all-gather,
reduce-scatter and their copy-in/out): the tracer lets them run unobserved."""
_UNINITIALISED = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                            "aten::new_empty_strided", "aten::resize_"})
"""Ops whose output holds whatever the memory held (FSDP2 allocates its all-gather buffers so,
inside the backward's hooks): a NaN bit pattern there is no value of the step."""


@dataclasses.dataclass(eq=False)
class FailedOp:
    """An op that raised during a replay: what it received and where its inputs came from."""

    op: str
    func: Any
    phase: str
    module: str | None
    source: str | None
    inputs: list[InputRef]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    error: BaseException
    index: int
    parents: "list[OpInfo | None]" = dataclasses.field(default_factory=list)
    """The forward ops that made its tensor arguments (e.g. the decomposition whose ``info`` a check raised on)."""


class CallFailureWatch(TorchFunctionMode):
    """During a replay, the first torch call that raised with no dispatched op failing under it: a composite
    whose own check fires in C++ above the dispatcher (``F.one_hot``'s "Class values must be non-negative"), which
    the op tracer (a dispatch mode) never sees raise. Kept as a :class:`FailedOp` named after the call."""

    def __init__(self, tracer: "OpTracer") -> None:
        super().__init__()
        self.tracer = tracer
        self.failed: FailedOp | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            tracer = self.tracer
            if self.failed is None and tracer.failure is None:
                name = getattr(func, "__name__", None) or str(func)
                self.failed = FailedOp(op=f"aten.{name}.default", func=None, phase="forward",
                                       module=tracer.modules.current if tracer.modules.current is not None
                                       else tracer.module_override, source=user_source(2),
                                       inputs=tracer._input_refs(args, kwargs, None), args=args, kwargs=kwargs,
                                       error=exc, index=tracer.index + 1, parents=tracer._parents(args))
            raise


def written_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an ATen op writes in place: its schema's mutable arguments (tensor lists included)."""
    if not func._schema.is_mutable:
        return []
    out: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out.extend(t for t in (value if isinstance(value, (list, tuple)) else (value,)) if isinstance(t, torch.Tensor))
    return out


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """Where ``t``'s memory is (device, address of its storage): the same for every tensor object over it
    (``p`` and ``p.data``, a view); ``None`` where there is none to read (a subclass, a meta tensor)."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return (str(t.device), ptr) if ptr else None


def _name_absorber(rec: OpRecord, short: str) -> None:
    """Record ``short`` as what absorbed ``rec``'s non-finite output and that of every record it was
    made from through non-finite inputs, where none was named yet: the op that created an infinity
    (an exp) is often read only through ops that keep it infinite (``1 + e``) before one takes it to a
    finite value, and the cause of its derivative's 0 x inf depends on what that one was (a selection
    or a saturating op). A record already named has its ancestors named (they were named with it), so
    each record is visited once over the whole replay."""
    stack = [rec]
    while stack:
        cur = stack.pop()
        if cur.absorbed_by is not None:
            continue
        cur.absorbed_by = short
        stack.extend(ref.producer for ref in cur.inputs if ref.producer is not None and ref.producer.absorbed_by is None)


def _clone_written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The op's arguments with the tensors it writes in place cloned, so the evidence sees
    the values the op read, not the ones it wrote."""
    out_args, out_kwargs = list(args), dict(kwargs)
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if i < len(out_args) and isinstance(out_args[i], torch.Tensor):
            out_args[i] = out_args[i].detach().clone()
        elif isinstance(out_kwargs.get(arg.name), torch.Tensor):
            out_kwargs[arg.name] = out_kwargs[arg.name].detach().clone()
    return tuple(out_args), out_kwargs


class OpTracer(TorchDispatchMode):
    """Checks each op during a replay; records non-finite provenance and forward→backward links."""

    def __init__(self, modules: ModuleStack, externals: dict[int, str]) -> None:
        super().__init__()
        self.modules = modules
        self.externals = externals
        self.records: list[OpRecord] = []
        self.producer: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.made_by: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        """Every tensor a forward op made, finite or not, to its op: the provenance of operands."""
        self.wrote_into: dict[tuple[str, int], OpRecord] = {}
        """Memory (by :func:`_storage_key`) an in-place op wrote non-finite values into, to that op's record: a
        parameter written through ``p.data`` (``p.data.copy_(1 / std)``, a data-dependent initialisation) is then
        read as ``p``, another tensor object over the same memory, which no record produced."""
        self.node_info: dict[Any, OpInfo] = {}
        """Autograd node → the op that made it under grad mode (its backward ops run that op's derivative)."""
        self.node_module: dict[Any, str | None] = {}
        """A custom Function's node → the module its forward ran in (no op of that forward made the node)."""
        self._pending: list[tuple[weakref.ref[torch.Tensor], OpInfo, bool]] = []
        self._owners: dict[int, str] | None = None
        self.index = 0
        self.ops_seen = 0
        self.failure: FailedOp | None = None
        """The op that raised during the replay (a failure that raises instead of producing NaN)."""
        self.twin: Callable[[torch.Tensor], torch.Tensor | None] | None = None
        """Set by a replay of taped code: the replayed value standing for a real tensor of the step (one the step's
        code made, held where no replay reaches it: a hook's closure, a loss object's attribute), so that a
        non-finite value entering that way is traced to the replayed op that made its twin."""
        self.module_override: str | None = None
        """The submodule a re-issued call ran in (a watched submodule called from the loss code), used
        when no module of the replay is running."""
        self.ignored_targets: tuple[int, int] | None = None
        """(count, ignore_index) of the last forward NLL loss whose targets were all ignored."""
        self.failed_decompositions: list[OpInfo] = []
        self.saw_low_precision = False
        """An op traced made a float16/bfloat16 value (autocast entered inside the replayed code)."""
        """Forward decompositions that reported failure through their ``info`` output instead of raising
        (``linalg_cholesky_ex``, ``linalg_inv_ex``, ``linalg_ldl_factor_ex``, ``linalg_lu_factor_ex``,
        ``linalg_solve_ex``): a check written in Python (torch.distributions' ``positive_definite``) reads
        that code and raises on finite values; the last one is the op to name."""

    # The mode is switched off while its own __torch_dispatch__ runs, so the checks
    # below do not recurse into it.
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in _COLLECTIVES or func._schema.name in _UNINITIALISED:  # never an origin
            return func(*args, **kwargs)
        node = torch._C._current_autograd_node()
        hand = backward_code_source(2) if node is not None else None
        mutable = func._schema.is_mutable
        pre = self._mutated_flags(func, args, kwargs) if mutable else None
        kept = _clone_written(func, args, kwargs) if mutable and (node is None or hand) else (args, kwargs)
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            if self.failure is None:
                self.failure = FailedOp(op=op_name(func), func=func, phase="forward" if node is None else "backward",
                                        module=self.modules.current,
                                        source=hand or user_source(3),
                                        inputs=self._input_refs(args, kwargs, pre, func), args=kept[0], kwargs=kept[1],
                                        error=exc, index=self.index + 1,
                                        parents=[self.made_by.get(a) for a in args if isinstance(a, torch.Tensor)])
            raise
        self.index += 1
        self.ops_seen += 1
        name = op_name(func)
        info: OpInfo | None = None
        if self._pending:
            self.flush()
        if node is None or hand:
            # an op of the user's own code: a forward op, or one a hook or custom backward issued
            if node is None:  # "" is the model itself: only no running module at all takes the override
                module = self.modules.current if self.modules.current is not None else self.module_override
            else:
                module = self._backward_module(node)
            source = hand if node is not None else user_source(3)
            info = OpInfo(op=name, module=module, source=source, index=self.index, args=kept[0], kwargs=kept[1],
                          func=func, parents=self._parents(args))
            short = func._schema.name.split("::")[-1]
            if node is None and short in _NLL_FORWARD:
                self._note_ignored_targets(args)
            elif short.endswith("_ex"):
                self._note_info_code(func, out, info)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]
        if not self.saw_low_precision and any(t.dtype in _LOW for t in outs):
            self.saw_low_precision = True
        if info is not None:
            grad_mode = torch.is_grad_enabled()
            for t in outs:
                self._pending.append((weakref.ref(t), info, grad_mode))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.made_by[t] = info  # integer outputs too (an info code, a count)
        bad = [t for t in outs if t.numel() and not _all_finite(t)]
        if not bad:
            if outs and len(self.producer):
                self._note_absorbed(func, args, kwargs, pre)
            return out
        out_nan = any(has_nan(t) for t in bad)
        out_inf = any(has_inf(t) for t in bad)
        inputs = self._input_refs(args, kwargs, pre, func)
        scalar_nonfinite = any(
            isinstance(a, (float, int)) and not isinstance(a, bool) and not math.isfinite(a)
            for a in tree_leaves((args, kwargs))
        )
        if node is not None:
            # a built-in derivative runs for the forward op that made its node; user code is its own origin
            finfo = None if hand else self.node_info.get(node)
            record = OpRecord(
                index=self.index, op=name, phase="backward",
                module=info.module if info is not None else self._node_module(node),
                source=hand or (finfo.source if finfo else None),
                node=node.name(), forward=finfo, out_nan=out_nan, out_inf=out_inf, inputs=inputs,
                scalar_nonfinite=scalar_nonfinite, user_code=bool(hand),
            )
        else:
            assert info is not None
            record = OpRecord(
                index=self.index, op=name, phase="forward", module=info.module, source=info.source,
                node=None, forward=info, out_nan=out_nan, out_inf=out_inf, inputs=inputs,
                scalar_nonfinite=scalar_nonfinite,
            )
        if info is not None:
            info.record = record
        record.func = func
        if (out_nan and not record.in_nan) or record.creates_nonfinite:
            # the output of an in-place or out= op is the tensor it wrote, which existed before the replay and
            # is put back (or written again) after it: a copy keeps its values as this op wrote them
            output = dense(bad[0])
            if mutable and any(output is t for t in written_tensors(func, args, kwargs)):
                output = output.detach().clone()
            record.args, record.kwargs, record.output = kept[0], kept[1], output
        for t in bad:
            self.producer[t] = record
        if mutable:
            self._note_written(func, args, kwargs, record)
        self.records.append(record)
        return out

    def _note_written(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], record: OpRecord) -> None:
        """Remember the memory of each tensor the op wrote in place and left non-finite (see :attr:`wrote_into`)."""
        for t in written_tensors(func, args, kwargs):
            if (t.is_floating_point() or t.is_complex()) and t.numel() and not _all_finite(t):
                key = _storage_key(t)
                if key is not None:
                    self.wrote_into[key] = record

    def _writer(self, t: torch.Tensor) -> "OpRecord | None":
        """The record that wrote non-finite values into ``t``'s memory in place during the replay, if any."""
        if not self.wrote_into:
            return None
        key = _storage_key(t)
        return self.wrote_into.get(key) if key is not None else None

    def _note_absorbed(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                       pre: dict[int, tuple[bool, bool]] | None) -> None:
        """A finite result read non-finite values a record made: they were masked there (a derivative
        that computes a 0/0 and fills it with 0 itself, as the norm's does) or overwritten."""
        short = func._schema.name.split("::")[-1]
        if short in _SHAPE_ONLY:
            return
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                rec = self.producer.get(t)
                if rec is not None and (pre is None or pre.get(id(t), (True, True)) != (False, False)):
                    rec.absorbed = True
                    _name_absorber(rec, short)

    def _note_ignored_targets(self, args: tuple[Any, ...]) -> None:
        # A summed NLL over targets that are all ignore_index is a finite 0; the division
        # by the number of labels that follows (Hugging Face's loss) is then 0/0.
        target = args[1] if len(args) > 1 else None
        ignore = args[4] if len(args) > 4 and isinstance(args[4], int) else -100
        if isinstance(target, torch.Tensor) and target.numel() and bool((target == ignore).all()):
            self.ignored_targets = (int(target.numel()), ignore)

    def _note_info_code(self, func: Any, out: Any, info: OpInfo) -> None:
        """Keep a decomposition whose ``info`` output is non-zero (a singular or non-positive-definite
        matrix): replays only, one read of a small integer tensor per ``*_ex`` call."""
        names = [r.name for r in func._schema.returns]
        if "info" not in names or not isinstance(out, (tuple, list)) or len(out) != len(names):
            return
        code = out[names.index("info")]
        if isinstance(code, torch.Tensor) and code.numel() and bool((code != 0).any()):
            self.failed_decompositions.append(info)

    def flush(self) -> None:
        """Link ops to the autograd nodes that autograd attached to their outputs.

        Only an op run under grad mode made the node its output carries. An op run without it
        inside a custom Function's forward returns a tensor that later gets the Function's node,
        whose backward is the user's code, not that op's derivative: the node keeps only the module."""
        pending, self._pending = self._pending, []
        for ref, info, grad_mode in pending:
            t = ref()
            if t is None:
                continue
            fn = t.grad_fn
            if fn is None or fn in self.node_info:
                continue
            if grad_mode:
                self.node_info[fn] = info
            elif _is_custom_function(fn) and fn not in self.node_module:
                self.node_module[fn] = info.module

    def _node_module(self, node: Any) -> str | None:
        """The module whose forward made ``node``: that of the op it derives, or where its custom
        Function ran; for a parameter's gradient accumulator, the module that holds the parameter."""
        linked = self.node_info.get(node)
        if linked is not None:
            return linked.module
        leaf = getattr(node, "variable", None)  # AccumulateGrad: the leaf its gradient goes to
        if isinstance(leaf, torch.Tensor):
            return self._owner(leaf)
        return self.node_module.get(node)

    def _owner(self, leaf: torch.Tensor) -> str | None:
        """The module that holds ``leaf`` as one of its own parameters, or None."""
        if self._owners is None:
            self._owners = {}
            for name, module in self.modules.root.named_modules():
                for p in module.parameters(recurse=False):
                    self._owners.setdefault(id(p), name)
        return self._owners.get(id(leaf))

    def _parents(self, args: tuple[Any, ...]) -> list[OpInfo | None]:
        """The ops that made an op's tensor arguments: its positional tensors in order, then the tensors of its
        list arguments (``torch.stack``/``torch.cat`` of per-group statistics), so provenance goes through them."""
        made_by = self.made_by
        parents = [made_by.get(a) for a in args if isinstance(a, torch.Tensor)]
        for a in args:
            if isinstance(a, (list, tuple)):
                parents.extend(made_by.get(t) for t in a if isinstance(t, torch.Tensor))
        return parents

    def _backward_module(self, node: Any) -> str | None:
        """The module of an op the user's code issues during backward: the running module (a
        checkpoint re-running a block's forward), else, for a tensor hook registered during the replay, the
        module that registered it (``None`` for the step's own code: a loss function hooking the model's
        output), else the one whose forward made the node it runs for (a hook registered before the step,
        on a parameter: the module holding it)."""
        running = self.modules.current
        if running is not None:
            return running
        return self.modules.hook_owner if self.modules.in_hook else self._node_module(node)

    def _mutated_flags(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, tuple[bool, bool]]:
        flags: dict[int, tuple[bool, bool]] = {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
                flags[id(value)] = _nan_inf(value)
        return flags

    def _input_refs(self, args: tuple[Any, ...], kwargs: dict[str, Any], pre: dict[int, tuple[bool, bool]] | None,
                    func: Any = None) -> list[InputRef]:
        refs: list[InputRef] = []
        short = func._schema.name.split("::")[-1] if func is not None else ""
        masking = short in _MASKING_OPS
        mask_operand = mask_position(func, args, kwargs) if func is not None else None
        named = [(f"arg{i}", a) for i, a in enumerate(args)] + [(k, v) for k, v in kwargs.items()]
        if short in _OVERWRITES:  # the destination's old values are replaced, not read
            named = [(position, a) for position, a in named if position not in ("arg0", "self")]
        written_only = _running_statistics_written(func, args, kwargs) if func is not None else ()
        if written_only:
            named = [(position, a) for position, a in named if not any(a is t for t in written_only)]
        for position, value in named:
            tensors = [value] if isinstance(value, torch.Tensor) else [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
            for j, t in enumerate(tensors):
                if not (t.is_floating_point() or t.is_complex()) or not t.numel():
                    continue
                if pre is not None and id(t) in pre:
                    nan, inf = pre[id(t)]
                else:
                    nan, inf = _nan_inf(t)
                producer = (self.producer.get(t) or self._writer(t)) if (nan or inf) else None
                if producer is None and (nan or inf) and self.twin is not None and id(t) not in self.externals:
                    twin = self.twin(t)
                    if twin is not None:
                        producer = self.producer.get(twin) or self._writer(twin)
                external = None
                mask = False
                if (nan or inf) and producer is None:
                    external = self.externals.get(id(t), "constant" if not nan else "unknown")
                    mask = (masking or position == mask_operand) and inf and not nan and not t.is_complex() and \
                        not any(bool((part == float("inf")).any()) for part in dense_parts(t.detach()))
                refs.append(InputRef(position if len(tensors) == 1 else f"{position}[{j}]", nan, inf, producer, external,
                                     mask))
        return refs
