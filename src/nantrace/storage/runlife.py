"""One run per run directory: who writes it, how it ended, and setting earlier runs aside.

:class:`~nantrace.storage.runstore.RunStore` calls :func:`claim` before it opens a
directory for writing. The store's ``meta`` table names its writer (a random token per
process, the pid, the host) and the run's ``status``; from them:

- a run written by *this* process goes on (a second guard on the same ``run_dir``, a
  second ``trainer.fit``): one process, one run;
- a run still being written by another live process on this host is refused
  (``ValueError``): two processes would interleave their steps;
- any other earlier run (finished, failed, killed, or written before nantrace recorded
  its writer) is moved, whole, to ``RUN_DIR/previous/<its start time>/``: the new run
  starts alone in ``RUN_DIR`` and nothing is lost. A run whose process died without
  closing the store is marked ``interrupted`` on the way.

Usage::

    set_aside = claim(Path("runs/exp1"), "nantrace.db")   # None, or runs/exp1/previous/20250301-101500
    status_of(store.meta(), last_step=41, last_time=t).describe()
    # 'interrupted: its process (pid 4242) ended without closing the run (killed, or the machine went down); last step 41'
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sqlite3
import sys
import time
import uuid
from pathlib import Path
from typing import Any

PROCESS = uuid.uuid4().hex
"""This process's writer token (a pid can be re-used, in a container by every run)."""

ENDINGS = ("finished", "failed", "interrupted")
"""How a run can end, as recorded in ``meta.status`` (``running`` while a writer is open)."""

PREVIOUS = "previous"
"""Subdirectory of a run directory that holds the earlier runs set aside."""

RUN_ENTRIES = ("nantrace.db", "nantrace.db-wal", "nantrace.db-shm", "incidents", "snapshots", "tensorboard",
               "report.html")
"""What a run writes into its directory: moved together when the run is set aside. Anything
else there (the user's files, other ranks' ``rankN/`` directories) stays where it is."""


@dataclasses.dataclass(frozen=True)
class RunStatus:
    """How a stored run stands, for people (``describe()``) and for the report."""

    state: str
    """``running``, ``finished``, ``failed``, ``interrupted`` or ``unknown``."""
    reason: str | None = None
    """Why, when there is more to say (the exception, the dead pid, the other host)."""
    ended: float | None = None
    """Unix time the run ended, when its writer recorded it."""
    last_step: int | None = None
    """The last step recorded."""

    def describe(self) -> str:
        """One line: ``interrupted: its process (pid 4242) ended ...; last step 41``."""
        text = self.state + (f": {self.reason}" if self.reason else "")
        return text + (f"; last step {self.last_step}" if self.last_step is not None else "")


def writer_identity() -> dict[str, Any]:
    """What ``meta.writer`` records about the process that starts a run."""
    return {"process": PROCESS, "pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}


def alive(writer: dict[str, Any]) -> bool:
    """Whether the process named by ``writer`` is still running (only knowable on its host)."""
    if writer.get("process") == PROCESS:
        return True
    pid = writer.get("pid")
    if not isinstance(pid, int) or writer.get("host") != socket.gethostname() or pid == os.getpid():
        return False  # our own pid under another token: a re-used pid, that process is gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return False
    return True


def busy_message(run_dir: Path, writer: dict[str, Any]) -> str:
    """The refusal when another live process writes ``run_dir``."""
    since = writer.get("started")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
    return (f"run directory {str(run_dir)!r} is in use: process {writer.get('pid')} on {writer.get('host')} is writing "
            f"a run there{when}; give this run its own run_dir (one directory holds one run)")


def status_of(meta: dict[str, Any], *, last_step: int | None = None, last_time: float | None = None) -> RunStatus:
    """The run's status from its ``meta`` (and its last recorded step)."""
    status = meta.get("status")
    writer = meta.get("writer") or {}
    if status is None:
        return RunStatus("unknown", "written by a nantrace that did not record how runs end", last_step=last_step)
    if status != "running":
        return RunStatus(status, meta.get("end_reason"), meta.get("ended"), last_step)
    if alive(writer):
        return RunStatus("running", None, None, last_step)
    if writer.get("host") not in (None, socket.gethostname()):
        return RunStatus("unknown", f"still marked running by process {writer.get('pid')} on host {writer.get('host')}, "
                                    "which cannot be checked from here", None, last_step)
    return RunStatus("interrupted", f"its process (pid {writer.get('pid')}) ended without closing the run "
                                    "(killed, or the machine went down)", last_time, last_step)


def exit_ending() -> tuple[str, str]:
    """How this interpreter is ending, for writers still open at exit: after an uncaught
    exception Python has stored it in ``sys.last_value`` before the exit handlers run."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", "stopped with Ctrl-C (KeyboardInterrupt) before the guard was closed"
    if isinstance(exc, BaseException):
        return "failed", f"the process exited on an uncaught {type(exc).__name__}: {exc}"
    return "finished", "the process exited without closing the guard"


# ----------------------------------------------------------------------------- claiming
def claim(run_dir: Path, db_name: str) -> Path | None:
    """Make ``run_dir`` ready for a new writer of this process; return where an earlier run
    was moved (``None`` if none was). Raises ``ValueError`` when a live process writes it or
    its store cannot be read."""
    db = run_dir / db_name
    if not db.exists():
        return None
    meta = _read_meta(db)
    writer = meta.get("writer") or {}
    if writer.get("process") == PROCESS:
        return None
    if meta.get("status") == "running" and alive(writer):
        raise ValueError(busy_message(run_dir, writer))
    return _set_aside(run_dir, db, meta)


def _read_meta(db: Path) -> dict[str, Any]:
    try:
        conn = sqlite3.connect(db, timeout=10)
        try:
            rows = conn.execute("SELECT key, value FROM meta").fetchall()
        finally:
            conn.close()
        return {k: json.loads(v) for k, v in rows}
    except (sqlite3.Error, ValueError) as exc:
        raise ValueError(f"{str(db)!r} is not a readable nantrace run store ({exc}); move it away or choose "
                         "another run_dir") from None


def _set_aside(run_dir: Path, db: Path, meta: dict[str, Any]) -> Path:
    """Move the earlier run's files to ``run_dir/previous/<start time>/``, settled first:
    a dead writer's run marked ``interrupted``, bundle paths pointed at the new place, the
    WAL folded into the database."""
    created = meta.get("created")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(created if isinstance(created, (int, float)) else None))
    dest = run_dir / PREVIOUS / stamp
    n = 1
    while dest.exists():
        n += 1
        dest = run_dir / PREVIOUS / f"{stamp}-{n}"
    conn = sqlite3.connect(db, timeout=10, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        if meta.get("status") == "running":
            last = conn.execute("SELECT max(time) FROM steps").fetchone()
            status = status_of(meta, last_time=last[0] if last else None)
            _set(conn, "status", "interrupted")
            _set(conn, "ended", status.ended)
            _set(conn, "end_reason", status.reason)
        for incident_id, data in conn.execute("SELECT id, data FROM incidents").fetchall():
            record = json.loads(data)
            if record.get("bundle"):
                record["bundle"] = str(dest / "incidents" / Path(record["bundle"]).name)
                conn.execute("UPDATE incidents SET data=? WHERE id=?", (json.dumps(record), incident_id))
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    except sqlite3.Error as exc:
        raise ValueError(f"cannot set the earlier run in {str(run_dir)!r} aside ({exc}); move it away or choose "
                         "another run_dir") from None
    finally:
        conn.close()
    dest.mkdir(parents=True)
    for name in RUN_ENTRIES:
        if (run_dir / name).exists():
            os.replace(run_dir / name, dest / name)
    return dest


def _set(conn: sqlite3.Connection, key: str, value: Any) -> None:
    conn.execute("INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                 (key, json.dumps(value, default=str)))
