"""The run store: one SQLite database (WAL) per run directory, one run per directory.

One row per optimizer step and one per incident, committed as they happen, so another
process can read the run while it trains and a killed process loses at most the step in
flight. The schema is documented in ``docs/run_store.md``.

A run directory never mixes runs (see :mod:`nantrace.storage.runlife`): a writer opened in
a directory that holds an earlier run sets that run aside under ``RUN_DIR/previous/`` first;
one that holds a run still being written by a live process is refused; writers of the same
process share the run (a second guard, a second ``fit``). The store records how the run
ended (``status``): ``finished``, ``failed``, ``interrupted``, or ``running`` while a writer
is open; a run whose process was killed keeps ``running`` with a dead ``pid``, and
:meth:`RunStore.status` reports it as ``interrupted``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import sqlite3
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..incident import Incident
from . import runlife
from .runlife import RunStatus

DB_NAME = "nantrace.db"
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS steps (
    step       INTEGER PRIMARY KEY,
    time       REAL NOT NULL,
    loss       REAL,
    grad_norm  REAL,
    param_norm REAL,
    lr         TEXT,
    scale      REAL,
    skipped    INTEGER NOT NULL,
    action     TEXT,
    incident   TEXT
);
CREATE TABLE IF NOT EXISTS incidents (
    id     TEXT PRIMARY KEY,
    step   INTEGER NOT NULL,
    kind   TEXT NOT NULL,
    cause  TEXT NOT NULL,
    phase  TEXT,
    op     TEXT,
    module TEXT,
    action TEXT NOT NULL,
    time   REAL NOT NULL,
    data   TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS incidents_step ON incidents(step);
CREATE TABLE IF NOT EXISTS layer_stats (
    step         INTEGER NOT NULL,
    layer        INTEGER NOT NULL,
    grad_norm    REAL,
    param_norm   REAL,
    update_ratio REAL,
    PRIMARY KEY (step, layer)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS activation_stats (
    step      INTEGER NOT NULL,
    layer     INTEGER NOT NULL,
    absmax    REAL,
    nonfinite INTEGER NOT NULL,
    PRIMARY KEY (step, layer)
) WITHOUT ROWID;
"""


_STATS_COLUMNS: dict[str, tuple[str, ...]] = {
    "layer_stats": ("grad_norm", "param_norm", "update_ratio"),
    "activation_stats": ("absmax", "nonfinite"),
}
"""The per-layer statistics tables and their value columns (the schema above)."""


def _stats_table(table: str) -> str:
    if table not in _STATS_COLUMNS:
        raise ValueError(f"unknown statistics table {table!r}; expected one of {', '.join(_STATS_COLUMNS)}")
    return table


def _num(value: float | None) -> float | str | None:
    """SQLite stores NaN as NULL; keep it visible as the text 'nan' instead."""
    if value is None:
        return None
    value = float(value)
    return "nan" if math.isnan(value) else value


def _unnum(value: Any) -> float | None:
    if value is None:
        return None
    return float(value)


_WRITERS: "weakref.WeakSet[RunStore]" = weakref.WeakSet()
"""Writers open in this process: the last one to close a database records how the run ended,
and those still open when the interpreter exits are closed by :func:`_close_at_exit`."""


class RunStore:
    """Writer and reader of a run directory's ``nantrace.db``.

    ``RunStore(run_dir)`` opens (or starts) the run of ``run_dir`` for writing: an earlier
    run found there is set aside under ``run_dir/previous/`` (a note says where), a run a
    live process is writing raises ``ValueError``; ``readonly=True`` opens it for reading.
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, readonly: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / DB_NAME
        self.readonly = readonly
        self.set_aside: Path | None = None
        """Where the earlier run found in ``run_dir`` was moved, if one was."""
        self._ending: tuple[str, str | None] = ("finished", None)
        self._closed = False
        if readonly:
            if not self.run_dir.is_dir():
                raise ValueError(f"run directory {str(self.run_dir)!r} does not exist; expected a directory written by nantrace.watch(run_dir=...)")
            if not self.path.is_file():
                raise ValueError(f"{str(self.run_dir)!r} is not a nantrace run directory: expected {DB_NAME} inside it")
            uri = self.path.resolve().as_uri() + "?mode=ro"
            self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
            try:
                self._conn.execute("PRAGMA temp_store=MEMORY")  # the report's aggregates sort in memory
                self._conn.execute("SELECT count(*) FROM steps").fetchone()
            except sqlite3.DatabaseError as exc:
                self._conn.close()
                raise ValueError(f"{str(self.path)!r} is not a readable nantrace run store ({exc})") from None
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.set_aside = runlife.claim(self.run_dir, DB_NAME)
            self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(_SCHEMA)
            with self.transaction():
                self.set_meta("schema_version", SCHEMA_VERSION)
                owner = self.get_meta("writer")
                if owner is not None and owner.get("process") != runlife.PROCESS:
                    self._conn.close()  # another process started a run here at the same moment
                    raise ValueError(runlife.busy_message(self.run_dir, owner))
                if owner is None:
                    self.set_meta("created", time.time())
                    self.set_meta("writer", runlife.writer_identity())
                self.set_meta("status", "running")
                self.set_meta("ended", None)
                self.set_meta("end_reason", None)
            _WRITERS.add(self)
            if self.set_aside is not None:
                from ..console import display_path, note

                note(f"{display_path(str(self.run_dir))} held an earlier run; it was moved to "
                     f"{display_path(str(self.set_aside))} so that runs never mix (docs/run_store.md)")

    # ----------------------------------------------------------------- writing
    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Group writes into one commit (one per step); nests inside an open transaction."""
        if self._conn.in_transaction:
            yield
            return
        self._conn.execute("BEGIN")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def set_meta(self, key: str, value: Any) -> None:
        self._conn.execute(
            "INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, json.dumps(value, default=str)),
        )

    def log_step(
        self,
        *,
        step: int,
        loss: float | None,
        grad_norm: float | None,
        param_norm: float | None,
        lr: list[float],
        scale: float | None,
        skipped: bool,
        action: str | None,
        incident: str | None = None,
        wall_time: float | None = None,
    ) -> None:
        """Record one optimizer step; committed at once (autocommit)."""
        self._conn.execute(
            "INSERT OR REPLACE INTO steps(step, time, loss, grad_norm, param_norm, lr, scale, skipped, action, incident)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                step,
                wall_time if wall_time is not None else time.time(),
                _num(loss),
                _num(grad_norm),
                _num(param_norm),
                json.dumps(lr),
                _num(scale),
                int(skipped),
                action,
                incident,
            ),
        )

    def log_layer_stats(self, step: int, rows: list[tuple[int, float | None, float | None, float | None]]) -> None:
        """Per-layer figures of one step: (layer index into meta ``layer_names``, grad norm, param norm, update/param ratio)."""
        self._conn.executemany(
            "INSERT OR REPLACE INTO layer_stats(step, layer, grad_norm, param_norm, update_ratio) VALUES (?, ?, ?, ?, ?)",
            [(step, layer, _num(g), _num(p), _num(u)) for layer, g, p, u in rows],
        )

    def log_activation_stats(self, step: int, rows: list[tuple[int, float | None, int]]) -> None:
        """Per-module activation figures of one (sampled) step: (module index into meta ``activation_names``, abs-max, non-finite count)."""
        self._conn.executemany(
            "INSERT OR REPLACE INTO activation_stats(step, layer, absmax, nonfinite) VALUES (?, ?, ?, ?)",
            [(step, layer, _num(a), int(n)) for layer, a, n in rows],
        )

    def log_incident(self, incident: Incident) -> None:
        self._conn.execute(
            "INSERT OR REPLACE INTO incidents(id, step, kind, cause, phase, op, module, action, time, data)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                incident.id,
                incident.step,
                incident.kind,
                incident.cause,
                incident.phase,
                incident.op,
                incident.module,
                incident.action,
                incident.time,
                incident.to_json(),
            ),
        )

    def end_as(self, status: str, reason: str | None = None) -> None:
        """Record, when this writer closes, that the run ended as ``status`` (``finished``,
        ``failed`` or ``interrupted``) for ``reason`` (e.g. the script's exception)."""
        if status not in runlife.ENDINGS:
            raise ValueError(f"status must be one of {', '.join(runlife.ENDINGS)}; got {status!r}")
        self._ending = (status, reason)

    def close(self) -> None:
        """Close the connection; a writer records the run's end first (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if not self.readonly:
            _WRITERS.discard(self)
            others = any(w.path.resolve() == self.path.resolve() for w in list(_WRITERS))
            if not others:  # the last writer of this process: the run ends here
                status, reason = self._ending
                try:
                    with self.transaction():
                        self.set_meta("status", status)
                        self.set_meta("ended", time.time())
                        self.set_meta("end_reason", reason)
                except sqlite3.Error:
                    pass
        try:
            self._conn.close()
        except sqlite3.Error:
            pass

    # ----------------------------------------------------------------- reading
    def get_meta(self, key: str) -> Any:
        row = self._conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return json.loads(row[0]) if row else None

    def meta(self) -> dict[str, Any]:
        return {k: json.loads(v) for k, v in self._conn.execute("SELECT key, value FROM meta")}

    def status(self) -> RunStatus:
        """How the run stands: ``running``, ``finished``, ``failed``, ``interrupted`` (its
        process died without closing the store: killed, or the machine went down), or
        ``unknown`` (a store written before nantrace recorded it)."""
        last = self._conn.execute("SELECT max(step), max(time) FROM steps").fetchone()
        return runlife.status_of(self.meta(), last_step=last[0], last_time=last[1])

    def steps(self) -> list[dict[str, Any]]:
        rows = self._conn.execute(
            "SELECT step, time, loss, grad_norm, param_norm, lr, scale, skipped, action, incident FROM steps ORDER BY step"
        ).fetchall()
        return [
            {
                "step": r[0],
                "time": r[1],
                "loss": _unnum(r[2]),
                "grad_norm": _unnum(r[3]),
                "param_norm": _unnum(r[4]),
                "lr": json.loads(r[5]) if r[5] else [],
                "scale": _unnum(r[6]),
                "skipped": bool(r[7]),
                "action": r[8],
                "incident": r[9],
            }
            for r in rows
        ]

    def layer_stats(self) -> list[tuple[int, int, float | None, float | None, float | None]]:
        """All (step, layer, grad_norm, param_norm, update_ratio) rows, by step then layer."""
        rows = self._conn.execute(
            "SELECT step, layer, grad_norm, param_norm, update_ratio FROM layer_stats ORDER BY step, layer"
        ).fetchall()
        return [(r[0], r[1], _unnum(r[2]), _unnum(r[3]), _unnum(r[4])) for r in rows]

    def activation_stats(self) -> list[tuple[int, int, float | None, int]]:
        rows = self._conn.execute("SELECT step, layer, absmax, nonfinite FROM activation_stats ORDER BY step, layer").fetchall()
        return [(r[0], r[1], _unnum(r[2]), int(r[3])) for r in rows]

    def incidents(self) -> list[Incident]:
        rows = self._conn.execute("SELECT data FROM incidents ORDER BY step, time").fetchall()
        return [Incident.from_dict(json.loads(r[0])) for r in rows]

    # ----------------------------------------------------------------- the report's reads
    def raw_steps(self) -> list[tuple[Any, ...]]:
        """Every row of ``steps`` as stored (step, time, loss, grad_norm, param_norm, lr, scale,
        skipped, action): figures are numbers or the texts 'nan'/'inf'/'-inf', lr is JSON. The
        report decodes them in bulk; :meth:`steps` gives them decoded, one dict per step."""
        return self._conn.execute(
            "SELECT step, time, loss, grad_norm, param_norm, lr, scale, skipped, action FROM steps ORDER BY step"
        ).fetchall()

    def step_span(self, table: str) -> tuple[int | None, int | None]:
        """First and last step of a statistics table: two index look-ups (SQLite only optimises a lone min() or max())."""
        table = _stats_table(table)
        first = self._conn.execute(f"SELECT min(step) FROM {table}").fetchone()[0]
        last = self._conn.execute(f"SELECT max(step) FROM {table}").fetchone()[0]
        return first, last

    def row_counts(self, table: str, step: int) -> tuple[int, int]:
        """(rows of a statistics table, rows it holds for ``step``)."""
        table = _stats_table(table)
        rows = int(self._conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
        at = int(self._conn.execute(f"SELECT count(*) FROM {table} WHERE step = ?", (step,)).fetchone()[0])
        return rows, at

    def recorded_steps(self, table: str, lo: int, hi: int) -> list[int]:
        """The steps in ``[lo, hi)`` that a statistics table holds rows for."""
        table = _stats_table(table)
        return [r[0] for r in self._conn.execute(f"SELECT DISTINCT step FROM {table} WHERE step >= ? AND step < ?",
                                                 (lo, hi))]

    def layer_maxima(self, table: str, columns: tuple[str, ...], *, lo: int, hi: int, steps: list[int] | None = None,
                     nonfinite_count: str | None = None) -> tuple[int | None, int | None, list[tuple[Any, ...]]]:
        """Per layer over steps ``[lo, hi)`` (or only ``steps``): (layer, rows, max of each column[, sum of
        ``nonfinite_count``]), with the first and last step that had rows. SQLite's ``max()`` orders text above
        numbers, so a stored 'nan' wins its group (and +inf beats any number): no non-finite value is lost."""
        table = _stats_table(table)
        for column in (*columns, *([nonfinite_count] if nonfinite_count else [])):
            if column not in _STATS_COLUMNS[table]:
                raise ValueError(f"{table} has no column {column!r}; expected one of {', '.join(_STATS_COLUMNS[table])}")
        aggregates = ", ".join(f"max({c})" for c in columns) + (f", sum({nonfinite_count})" if nonfinite_count else "")
        head = f"SELECT layer, count(*), {aggregates} FROM {table} WHERE "
        if steps is None:
            span = self._conn.execute(f"SELECT min(step), max(step) FROM {table} WHERE step >= ? AND step < ?",
                                      (lo, hi)).fetchone()
            if span[0] is None:
                return None, None, []
            return span[0], span[1], self._conn.execute(head + "step >= ? AND step < ? GROUP BY layer", (lo, hi)).fetchall()
        if not steps:
            return None, None, []
        sql = head + f"step IN ({','.join('?' * len(steps))}) GROUP BY layer"
        return min(steps), max(steps), self._conn.execute(sql, steps).fetchall()

    def __enter__(self) -> "RunStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()




def _close_at_exit() -> None:
    """At interpreter exit, close the writers nobody closed, recording how the process ended:
    ``failed`` after an uncaught exception, ``interrupted`` after Ctrl-C, else ``finished``."""
    ending = runlife.exit_ending()
    for store in list(_WRITERS):
        if store._ending == ("finished", None):  # nobody said how it ended
            store.end_as(*ending)
        store.close()



atexit.register(_close_at_exit)
