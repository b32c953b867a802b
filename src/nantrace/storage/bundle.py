"""Incident bundles: everything needed to re-run a failing step on another machine.

``run_dir/incidents/<step>-<kind>-<id>/`` holds ``diagnosis.json`` (the incident),
``env.json`` (versions, device, dtypes, autocast, the model factory), ``state.pt`` (model
parameters and buffers as they were before the step, optimizer and scaler state),
``batch.pt`` (each captured forward's inputs, the gradient that reached the model's
outputs, and its RNG state). Tensors are saved so that ``torch.load(weights_only=True)``
reads them. The directory is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..capture import AutocastState, ForwardRecord, RngState, StepCapture
from ..incident import Incident
from .tape_codec import Unencodable, decode_prelude, decode_tape, encode_tape

if TYPE_CHECKING:
    from ..watched import Watched

FORMAT_VERSION = 1
REQUIRED = ("diagnosis.json", "env.json", "state.pt", "batch.pt")


def _safe(obj: Any, depth: int = 0) -> Any:
    """Reduce a batch structure to what ``weights_only`` loading accepts."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, (int, float, bool, str)) or obj is None:
        return obj
    if depth > 6:
        return None
    if isinstance(obj, dict):
        return {str(k): _safe(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return {f: _safe(getattr(obj, f), depth + 1) for f in obj._fields}
    if isinstance(obj, (list, tuple)):
        return [_safe(v, depth + 1) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _safe(getattr(obj, f.name), depth + 1) for f in dataclasses.fields(obj)}
    if hasattr(obj, "items"):
        return {str(k): _safe(v, depth + 1) for k, v in obj.items()}
    return None


def model_factory_path(watched: "Watched") -> str | None:
    """``module:qualname`` to rebuild the model in a fresh process, when one is importable."""
    if watched.config.outputs.model_factory:
        return watched.config.outputs.model_factory
    cls = type(watched.root)
    if cls.__module__ in ("__main__", "builtins") or "<locals>" in cls.__qualname__:
        return None
    return f"{cls.__module__}:{cls.__qualname__}"


def write_bundle(watched: "Watched", incident: Incident, capture: StepCapture) -> str:
    """Write the bundle atomically; returns its directory."""
    assert watched.run_dir is not None
    root = Path(watched.run_dir) / "incidents"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{incident.name}-{incident.id}"
    tmp = root / f".tmp-{incident.id}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        state = {
            "model": {k: v.detach().cpu().clone() for k, v in watched.root.state_dict().items()},
            "optimizer": watched.optimizer.state_dict() if watched.optimizer is not None else None,
            "scaler": watched.scaler.state_dict() if watched.scaler is not None else None,
        }
        torch.save(state, tmp / "state.pt")
        forwards = [
            {
                "args": _safe(list(f.args)),
                "kwargs": _safe(f.kwargs),
                "rng_cpu": f.rng.cpu,
                "rng_cuda": list(f.rng.cuda) if f.rng.cuda is not None else None,
                "buffers": {k: v.cpu() for k, v in (f.buffers or {}).items()},
                "output_grads": [[i, g.detach().cpu()] for i, g in f.output_grads],
                "autocast": f.autocast.to_dict(),
                "grad_enabled": f.grad_enabled,
                "module": f.module,
                "tape_at": f.tape_at,
            }
            for f in capture.forwards
        ]
        tape, tape_note = _tape_data(capture)
        if tape_note is not None:
            incident.details["bundle_tape"] = tape_note
        torch.save({"forwards": forwards, "losses": [l.detach().cpu() for l in capture.losses], "tape": tape,
                    "outputs_finite": None if capture.outputs_ok is None else bool(capture.outputs_ok)},
                   tmp / "batch.pt")
        env = {
            "format_version": FORMAT_VERSION,
            "nantrace_version": _version(),
            "torch_version": torch.__version__,
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cuda": torch.version.cuda,
            "device": str(watched.params[0].device) if watched.params else "cpu",
            "param_dtypes": sorted({str(p.dtype) for p in watched.params}),
            "model_class": f"{type(watched.root).__module__}:{type(watched.root).__qualname__}",
            "model_factory": model_factory_path(watched),
            "replayable_fn": _fn_path(capture.calls[0].fn) if capture.calls else None,
            "step": incident.step,
            "rank": incident.rank,
            "writer_rank": watched.rank,
            "training": watched.root.training,
        }
        (tmp / "env.json").write_text(json.dumps(env, indent=2))
        incident.bundle = str(final)
        (tmp / "diagnosis.json").write_text(incident.to_json(indent=2))
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        incident.bundle = None
        raise
    return str(final)


def _fn_path(fn: Any) -> str | None:
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not mod or not qual or mod == "__main__" or "<locals>" in qual:
        return None
    return f"{mod}:{qual}"


def _version() -> str:
    from .. import __version__

    return __version__


@dataclasses.dataclass
class Bundle:
    """A loaded incident bundle."""

    path: Path
    incident: Incident
    env: dict[str, Any]
    state: dict[str, Any]
    forwards: list[ForwardRecord]
    tape: Any = None
    """The step's loss tape (:class:`~nantrace.loss_tape.LossTape`), when the bundle holds one."""
    prelude: Any = None
    """The step's prelude (its code before the model's forward), when the bundle holds one."""
    outputs_finite: bool | None = None
    """Were the model's outputs finite in the real step (``None``: not recorded)."""


def load_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Read a bundle directory; a missing or corrupt one raises ``ValueError`` saying what is wrong."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{str(p)!r} is a file, not a bundle directory; expected run_dir/incidents/<incident> written by nantrace")
    if not p.is_dir():
        raise ValueError(f"bundle directory {str(p)!r} does not exist; expected run_dir/incidents/<incident> written by nantrace")
    missing = [name for name in REQUIRED if not (p / name).is_file()]
    if missing:
        raise ValueError(f"{str(p)!r} is not a complete nantrace bundle: missing {', '.join(missing)}")
    try:
        env = json.loads((p / "env.json").read_text())
    except Exception as exc:
        raise ValueError(f"{str(p / 'env.json')!r} is corrupt or unreadable (truncated or not written by nantrace): "
                         f"{type(exc).__name__}: {exc}") from None
    version = env.get("format_version") if isinstance(env, dict) else None
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"bundle {str(p)!r} has no valid format_version in env.json (found {version!r}); this nantrace "
                         f"reads bundle formats 1..{FORMAT_VERSION}")
    if version > FORMAT_VERSION:
        raise ValueError(f"bundle {str(p)!r} was written in bundle format {version} (nantrace "
                         f"{env.get('nantrace_version', '?')}); this nantrace reads formats 1..{FORMAT_VERSION}: "
                         "upgrade nantrace to replay it")
    loaded: dict[str, Any] = {"env.json": env}
    for name in ("diagnosis.json", "state.pt", "batch.pt"):
        try:
            if name.endswith(".json"):
                loaded[name] = json.loads((p / name).read_text())
            else:
                loaded[name] = torch.load(p / name, weights_only=True, map_location="cpu")
        except Exception as exc:  # the file, named, and why: torch's own message names none
            raise ValueError(f"{str(p / name)!r} is corrupt or unreadable (truncated or not written by nantrace): "
                             f"{type(exc).__name__}: {exc}") from None
    try:
        incident = Incident.from_dict(loaded["diagnosis.json"])
    except Exception as exc:
        raise ValueError(f"{str(p / 'diagnosis.json')!r} is not a nantrace incident: {type(exc).__name__}: {exc}") from None
    env, state, batch = loaded["env.json"], loaded["state.pt"], loaded["batch.pt"]
    forwards = []
    for f in batch.get("forwards", []):
        ac = f["autocast"]
        forwards.append(
            ForwardRecord(
                args=tuple(f["args"]),
                kwargs=dict(f["kwargs"]),
                rng=RngState(cpu=f["rng_cpu"], cuda=f["rng_cuda"] if torch.cuda.is_available() else None),
                autocast=AutocastState(
                    cpu_enabled=ac["cpu_enabled"], cpu_dtype=getattr(torch, ac["cpu_dtype"].removeprefix("torch.")),
                    cuda_enabled=ac["cuda_enabled"] and torch.cuda.is_available(),
                    cuda_dtype=getattr(torch, ac["cuda_dtype"].removeprefix("torch.")),
                ),
                buffers=dict(f["buffers"]) or None,
                output_grads=[(int(i), g) for i, g in f["output_grads"]],
                grad_enabled=bool(f.get("grad_enabled", True)),
                module=str(f.get("module", "")),
                tape_at=int(f.get("tape_at", 0)),
            )
        )
    tape = prelude = None
    if batch.get("tape"):
        try:
            tape = decode_tape(batch["tape"])
            prelude = decode_prelude(batch["tape"])
        except (ImportError, AttributeError, KeyError, TypeError) as exc:
            incident.details["bundle_tape"] = f"the loss code could not be restored: {type(exc).__name__}: {exc}"
    return Bundle(path=p, incident=incident, env=env, state=state, forwards=forwards, tape=tape, prelude=prelude,
                  outputs_finite=batch.get("outputs_finite"))


def _tape_data(capture: StepCapture) -> tuple[dict[str, Any] | None, str | None]:
    """The loss tape as bundle data, or why it is not in the bundle."""
    tape = capture.tape
    if tape is None or capture.calls or not tape.usable:
        return None, None
    try:
        return encode_tape(tape, capture.forwards, getattr(capture, "prelude", None)), None
    except Unencodable as exc:
        return None, f"the loss code is not in the bundle ({exc}); replay covers the model only"
