"""Re-run a failing step from an incident bundle and diagnose it again, anywhere.

Usage::

    incident = nantrace.replay("runs/exp1/incidents/step000042-nonfinite_loss-3f2a9c1b7d0e")
    print(incident.op, incident.module, incident.cause)
    # aten._softmax.default blocks.1.attn masked_softmax_all

The model is rebuilt by the factory recorded in the bundle (its class, or
``Config.model_factory``) or by the ``model`` argument, then loaded with the pre-step
state and replayed under the op tracer exactly as the live guard does.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .taxonomy import Action
from .capture import StepCapture
from .config import Config
from .incident import Incident
from .storage.bundle import Bundle, load_bundle
from .storage.pointer import find_target, is_pointer, load_pointer, missing_message


def resolve_factory(spec: str) -> Callable[[], nn.Module]:
    """Import ``module:attr`` (attr may be dotted); a class or a zero-argument callable."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"model factory must be 'module:callable', got {spec!r}")
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:  # as `python -m` does: modules of the current project import
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r} for the model factory {spec!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_name!r} has no attribute {attr!r} (model factory {spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"model factory {spec!r} is not callable")
    return obj


def build_model(bundle: Bundle, model: nn.Module | str | None = None) -> nn.Module:
    """The bundle's model with its pre-step state loaded."""
    if isinstance(model, nn.Module):
        net = model
    else:
        spec = model or bundle.env.get("model_factory")
        if not spec:
            raise ValueError(
                f"bundle {str(bundle.path)!r} records no importable model factory (the model class "
                f"{bundle.env.get('model_class')!r} was defined in a script); pass --model module:factory"
            )
        try:
            net = resolve_factory(spec)()
        except TypeError as exc:
            raise ValueError(f"could not build the model with {spec!r}: {exc}; pass --model module:factory") from None
        if not isinstance(net, nn.Module):
            raise ValueError(f"model factory {spec!r} returned {type(net).__name__}, expected a torch.nn.Module")
    dtypes = bundle.env.get("param_dtypes") or []
    if len(dtypes) == 1 and dtypes[0] != "torch.float32":
        net = net.to(getattr(torch, dtypes[0].removeprefix("torch.")))
    net.load_state_dict(bundle.state["model"], strict=True)
    net.train(bool(bundle.env.get("training", True)))
    return net


def _received_from(bundle: Bundle) -> Incident | None:
    """A rank that only received another rank's NaN through the all-reduce has nothing of its own
    to replay: its bundle's diagnosis points at the rank the values came from."""
    saved = bundle.incident
    origins = saved.details.get("origin_ranks")
    writer = bundle.env.get("writer_rank")
    if not origins or writer is None or writer in origins:
        return None
    source = origins[0]
    sibling = bundle.path.parent.parent / f"rank{source}" / "incidents" if writer == 0 else None
    hint = f" (under {sibling})" if sibling is not None and sibling.is_dir() else ""
    return Incident(
        step=saved.step, kind=saved.kind, phase=saved.phase, op=None, module=None, source=None, rank=source,
        cause=saved.cause, transient=None, action=Action.LOGGED, bundle=str(bundle.path),
        summary=(f"The non-finite values of step {saved.step} came from rank {source}: rank {writer} only received "
                 "them through the gradient all-reduce, so there is nothing of its own to replay."),
        fix=f"Replay the bundle written by rank {source}{hint}, which holds the batch and state that produced them.",
        details={"replayed_from": str(bundle.path), "received_from_rank": source, "origin_ranks": origins},
    )


def _follow_pointer(path: str | os.PathLike[str], model: nn.Module | str | None, *, config: Config | None) -> Incident:
    """Replay the full bundle a pointer names (``storage/pointer.py``); the diagnosis says it was
    followed. When that bundle is not on this filesystem, a ``ValueError`` says where it should be."""
    pointer = load_pointer(path)
    found = find_target(pointer)
    if found is None:
        raise ValueError(missing_message(pointer))
    rank, target = found
    incident = replay(target, model, config=config)
    incident.details.update({"followed_pointer": str(pointer.path), "pointer_writer_rank": pointer.writer_rank,
                             "bundle_rank": rank})
    return incident


def replay(bundle_dir: str | os.PathLike[str], model: nn.Module | str | None = None, *, config: Config | None = None) -> Incident:
    """Replay the failing step of a bundle; returns a fresh diagnosis (compare with the saved one).
    ``bundle_dir`` may be a pointer written by a rank that holds no full bundle: the bundle it names
    is replayed."""
    from ._watch import watch
    from .localisation.localiser import localise_incident

    if is_pointer(bundle_dir):
        return _follow_pointer(bundle_dir, model, config=config)
    bundle = load_bundle(bundle_dir)
    received = _received_from(bundle)
    if received is not None:
        return received
    if not bundle.forwards:
        raise ValueError(f"bundle {str(bundle_dir)!r} holds no captured forward to replay")
    net = build_model(bundle, model)
    saved = bundle.incident
    cfg = (config or Config()).replace(outputs={"print_incidents": False, "save_bundle": False})
    guard = watch(net, config=cfg)
    try:
        incident = Incident(
            step=saved.step, kind=saved.kind, phase=None, op=None, module=None, source=None, rank=saved.rank,
            cause="unknown", summary=saved.summary, fix=saved.fix, action=Action.LOGGED,
            details={"replayed_from": str(bundle.path)},
        )
        capture = StepCapture(forwards=list(bundle.forwards), tape=bundle.tape, prelude=bundle.prelude)
        if bundle.outputs_finite is not None:
            capture.outputs_ok = torch.tensor(bundle.outputs_finite)
        if saved.kind == "exception":  # the step raised: replay it until it raises again
            from .localisation.exceptions import diagnose_exception

            incident.kind, incident.action = "exception", Action.RAISED
            if not diagnose_exception(guard.watched, incident, capture, None):
                incident.summary = (f"{saved.summary} (Replaying the bundle did not raise again: the exception came from "
                                    "code the bundle does not hold, such as the loss code.)")
        else:
            localise_incident(guard.watched, incident, capture)
    finally:
        guard.close()
    incident.bundle = str(bundle.path)
    return incident
