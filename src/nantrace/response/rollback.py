"""Last-good training state: snapshots taken while training is healthy, restored on demand.

The ``on_anomaly="rollback"`` policy needs a state to roll back to. :class:`SnapshotManager`
copies everything that decides how training goes on (model parameters and buffers, the
optimizer's state, the GradScaler, every LR scheduler and the random number generators)
every ``interval`` good steps, keeps the newest ``keep`` copies, and puts the newest one
back, bit for bit and in place, when :meth:`SnapshotManager.restore` is called.

Two places to keep the copies:

- ``where="memory"``: host (CPU) memory. Tensors on a CUDA device are copied into pinned
  buffers with non-blocking copies (one synchronisation per snapshot); the buffers of
  dropped snapshots are recycled, so steady-state training allocates nothing new.
- ``where="disk"``: one ``torch.save`` file per snapshot in ``directory`` (a fresh
  temporary directory by default), written atomically (temporary name, ``fsync``,
  ``os.replace``) and loadable with ``torch.load(..., weights_only=True)``: the Python
  and NumPy RNG states are stored as plain lists and numbers. A component that
  ``weights_only`` could not load (a scheduler holding arbitrary objects, say) is kept in
  memory next to the file instead, with a warning.

Usage::

    from nantrace.response.rollback import SnapshotManager

    snaps = SnapshotManager(model, optimizer, scaler=scaler, interval=100)
    snaps.add_scheduler(lr_scheduler)          # schedulers may come later
    for step, batch in enumerate(loader):
        ...                                    # forward, backward, optimizer.step()
        if step_was_good:
            snaps.maybe_snapshot(step)         # a copy every 100 good steps
        else:
            snaps.restore()                    # back to the last good state
    snaps.close()
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import tempfile
import uuid
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .state_tree import is_plain, map_tree, nbytes, restore_optimizer_in_place, rng_state, set_rng_state

__all__ = ["SnapshotManager", "WHERE_CHOICES"]

WHERE_CHOICES = ("memory", "disk")
"""Where snapshots are kept: ``"memory"`` (host RAM) or ``"disk"`` (``torch.save`` files)."""

SNAPSHOT_FORMAT = "nantrace.snapshot/1"
BOOKKEEPING_FORMAT = "nantrace.snapshots/1"
_FILE_RE = re.compile(r"^snapshot-(\d+)\.pt$")

_PoolKey = tuple[tuple[int, ...], torch.dtype, bool]


def _bad_arg(name: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"SnapshotManager: {name} must be {expected}; got {name}={value!r}")


# --------------------------------------------------------------------------- records
@dataclass
class _Snapshot:
    """One stored snapshot: a payload held in memory, or a file (plus what stayed in memory)."""

    step: int
    payload: dict[str, Any] | None = None
    path: Path | None = None
    sidecar: dict[str, Any] = field(default_factory=dict)
    buffers: list[tuple[_PoolKey, torch.Tensor]] = field(default_factory=list)
    nbytes: int = 0


class _BufferPool:
    """CPU tensors freed by dropped snapshots, reused by the next ones (keyed by shape, dtype, pinned)."""

    def __init__(self) -> None:
        self._free: dict[_PoolKey, list[torch.Tensor]] = {}

    def take(self, key: _PoolKey) -> torch.Tensor:
        bucket = self._free.get(key)
        if bucket:
            return bucket.pop()
        shape, dtype, pinned = key
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned)

    def give(self, buffers: list[tuple[_PoolKey, torch.Tensor]]) -> None:
        for key, buf in buffers:
            self._free.setdefault(key, []).append(buf)
        buffers.clear()

    def clear(self) -> None:
        self._free.clear()


# --------------------------------------------------------------------------- manager
class SnapshotManager:
    """Keeps last-good training state and restores it on demand.

    A snapshot holds the model's ``state_dict`` (parameters and persistent buffers), the
    optimizer's ``state_dict`` (a deep copy: Adam's ``exp_avg``, ``exp_avg_sq``, ``step``,
    SGD's momentum buffers, the param groups with their learning rates), the GradScaler's
    ``state_dict``, every LR scheduler's ``state_dict`` and the RNG states (CPU; CUDA when
    CUDA is initialised; Python's ``random``; NumPy's global generator).

    :meth:`restore` writes the newest snapshot back in place: parameters and buffers are
    copied into the existing tensors (``load_state_dict`` copies), so the optimizer's
    references stay valid and the model keeps its devices and dtypes; the optimizer's
    state tensors are overwritten in place whenever their layout still matches.

    Call :meth:`maybe_snapshot` after a good, applied optimizer step (after
    ``scaler.update()`` when a GradScaler is used, so that the snapshot holds the scale the
    next step will use).

    Args:
        model: the watched module (DDP/FSDP wrappers and compiled modules included).
        optimizer: its optimizer, or ``None``.
        scaler: a ``torch.amp.GradScaler`` (or anything with ``state_dict`` /
            ``load_state_dict``), or ``None``.
        schedulers: LR schedulers known now; more can be added with :meth:`add_scheduler`.
        interval: :meth:`maybe_snapshot` takes a snapshot when ``step % interval == 0``.
        where: ``"memory"`` or ``"disk"``.
        directory: where ``"disk"`` snapshots go (created if missing); ``None`` makes a
            temporary directory that :meth:`close` removes. Ignored for ``"memory"``.
        keep: how many snapshots to keep (the oldest are dropped).

    Usage::

        snaps = SnapshotManager(model, optimizer, interval=100, where="disk",
                                directory="runs/exp1/snapshots")
        snaps.maybe_snapshot(step)      # after each good step
        step = snaps.restore()          # on a failure: back to the newest snapshot
        snaps.close()                   # deletes the snapshot files
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        scaler: Any = None,
        schedulers: Sequence[Any] = (),
        interval: int = 100,
        where: str = "memory",
        directory: str | os.PathLike[str] | None = None,
        keep: int = 2,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"SnapshotManager: model must be a torch.nn.Module; got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"SnapshotManager: optimizer must be a torch.optim.Optimizer or None; got {type(optimizer).__name__}"
            )
        if scaler is not None and not (hasattr(scaler, "state_dict") and hasattr(scaler, "load_state_dict")):
            raise TypeError(
                "SnapshotManager: scaler must be a torch.amp.GradScaler (with state_dict/load_state_dict) or None; "
                f"got {type(scaler).__name__}"
            )
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise _bad_arg("interval", interval, "an int >= 1 (a snapshot every `interval` good steps)")
        if where not in WHERE_CHOICES:
            raise _bad_arg("where", where, "one of " + ", ".join(repr(c) for c in WHERE_CHOICES))
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise _bad_arg("keep", keep, "an int >= 1 (how many snapshots to keep)")

        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.interval = interval
        self.where = where
        self.keep = keep
        self._schedulers: list[Any] = []
        for scheduler in schedulers:
            self.add_scheduler(scheduler)
        self._snapshots: list[_Snapshot] = []
        self._pool = _BufferPool()
        self._closed = False
        self._warned_sidecar = False
        self.directory: Path | None = None
        self._created_dir = False
        self._finalizer: weakref.finalize | None = None
        if where == "disk":
            self._init_directory(directory)

    # ------------------------------------------------------------------ setup
    def _init_directory(self, directory: str | os.PathLike[str] | None) -> None:
        if directory is None:
            path = Path(tempfile.mkdtemp(prefix="nantrace-snapshots-"))
            self._created_dir = True
            # Removed at interpreter exit (or garbage collection) if close() is never called.
            self._finalizer = weakref.finalize(self, shutil.rmtree, str(path), True)
        else:
            path = Path(directory)
            existed = path.exists()
            try:
                path.mkdir(parents=True, exist_ok=True)
                fd, probe = tempfile.mkstemp(prefix=".probe-", dir=path)
                os.close(fd)
                os.unlink(probe)
            except OSError as exc:
                raise _bad_arg(
                    "directory",
                    str(directory),
                    f"a writable directory for where='disk' ({exc.strerror or exc}); "
                    "or use where='memory'",
                ) from exc
            self._created_dir = not existed
        self.directory = path

    def add_scheduler(self, scheduler: Any) -> None:
        """Include ``scheduler`` (anything with ``state_dict`` / ``load_state_dict``) in snapshots.

        LR schedulers are often created after the optimizer is watched; add them as they
        come. Adding the same scheduler twice has no effect. A scheduler added after a
        snapshot was taken is not in that snapshot (:meth:`restore` warns about it).
        """
        if not (callable(getattr(scheduler, "state_dict", None)) and callable(getattr(scheduler, "load_state_dict", None))):
            raise TypeError(
                "SnapshotManager.add_scheduler: expected an LR scheduler with state_dict() and load_state_dict(); "
                f"got {type(scheduler).__name__}"
            )
        if not any(s is scheduler for s in self._schedulers):
            self._schedulers.append(scheduler)

    # ------------------------------------------------------------------ properties
    @property
    def last_step(self) -> int | None:
        """Step of the newest snapshot, ``None`` when there is none."""
        return self._snapshots[-1].step if self._snapshots else None

    @property
    def steps(self) -> tuple[int, ...]:
        """Steps of the snapshots held, oldest first."""
        return tuple(s.step for s in self._snapshots)

    @property
    def nbytes(self) -> int:
        """Bytes the held snapshots take (host memory for ``"memory"``, file sizes for ``"disk"``)."""
        return sum(s.nbytes for s in self._snapshots)

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ taking snapshots
    def maybe_snapshot(self, step: int) -> bool:
        """Take a snapshot when ``step % interval == 0``; return whether one was taken.

        Call it after a good, applied optimizer step. A step that already has the newest
        snapshot is not taken twice.
        """
        self._check_open()
        if step % self.interval != 0 or self.last_step == step:
            return False
        self.snapshot(step)
        return True

    def snapshot(self, step: int) -> None:
        """Take a snapshot of the current state now, labelled ``step``; drop the oldest beyond ``keep``."""
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise _bad_arg("step", step, "an int >= 0")
        replaced = [s for s in self._snapshots if s.step == step]
        # Free the oldest before copying, so that its buffers are reused (keep >= 2 still
        # leaves a good snapshot should the copy fail).
        if not replaced and self.keep >= 2:
            while len(self._snapshots) >= self.keep:
                self._drop(self._snapshots.pop(0))
        record = self._take_disk(step) if self.where == "disk" else self._take_memory(step)
        for old in replaced:
            self._snapshots.remove(old)
            self._drop(old, delete_file=old.path != record.path)
        self._snapshots.append(record)
        while len(self._snapshots) > self.keep:
            self._drop(self._snapshots.pop(0))

    def _components(self, tensor_fn: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
        """The state to keep, each tensor passed through ``tensor_fn``."""
        memo: dict[tuple[Any, ...], torch.Tensor] = {}

        def once(t: torch.Tensor) -> torch.Tensor:
            # Tied weights appear twice in a state_dict: copy their storage once.
            t = t.detach()
            if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_quantized:
                return tensor_fn(t)
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if key not in memo:
                memo[key] = tensor_fn(t)
            return memo[key]

        with torch.no_grad():
            components: dict[str, Any] = {"model": map_tree(self.model.state_dict(), once)}
            components["optimizer"] = (
                map_tree(self.optimizer.state_dict(), once) if self.optimizer is not None else None
            )
            components["scaler"] = copy.deepcopy(self.scaler.state_dict()) if self.scaler is not None else None
            components["schedulers"] = [map_tree(s.state_dict(), once) for s in self._schedulers]
        components["rng"] = rng_state()
        return components

    def _copier(self, buffers: list[tuple[_PoolKey, torch.Tensor]], cuda_devices: set[torch.device]) -> Callable[[torch.Tensor], torch.Tensor]:
        """A tensor function that copies into (recycled, pinned for CUDA sources) CPU buffers."""

        def copy_to_cpu(t: torch.Tensor) -> torch.Tensor:
            if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_quantized:
                return t.clone()  # tensor subclasses (DTensor, ...), sparse, quantized: plain copy
            pinned = t.device.type == "cuda"
            key: _PoolKey = (tuple(t.shape), t.dtype, pinned)
            buf = self._pool.take(key)
            buf.copy_(t, non_blocking=pinned)
            if pinned:
                cuda_devices.add(t.device)
            buffers.append((key, buf))
            return buf

        return copy_to_cpu

    @staticmethod
    def _synchronize(cuda_devices: set[torch.device]) -> None:
        for device in cuda_devices:
            torch.cuda.synchronize(device)

    def _take_memory(self, step: int) -> _Snapshot:
        buffers: list[tuple[_PoolKey, torch.Tensor]] = []
        cuda_devices: set[torch.device] = set()
        try:
            payload = self._components(self._copier(buffers, cuda_devices))
            self._synchronize(cuda_devices)
        except BaseException:
            self._pool.give(buffers)
            raise
        payload["format"] = SNAPSHOT_FORMAT
        payload["step"] = step
        return _Snapshot(step=step, payload=payload, buffers=buffers, nbytes=nbytes(payload))

    def _take_disk(self, step: int) -> _Snapshot:
        assert self.directory is not None
        staging: list[tuple[_PoolKey, torch.Tensor]] = []
        cuda_devices: set[torch.device] = set()
        to_cpu = self._copier(staging, cuda_devices)

        def for_disk(t: torch.Tensor) -> torch.Tensor:
            # CPU tensors are written as they are (torch.save reads them right away);
            # device tensors go through pinned staging buffers.
            return t if t.device.type == "cpu" else to_cpu(t)

        try:
            components = self._components(for_disk)
            self._synchronize(cuda_devices)
            sidecar: dict[str, Any] = {}
            payload: dict[str, Any] = {"format": SNAPSHOT_FORMAT, "step": step, "in_memory": []}
            named = [("model", components["model"]), ("optimizer", components["optimizer"]),
                     ("scaler", components["scaler"]), ("rng", components["rng"])]
            named += [(f"schedulers.{i}", s) for i, s in enumerate(components["schedulers"])]
            payload["schedulers"] = [None] * len(components["schedulers"])
            for name, value in named:
                if not is_plain(value):
                    # weights_only could not read it back: keep a private copy in memory.
                    sidecar[name] = map_tree(value, lambda t: t.detach().clone())
                    payload["in_memory"].append(name)
                    value = None
                if name.startswith("schedulers."):
                    payload["schedulers"][int(name.split(".")[1])] = value
                else:
                    payload[name] = value
            if sidecar and not self._warned_sidecar:
                self._warned_sidecar = True
                warnings.warn(
                    f"nantrace snapshots: {', '.join(sidecar)} cannot be stored in a weights_only file; "
                    "kept in memory next to the snapshot files (lost if the process ends)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            path = self.directory / f"snapshot-{step:010d}.pt"
            tmp = self.directory / f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
            try:
                with open(tmp, "wb") as fh:
                    torch.save(payload, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        finally:
            self._pool.give(staging)
        return _Snapshot(step=step, path=path, sidecar=sidecar, nbytes=path.stat().st_size + nbytes(sidecar))

    def _drop(self, record: _Snapshot, *, delete_file: bool = True) -> None:
        self._pool.give(record.buffers)
        record.payload = None
        record.sidecar = {}
        if delete_file and record.path is not None:
            record.path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ restoring
    def restore(self, *, clear_grads: bool = True) -> int:
        """Put the newest snapshot back in place and return its step.

        Restores parameters and buffers (in place), optimizer, GradScaler and scheduler
        state (the learning rates in ``optimizer.param_groups`` included) and the RNG
        states. With ``clear_grads`` the parameters' ``.grad`` are set to ``None``: the
        gradients of the failed step mean nothing after a rollback. The snapshot stays
        available for a later restore.

        Raises:
            RuntimeError: no snapshot has been taken yet, or the manager is closed.
        """
        self._check_open()
        if not self._snapshots:
            raise RuntimeError(
                "nantrace: cannot roll back: no snapshot has been taken yet (snapshots are taken by "
                f"maybe_snapshot() every {self.interval} good steps, or by snapshot())"
            )
        record = self._snapshots[-1]
        payload, fresh = self._payload(record)
        if len(payload["schedulers"]) < len(self._schedulers):
            warnings.warn(
                f"nantrace snapshots: {len(self._schedulers) - len(payload['schedulers'])} LR scheduler(s) were "
                f"added after the snapshot of step {record.step} and keep their current state",
                RuntimeWarning,
                stacklevel=2,
            )
        self.model.load_state_dict(payload["model"])  # copy_ into the existing tensors
        if self.optimizer is not None and payload["optimizer"] is not None:
            if not restore_optimizer_in_place(self.optimizer, payload["optimizer"]):
                saved = payload["optimizer"] if fresh else map_tree(payload["optimizer"], lambda t: t.clone())
                self.optimizer.load_state_dict(saved)
        if self.scaler is not None and payload["scaler"]:
            self.scaler.load_state_dict(copy.deepcopy(payload["scaler"]))
        for scheduler, state in zip(self._schedulers, payload["schedulers"]):
            scheduler.load_state_dict(state if fresh else copy.deepcopy(state))
        set_rng_state(payload["rng"])
        # Host-to-device copies from pinned snapshot buffers may still be in flight: finish
        # them before those buffers can be recycled or read.
        for device in {t.device for t in self.model.parameters() if t.device.type == "cuda"}:
            torch.cuda.synchronize(device)
        if clear_grads:
            for param in self.model.parameters():
                param.grad = None
        return record.step

    def _payload(self, record: _Snapshot) -> tuple[dict[str, Any], bool]:
        """The snapshot's content, and whether it is a fresh object nobody else holds."""
        if record.payload is not None:
            return record.payload, False
        assert record.path is not None
        payload = torch.load(record.path, map_location="cpu", weights_only=True)
        if payload.get("format") != SNAPSHOT_FORMAT:
            raise RuntimeError(f"nantrace: {record.path} is not a nantrace snapshot ({payload.get('format')!r})")
        for name in payload.get("in_memory", []):
            if name not in record.sidecar:
                raise RuntimeError(
                    f"nantrace: the snapshot of step {record.step} kept {name} in the memory of the process "
                    f"that wrote {record.path}; this process cannot restore it"
                )
            value = copy.deepcopy(record.sidecar[name])
            if name.startswith("schedulers."):
                payload["schedulers"][int(name.split(".")[1])] = value
            else:
                payload[name] = value
        return payload, True

    # ------------------------------------------------------------------ bookkeeping
    def state_dict(self) -> dict[str, Any]:
        """Which snapshots exist (steps and, for ``"disk"``, file names); JSON-serialisable."""
        return {
            "format": BOOKKEEPING_FORMAT,
            "where": self.where,
            "interval": self.interval,
            "keep": self.keep,
            "directory": str(self.directory) if self.directory is not None else None,
            "snapshots": [
                {"step": s.step, "file": s.path.name if s.path is not None else None} for s in self._snapshots
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt the snapshot list of :meth:`state_dict`.

        ``"disk"``: files are looked up by name in this manager's ``directory`` (so a run
        directory may move); a missing file is skipped with a warning, adopted files are
        managed (dropped, deleted on close) like the manager's own. ``"memory"``: only the
        snapshots this manager still holds can be kept; in-memory snapshots do not
        survive the process that took them. Snapshots of this manager that are not
        listed are dropped.
        """
        self._check_open()
        if not isinstance(state, dict) or state.get("format") != BOOKKEEPING_FORMAT:
            raise ValueError(
                f"SnapshotManager.load_state_dict: expected a state of format {BOOKKEEPING_FORMAT!r}; "
                f"got {state.get('format') if isinstance(state, dict) else type(state).__name__!r}"
            )
        if state.get("where") != self.where:
            raise _bad_arg("state['where']", state.get("where"), f"{self.where!r}, like this manager")
        held_by_step = {s.step: s for s in self._snapshots}
        held_by_file = {s.path.name: s for s in self._snapshots if s.path is not None}
        adopted: list[_Snapshot] = []
        for entry in state.get("snapshots", []):
            step = int(entry["step"])
            if self.where == "memory":
                if step in held_by_step:
                    adopted.append(held_by_step.pop(step))
                continue
            name = str(entry.get("file") or "")
            match = _FILE_RE.match(name)
            if match is None or int(match.group(1)) != step:
                raise ValueError(f"SnapshotManager.load_state_dict: bad snapshot entry {entry!r}")
            if name in held_by_file:
                record = held_by_file.pop(name)
                held_by_step.pop(record.step, None)
                adopted.append(record)
                continue
            assert self.directory is not None
            path = self.directory / name
            if not path.is_file():
                warnings.warn(f"nantrace snapshots: {path} is missing; snapshot of step {step} forgotten", RuntimeWarning, stacklevel=2)
                continue
            adopted.append(_Snapshot(step=step, path=path, nbytes=path.stat().st_size))
        for record in self._snapshots:
            if not any(record is a for a in adopted):
                self._drop(record, delete_file=record.path is not None and all(record.path != a.path for a in adopted))
        self._snapshots = adopted
        while len(self._snapshots) > self.keep:
            self._drop(self._snapshots.pop(0))

    # ------------------------------------------------------------------ closing
    def close(self, *, delete_files: bool = True) -> None:
        """Free the snapshots; for ``"disk"`` delete the files (and the temporary directory it made).

        Idempotent. ``delete_files=False`` leaves the files in place (a paused run can be
        resumed from them with :meth:`load_state_dict` and :meth:`restore`).
        """
        if self._closed:
            return
        self._closed = True
        for record in self._snapshots:
            self._drop(record, delete_file=delete_files)
        self._snapshots = []
        self._pool.clear()
        if self.directory is not None and delete_files and self._created_dir:
            if self._finalizer is not None:
                self._finalizer()  # rmtree of the temporary directory
            else:
                try:
                    self.directory.rmdir()  # only if empty: leave files that are not ours
                except OSError:
                    pass
        elif self._finalizer is not None:
            self._finalizer.detach()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("nantrace: this SnapshotManager is closed")

    def __enter__(self) -> SnapshotManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"disk:{self.directory}" if self.where == "disk" else "memory"
        return (
            f"SnapshotManager(where={where!r}, interval={self.interval}, keep={self.keep}, "
            f"steps={list(self.steps)}, closed={self._closed})"
        )
