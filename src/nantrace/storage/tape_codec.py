"""The loss tape in a bundle: its calls as names and plain data, so ``nantrace replay`` re-runs
the loss code on another machine and gives the same diagnosis as the live guard.

Functions are stored by name (``torch.log``, ``Tensor.masked_fill``,
``torch.nn.functional:cross_entropy``, a property getter ``getter:T``) and resolved on load;
arguments as tensors and tagged plain values, so ``torch.load(weights_only=True)`` reads
them. A tensor that was one of the model's outputs is stored as its position
(forward call, output index): the replay feeds the *replayed* output there. A tape holding
anything else (a lambda, a user object) is not stored, and the bundle says so.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch

from ..capture import AutocastState, RngState
from ..loss_tape import Entry, LossTape, OutputRef, Ref


class Unencodable(ValueError):
    """A value of the tape that a bundle cannot hold."""


class PreludeRef:
    """A tensor the loss code received from the step's prelude: output ``slot`` of its call ``entry``
    (a bundle cannot keep the identity of the real tensor, so it names the call that made it)."""

    __slots__ = ("entry", "slot", "value")

    def __init__(self, entry: int, slot: int, value: torch.Tensor | None = None) -> None:
        self.entry, self.slot = entry, slot
        self.value = value
        """The tensor as the real step had it: what the loss code receives if the prelude cannot be replayed."""


def function_name(func: Any) -> str:
    """A name from which :func:`resolve` gives ``func`` back; raises :class:`Unencodable`."""
    objclass = getattr(func, "__objclass__", None)
    name = getattr(func, "__name__", None)
    if objclass is torch._C.TensorBase and name:
        return f"Tensor.{name}"
    owner = getattr(func, "__self__", None)
    if name == "__get__" and getattr(owner, "__objclass__", None) is torch._C.TensorBase:
        return f"getter:{owner.__name__}"
    if name and getattr(torch.Tensor, name, None) is func:
        return f"TensorPy.{name}"
    for attr in dir(torch.Tensor):  # a Python-level wrapper stored under another name (Tensor.__pow__)
        if getattr(torch.Tensor, attr, None) is func:
            return f"TensorPy.{attr}"
    module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", None)
    if module == "torch" and qualname and qualname.startswith("_VariableFunctionsClass."):
        return f"torch.{name}"
    if module and qualname and "<locals>" not in qualname and module != "__main__":
        spec = f"{module}:{qualname}"
        try:
            if resolve(spec) is func:
                return spec
        except (ImportError, AttributeError):
            pass
    raise Unencodable(f"cannot name {func!r}")


def resolve(name: str) -> Any:
    """The function a name from :func:`function_name` stands for."""
    if name.startswith("Tensor."):
        return getattr(torch._C.TensorBase, name.removeprefix("Tensor."))
    if name.startswith("TensorPy."):
        return getattr(torch.Tensor, name.removeprefix("TensorPy."))
    if name.startswith("getter:"):
        return getattr(torch._C.TensorBase, name.removeprefix("getter:")).__get__
    if name.startswith("torch.") and ":" not in name:
        return getattr(torch, name.removeprefix("torch."))
    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _encode(value: Any, outputs: dict[int, tuple[int, int]], depth: int = 0,
            prelude: dict[int, tuple[int, int]] | None = None) -> Any:
    if depth > 6:
        raise Unencodable("nested too deep")
    if isinstance(value, Ref):
        return {"__ref__": [value.entry, value.slot]}
    if isinstance(value, OutputRef):  # a tape kept past its step (sync-free) names the outputs already
        return {"__output__": [value.unit, value.index]}
    if isinstance(value, torch.Tensor):
        if id(value) in outputs:
            return {"__output__": list(outputs[id(value)])}
        if prelude and id(value) in prelude:
            return {"__prelude__": list(prelude[id(value)]), "value": value.detach().cpu().clone()}
        return value.detach().cpu().clone()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, slice):
        parts = [value.start, value.stop, value.step]
        if not all(p is None or isinstance(p, int) for p in parts):
            raise Unencodable("a slice with tensor bounds")
        return {"__slice__": parts}
    if value is Ellipsis:
        return {"__ellipsis__": 0}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Generator):  # the tapes keep a snapshot taken before the call
        if value.device.type != "cpu":
            raise Unencodable(f"a {value.device.type} generator")
        return {"__generator__": value.get_state()}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    if isinstance(value, torch.Size):
        return {"__size__": list(value)}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {"__tuple__": [_encode(v, outputs, depth + 1, prelude) for v in value]}
    if isinstance(value, list):
        return [_encode(v, outputs, depth + 1, prelude) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"__dict__": {k: _encode(v, outputs, depth + 1, prelude) for k, v in value.items()}}
    raise Unencodable(f"a {type(value).__name__} argument")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if "__ref__" in value:
            return Ref(*value["__ref__"])
        if "__output__" in value:
            return OutputRef(*value["__output__"])
        if "__prelude__" in value:
            return PreludeRef(*value["__prelude__"], value.get("value"))
        if "__slice__" in value:
            return slice(*value["__slice__"])
        if "__ellipsis__" in value:
            return Ellipsis
        if "__dtype__" in value:
            return getattr(torch, value["__dtype__"])
        if "__generator__" in value:
            generator = torch.Generator()
            generator.set_state(value["__generator__"])
            return generator
        if "__device__" in value:
            return torch.device(value["__device__"])
        if "__size__" in value:
            return torch.Size(value["__size__"])
        if "__tuple__" in value:
            return tuple(_decode(v) for v in value["__tuple__"])
        if "__dict__" in value:
            return {k: _decode(v) for k, v in value["__dict__"].items()}
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def encode_tape(tape: LossTape, forwards: list[Any], prelude: LossTape | None = None) -> dict[str, Any]:
    """The tape as bundle data (with the step's prelude, when it has a usable one); raises
    :class:`Unencodable` when it holds something a bundle cannot."""
    if not tape.usable or tape.loss is None:
        raise Unencodable("the step left no complete tape")
    outputs: dict[int, tuple[int, int]] = {}
    for u, record in enumerate(forwards):
        for i, ref in enumerate(getattr(record, "outputs", [])):
            t = ref()
            if t is not None:
                outputs[id(t)] = (u, i)
    made: dict[int, tuple[int, int]] = {}
    pre = None
    if prelude is not None and prelude.usable:
        try:
            pre = _entries(prelude, {}, None)
            for e, refs in enumerate(prelude.outputs):
                for slot, ref in enumerate(refs):
                    t = ref()
                    if t is not None and id(t) not in outputs:
                        made[id(t)] = (e, slot)
        except Unencodable:
            pre, made = None, {}  # the loss code alone: what the prelude made counts as received
    data = {"entries": _entries(tape, outputs, made), "loss": [tape.loss.entry, tape.loss.slot],
            "losses": [[r.entry, r.slot] for r in tape.losses], **_marks(tape)}
    if pre is not None:
        data["prelude"] = {"entries": pre, **_marks(prelude)}  # type: ignore[arg-type]
    return data


def _entries(tape: LossTape, outputs: dict[int, tuple[int, int]], prelude: dict[int, tuple[int, int]] | None) -> list[Any]:
    return [{"func": function_name(e.func), "args": _encode(e.args, outputs, 0, prelude),
             "kwargs": _encode(e.kwargs, outputs, 0, prelude), "source": e.source, "module": e.module} for e in tape.entries]


def _marks(tape: LossTape) -> dict[str, Any]:
    return {"rng_marks": [[i, rng.cpu] for i, rng in tape.rng_marks],
            "autocast": tape.autocast.to_dict() if tape.autocast is not None else None}


def decode_tape(data: dict[str, Any]) -> LossTape:
    """A tape rebuilt from bundle data, ready for a replay (never pushed on the mode stack)."""
    tape = _decode_calls(LossTape(), data)
    tape.loss = Ref(*data["loss"])
    tape.losses = [Ref(*r) for r in data.get("losses", [data["loss"]])]
    return tape


def decode_prelude(data: dict[str, Any]) -> LossTape | None:
    """The step's prelude from bundle data (``None`` when the bundle holds none)."""
    pre = data.get("prelude")
    return _decode_calls(LossTape(prelude=True), pre) if pre else None


def _decode_calls(tape: LossTape, data: dict[str, Any]) -> LossTape:
    for item in data["entries"]:
        args = _decode(item["args"])
        tape.entries.append(Entry(resolve(item["func"]), tuple(args) if isinstance(args, (list, tuple)) else (),
                                  _decode(item["kwargs"]) or {}, item.get("source"), item.get("module")))
    tape.rng_marks = [(int(i), RngState(cpu=state, cuda=None)) for i, state in data.get("rng_marks", [])]
    ac = data.get("autocast")
    if ac:
        tape.autocast = AutocastState(
            cpu_enabled=ac["cpu_enabled"], cpu_dtype=getattr(torch, ac["cpu_dtype"].removeprefix("torch.")),
            cuda_enabled=ac["cuda_enabled"] and torch.cuda.is_available(),
            cuda_dtype=getattr(torch, ac["cuda_dtype"].removeprefix("torch.")))
    return tape
