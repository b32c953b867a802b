"""The run store: one SQLite database (WAL) per run directory.

One row per optimizer step and one per incident, committed as they happen, so another
process can read the run while it trains and a killed process loses at most the step in
flight. The schema is documented in ``docs/run_store.md``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..incident import Incident

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


class RunStore:
    """Writer and reader of a run directory's ``nantrace.db``."""

    def __init__(self, run_dir: str | os.PathLike[str], *, readonly: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / DB_NAME
        self.readonly = readonly
        if readonly:
            if not self.run_dir.is_dir():
                raise ValueError(f"run directory {str(self.run_dir)!r} does not exist; expected a directory written by nantrace.watch(run_dir=...)")
            if not self.path.is_file():
                raise ValueError(f"{str(self.run_dir)!r} is not a nantrace run directory: expected {DB_NAME} inside it")
            uri = self.path.resolve().as_uri() + "?mode=ro"
            self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
            try:
                self._conn.execute("SELECT count(*) FROM steps").fetchone()
            except sqlite3.DatabaseError as exc:
                self._conn.close()
                raise ValueError(f"{str(self.path)!r} is not a readable nantrace run store ({exc})") from None
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(_SCHEMA)
            self.set_meta("schema_version", SCHEMA_VERSION)
            if self.get_meta("created") is None:
                self.set_meta("created", time.time())

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

    def close(self) -> None:
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

    def __enter__(self) -> "RunStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


