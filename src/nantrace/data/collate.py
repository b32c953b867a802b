"""`ValidatingCollate`: a DataLoader collate_fn that validates every batch it builds.

Works with ``num_workers > 0``: the skip counters live in shared memory (one slot per
worker, so no lock is needed) and the issues found in a worker travel back to the
process that created the collate through a multiprocessing queue; a small daemon thread
there appends them to `.issues` and hands the relevant ones to the guard.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import queue as queue_mod
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence, Sized
from multiprocessing import sharedctypes
from typing import Any

import torch
from torch.utils.data import default_collate, get_worker_info

from ..taxonomy import Action
from ..taxonomy import DATA_INCIDENT_CAUSES
from .batch import DEFAULT_LABEL_KEYS, PER_SAMPLE_CAUSES, BatchSchema, _leaves, validate_batch
from .issues import BATCH_CAUSES, DataIssue, DataValidationError

__all__ = ["GUARD_CAUSES", "DEFAULT_ENFORCED", "ValidatingCollate"]

_log = logging.getLogger("nantrace.data")

#: Issues handed to ``guard.record_data_incident``.
GUARD_CAUSES: frozenset[str] = frozenset(DATA_INCIDENT_CAUSES)

#: Causes the policy acts on by default; the others are recorded and logged only.
#: Shape changes are only recorded by default: text batches padded to their longest
#: sequence change shape legitimately (declare such dims with BatchSchema(variable_dims=...)
#: and add "shape_mismatch" to `enforce` to act on the others).
DEFAULT_ENFORCED: tuple[str, ...] = ("nonfinite_input", "label_out_of_range", "dtype_mismatch")

_POLICIES = ("skip", "raise")
_ON_UNFIXABLE = ("raise", "pass")
_SLOTS = 257  # counter slots: 0 = the creating process, 1 + worker id for DataLoader workers
_POLL_S = 0.5


class _Inbox:
    """The owner process's record of issues: bounded history plus the guard hand-off."""

    def __init__(self, history: Iterable[DataIssue], max_history: int, guard: Any) -> None:
        self.history: collections.deque[DataIssue] = collections.deque(history, maxlen=max_history)
        self.lock = threading.Lock()
        self.guard = guard
        self.received = 0  # issues delivered so far (history is bounded, this is not)

    def deliver(self, issue: DataIssue) -> None:
        with self.lock:
            self.history.append(issue)
            self.received += 1
        if self.guard is not None and issue.cause in GUARD_CAUSES:
            try:
                self.guard.record_data_incident(issue)
            except Exception:  # the guard's problem must not break data loading
                _log.exception("guard.record_data_incident failed")

    def snapshot(self) -> list[DataIssue]:
        with self.lock:
            return list(self.history)


def _drain_loop(owner: weakref.ref, q: Any, inbox: _Inbox) -> None:
    """Deliver issues sent by worker processes until the collate is garbage-collected."""
    while owner() is not None:
        try:
            issue = q.get(timeout=_POLL_S)
        except queue_mod.Empty:
            continue
        except (EOFError, OSError, ValueError):  # queue closed at shutdown
            return
        except Exception:  # an unreadable message must not stop the delivery
            _log.debug("could not read a data issue sent by a worker", exc_info=True)
            continue
        inbox.deliver(issue)


class ValidatingCollate:
    """Wrap a collate function so that every batch is validated before training sees it.

    `policy` decides what happens to batches with an *enforced* issue (`enforce`, by
    default NaN/Inf inputs, out-of-range labels and dtype changes; shape changes,
    degenerate normalisation and distribution shifts are only recorded and logged unless
    listed):

    * ``"raise"``: raise `DataValidationError` naming the cause, the path and the samples.
    * ``"skip"``: drop the offending samples and collate the remaining ones again (the
      batch gets smaller). A batch that cannot be repaired that way (every sample bad,
      all labels ``ignore_index``, a shape/dtype change of the whole batch, or a custom
      collate whose rows are not the samples) is handled by `on_unfixable`: ``"raise"``
      (default: a DataLoader cannot be told to skip a batch, and returning ``None`` or an
      empty batch would crash or NaN the training step) or ``"pass"`` (return it unchanged;
      the issue is still recorded and the guard notified, so a watched step can be skipped).

    `.skipped_samples` counts dropped samples, `.skipped_batches` the batches that lost
    samples or were rejected whole, `.issues` keeps the last `max_history` issues (also
    those found in DataLoader worker processes). With a `guard`, each issue with cause
    ``nonfinite_input`` or ``label_out_of_range`` is passed to
    ``guard.record_data_incident(issue)`` in the process that created the collate.

    `num_classes`, `ignore_index`, `label_keys`, `max_range`, `spread_rtol`,
    `skip_stats_keys` and `stats` are passed to `validate_batch`; `schema` is the
    `BatchSchema` to compare batches with (a fresh one by default, one per DataLoader
    worker; ``check_schema=False`` for none).
    """

    def __init__(
        self,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        *,
        policy: str = "skip",
        num_classes: int | None = None,
        ignore_index: int | None = -100,
        label_keys: Iterable[str] = DEFAULT_LABEL_KEYS,
        guard: Any = None,
        enforce: Iterable[str] = DEFAULT_ENFORCED,
        on_unfixable: str = "raise",
        schema: BatchSchema | None = None,
        check_schema: bool = True,
        max_range: float = 1e4,
        spread_rtol: float = 1e-6,
        skip_stats_keys: Iterable[str] = ("mask",),
        stats: bool = True,
        max_history: int = 1000,
    ) -> None:
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable (or None for default_collate); got {collate_fn!r}")
        if policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}; got {policy!r}")
        if on_unfixable not in _ON_UNFIXABLE:
            raise ValueError(f"on_unfixable must be one of {_ON_UNFIXABLE}; got {on_unfixable!r}")
        if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes <= 0):
            raise ValueError(f"num_classes must be a positive int or None; got {num_classes!r}")
        enforce_t = tuple(enforce)
        unknown = [c for c in enforce_t if c not in BATCH_CAUSES]
        if unknown:
            raise ValueError(f"enforce contains unknown cause(s) {unknown}; valid causes: {BATCH_CAUSES}")
        if guard is not None and not callable(getattr(guard, "record_data_incident", None)):
            raise TypeError(f"guard must have a record_data_incident(issue) method; got {type(guard).__name__}")
        if not (isinstance(max_history, int) and max_history >= 0):
            raise ValueError(f"max_history must be an int >= 0; got {max_history!r}")
        if schema is not None and not isinstance(schema, BatchSchema):
            raise TypeError(f"schema must be a nantrace.data.BatchSchema or None; got {type(schema).__name__}")
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.policy = policy
        self.on_unfixable = on_unfixable
        self.enforce = frozenset(enforce_t)
        self.validate_kwargs: dict[str, Any] = dict(
            num_classes=num_classes, ignore_index=ignore_index, label_keys=tuple(label_keys),
            max_range=max_range, spread_rtol=spread_rtol, skip_stats_keys=tuple(skip_stats_keys),
            stats=bool(stats),
        )
        validate_batch(torch.zeros(1), **self.validate_kwargs)  # argument check, fails fast
        self.schema = schema if schema is not None else (BatchSchema() if check_schema else None)
        self.guard = guard
        self.max_history = max_history
        self._setup_process_state(history=(), counts=(0, 0))

    # process-local plumbing --------------------------------------------------------------

    def _setup_process_state(self, history: Iterable[DataIssue], counts: tuple[int, int]) -> None:
        """(Re)create what belongs to the owning process: shared counters, queue, thread."""
        self._owner_pid = os.getpid()
        self._counts = sharedctypes.RawArray("q", 2 * _SLOTS)
        self._counts[0], self._counts[1] = counts
        # A spawn-context queue can be handed to fork, spawn and forkserver workers alike.
        self._queue = multiprocessing.get_context("spawn").Queue()
        self._inbox = _Inbox(history, self.max_history, self.guard)
        self._thread: threading.Thread | None = threading.Thread(
            target=_drain_loop, name="nantrace-data-drain", daemon=True,
            args=(weakref.ref(self), self._queue, self._inbox),
        )
        self._thread.start()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_inbox", "_thread"):
            state.pop(key)
        if _spawning():
            # Sent to a worker process: it reports back through the queue and counters.
            state["guard"] = None
        else:
            # Plain pickling (a checkpoint, a copy): keep values, not process plumbing.
            state["_plain"] = {"history": self._inbox.snapshot(),
                               "counts": (self.skipped_batches, self.skipped_samples)}
            for key in ("_queue", "_counts", "_owner_pid"):
                state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        plain = state.pop("_plain", None)
        self.__dict__.update(state)
        if plain is not None:
            self._setup_process_state(plain["history"], plain["counts"])
        else:  # a worker's copy: it never records locally
            self._inbox = _Inbox((), self.max_history, None)
            self._thread = None

    def _in_owner(self) -> bool:
        return os.getpid() == self._owner_pid

    def _slot(self) -> int:
        if self._in_owner():
            return 0
        info = get_worker_info()
        return 1 + (info.id % (_SLOTS - 1)) if info is not None else _SLOTS - 1

    def _count(self, batches: int, samples: int) -> None:
        slot = self._slot()
        self._counts[2 * slot] += batches
        self._counts[2 * slot + 1] += samples

    def _record(self, issues: Sequence[DataIssue]) -> None:
        for issue in issues:
            log = _log.warning if issue.severity == "error" else _log.info
            log("%s", issue)
            if self._in_owner():
                self._inbox.deliver(issue)
            else:
                try:
                    self._queue.put(issue)
                except Exception:  # never let reporting break data loading
                    _log.debug("could not send a data issue to the main process", exc_info=True)

    # public state ---------------------------------------------------------------------

    @property
    def skipped_batches(self) -> int:
        """Batches that lost samples or were rejected whole (all workers together)."""
        return int(sum(self._counts[0::2]))

    @property
    def skipped_samples(self) -> int:
        """Samples dropped (all workers together; a rejected batch counts all its samples)."""
        return int(sum(self._counts[1::2]))

    @property
    def issues(self) -> list[DataIssue]:
        """The last `max_history` issues found, oldest first (worker issues included)."""
        if not self._in_owner():  # a worker's copy: its issues travel to the owner
            return []
        self.drain()
        return self._inbox.snapshot()

    def drain(self, timeout: float = 0.0) -> int:
        """Collect the issues worker processes have sent; return how many arrived.

        A background thread does this continuously. With ``timeout > 0`` this waits
        until `timeout` seconds pass without a new issue arriving (useful right after a
        DataLoader finished, before reading `.issues` or checking the guard).
        """
        if not self._in_owner():
            return 0
        start = self._inbox.received
        deadline = time.monotonic() + timeout
        while True:
            try:
                issue = self._queue.get_nowait()
            except queue_mod.Empty:
                seen = self._inbox.received
                if time.monotonic() >= deadline:
                    return self._inbox.received - start
                time.sleep(0.01)
                if self._inbox.received != seen:  # the thread delivered one: wait on
                    deadline = time.monotonic() + timeout
                continue
            except (EOFError, OSError, ValueError):
                return self._inbox.received - start
            self._inbox.deliver(issue)
            deadline = time.monotonic() + timeout

    # the collate --------------------------------------------------------------------

    def __call__(self, samples: list[Any]) -> Any:
        batch = self.collate_fn(samples)
        report = validate_batch(batch, reference=self.schema, **self.validate_kwargs)
        if report.ok:
            return batch
        for issue in report.issues:  # what this collate does about it, for the guard's incident
            issue.details.setdefault(
                "action", (Action.RAISED if self.policy == "raise" else Action.SKIPPED) if issue.cause in self.enforce else Action.LOGGED
            )
        self._record(report.issues)
        enforced = [i for i in report.issues if i.cause in self.enforce]
        if not enforced:
            return batch
        if self.policy == "raise":
            raise DataValidationError(_message("batch rejected (policy='raise')", enforced), enforced)
        return self._skip(samples, batch, enforced)

    def _skip(self, samples: list[Any], batch: Any, enforced: list[DataIssue]) -> Any:
        n = len(samples) if isinstance(samples, Sized) else -1
        drop: set[int] = set()
        fixable = n > 0 and _rows_are_samples(batch, n)
        for issue in enforced:
            if issue.cause in PER_SAMPLE_CAUSES and issue.sample_indices and issue.details.get("kind") != "all_ignored":
                drop.update(issue.sample_indices)
            else:
                fixable = False
        if fixable and len(drop) < n:
            kept = [s for i, s in enumerate(samples) if i not in drop]
            repaired = self.collate_fn(kept)
            again = validate_batch(repaired, **self.validate_kwargs)  # stateless re-check
            left = [i for i in again.issues if i.cause in self.enforce]
            if not left:
                self._count(1, len(drop))
                _log.warning("nantrace: dropped samples %s from a batch of %d", sorted(drop), n)
                return repaired
            self._record(left)
            enforced = enforced + left
        self._count(1, max(n, 0))
        if self.on_unfixable == "pass":
            return batch
        raise DataValidationError(
            _message("batch rejected (policy='skip'): no valid subset of its samples is left "
                     "to train on, and a collate_fn cannot skip a batch; fix the data, or pass "
                     "on_unfixable='pass' to let it through and have the guard skip the step",
                     enforced),
            enforced,
        )

    def __repr__(self) -> str:
        return (f"ValidatingCollate(policy={self.policy!r}, enforce={sorted(self.enforce)}, "
                f"skipped_batches={self.skipped_batches}, skipped_samples={self.skipped_samples})")


def _spawning() -> bool:
    from multiprocessing import context

    return context.get_spawning_popen() is not None


def _rows_are_samples(batch: Any, n: int) -> bool:
    """True when every tensor of the collated batch has one row per sample."""
    leaves = list(_leaves(batch, "batch", frozenset(), False, "", True))
    return bool(leaves) and all(leaf.tensor.ndim >= 1 and leaf.tensor.shape[0] == n for leaf in leaves)


def _message(head: str, issues: Sequence[DataIssue]) -> str:
    lines = [f"nantrace: {head}:"]
    for issue in issues:
        where = f" samples {issue.sample_indices}" if issue.sample_indices else ""
        lines.append(f"  - {issue.cause} at {issue.path}{where}: {issue.summary} Fix: {issue.fix}")
    return "\n".join(lines)
