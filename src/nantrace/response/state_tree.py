"""Training state as trees of tensors, for snapshots: what ``torch.load(weights_only=True)``
can read back, how many bytes a tree holds, mapping a function over its tensors, the RNG states
(Python, NumPy, torch CPU and CUDA) as plain data, and restoring an optimizer's state in place.
Used by :class:`~nantrace.response.rollback.SnapshotManager`."""

from __future__ import annotations

import copy
import random
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

try:  # NumPy is a dependency of nantrace, but the RNG capture should not insist on it.
    import numpy as np
except ImportError:  # pragma: no cover - numpy is installed with nantrace
    np = None  # type: ignore[assignment]

__all__ = ["is_plain", "map_tree", "nbytes", "restore_optimizer_in_place", "rng_state", "set_rng_state", "tree_tensors"]

_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def is_plain(obj: Any) -> bool:
    """True when ``torch.load(weights_only=True)`` can read ``obj`` back."""
    if isinstance(obj, torch.Tensor):
        return type(obj) in (torch.Tensor, nn.Parameter)
    if type(obj) in _PLAIN_LEAVES:
        return True
    if type(obj) in (dict, OrderedDict):
        return all(type(k) in _PLAIN_LEAVES and is_plain(v) for k, v in obj.items())
    if type(obj) in (list, tuple, set):
        return all(is_plain(v) for v in obj)
    return False


def tree_tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return out


def nbytes(obj: Any) -> int:
    seen: set[int] = set()
    total = 0
    for t in tree_tensors(obj):
        if id(t) not in seen and t.layout is torch.strided:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def map_tree(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Copy of the nested dict/list/tuple structure ``obj`` with ``fn`` applied to each tensor.

    Non-tensor leaves are deep-copied; an ``OrderedDict``'s ``_metadata`` (module versions
    that ``load_state_dict`` reads) is kept.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = map_tree(v, fn)
        meta = getattr(obj, "_metadata", None)
        if meta is not None and isinstance(out, OrderedDict):
            out._metadata = copy.deepcopy(meta)  # type: ignore[attr-defined]
        return out
    if type(obj) is list:
        return [map_tree(v, fn) for v in obj]
    if type(obj) is tuple:
        return tuple(map_tree(v, fn) for v in obj)
    return copy.deepcopy(obj)


def _numpy_to_plain(obj: Any) -> Any:
    if np is not None and isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": obj.dtype.str}
    if np is not None and isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _numpy_to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_numpy_to_plain(v) for v in obj]
    return obj


def _numpy_from_plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        if "__ndarray__" in obj:
            return np.array(obj["__ndarray__"], dtype=np.dtype(obj["dtype"]))
        return {k: _numpy_from_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return tuple(_numpy_from_plain(v) for v in obj)
    return obj


def rng_state() -> dict[str, Any]:
    """CPU, CUDA (when initialised), Python and NumPy RNG states, as weights_only-safe data."""
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": _numpy_to_plain(np.random.get_state()) if np is not None else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    if state.get("numpy") is not None and np is not None:
        np.random.set_state(_numpy_from_plain(state["numpy"]))


def restore_optimizer_in_place(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> bool:
    """Copy ``saved`` into the optimizer's existing state tensors; False when the layout differs.

    Copying in place keeps every reference to the state tensors valid (CUDA graphs,
    fused/capturable optimizers) and keeps their devices and dtypes. When the layout no
    longer matches (the snapshot predates the first step, a param group was added), the
    caller falls back to ``optimizer.load_state_dict``.
    """
    groups, saved_groups = optimizer.param_groups, saved["param_groups"]
    if len(groups) != len(saved_groups):
        return False
    id_to_param: dict[Any, torch.Tensor] = {}
    for group, saved_group in zip(groups, saved_groups):
        if len(group["params"]) != len(saved_group["params"]):
            return False
        id_to_param.update(zip(saved_group["params"], group["params"]))
    saved_state = saved["state"]
    if any(k not in id_to_param for k in saved_state):
        return False
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for sid, param in id_to_param.items():
        current = optimizer.state.get(param)  # .get: do not grow the defaultdict
        old = saved_state.get(sid)
        if not current and not old:
            continue
        if not current or not old or current.keys() != old.keys():
            return False
        for key, value in old.items():
            cur = current[key]
            if isinstance(value, torch.Tensor) != isinstance(cur, torch.Tensor):
                return False
            if isinstance(value, torch.Tensor) and (
                value.shape != cur.shape or value.dtype != cur.dtype or type(value) is not type(cur)
            ):
                return False
        pairs.append((current, old))
    with torch.no_grad():
        for current, old in pairs:
            for key, value in old.items():
                if isinstance(value, torch.Tensor):
                    current[key].copy_(value, non_blocking=current[key].device.type == "cuda")
                else:
                    current[key] = copy.deepcopy(value)
        for group, saved_group in zip(groups, saved_groups):
            for key, value in saved_group.items():
                if key in ("params", "param_names"):
                    continue
                cur = group.get(key)
                if (
                    isinstance(value, torch.Tensor)
                    and isinstance(cur, torch.Tensor)
                    and cur.shape == value.shape
                    and cur.dtype == value.dtype
                ):
                    cur.copy_(value)
                else:
                    group[key] = copy.deepcopy(value)
    return True
