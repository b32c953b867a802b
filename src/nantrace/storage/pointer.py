"""Bundle pointers: what a rank writes instead of a full bundle when another rank holds it.

Under data parallelism with ``Config.outputs.bundle_ranks="origin"`` (the default above 8 ranks,
see :mod:`nantrace.storage.bundle_policy`) a rank that only received the non-finite values writes,
where its bundle would be, ``run_dir/incidents/<step>-<kind>-<id>/pointer.json``: a few hundred
bytes naming the step, the kind, the rank(s) that hold the full bundle and the path to their
``incidents`` directory relative to the pointer's own directory (``../../rank1/incidents``;
rank 0 writes to ``run_dir``, rank *r* to ``run_dir/rank{r}``), and this rank's own figures.

The holder's bundle directory name carries that rank's own incident id, which no other rank
knows without one more collective; the pointer names the step prefix (``step000003-``) instead,
and :func:`find_target` picks the holder's bundle of that step.

Usage::

    pointer = load_pointer("runs/exp/incidents/step000003-nonfinite_grad-1a2b3c4d5e6f")
    found = find_target(pointer)      # (1, Path(".../rank1/incidents/step000003-nonfinite_input-...")) or None
    print(missing_message(pointer))   # when it is None: where the bundle should be, in one line
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..incident import Incident

if TYPE_CHECKING:
    from ..watched import Watched

__all__ = ["POINTER_FILE", "POINTER_VERSION", "BundlePointer", "find_target", "is_pointer", "load_pointer",
           "missing_message", "pointer_note", "rank_run_dir", "write_pointer"]

POINTER_FILE = "pointer.json"
POINTER_VERSION = 1
VERSION_KEY = "nantrace_bundle_pointer"
"""The key holding the format version: also what marks a JSON file as a pointer."""
FIELDS = ("step", "kind", "cause", "action", "incident_id", "writer_rank", "world_size", "origin_ranks", "holders",
          "summary")
"""The fields every pointer of format 1 holds (``figures`` and ``bundle_prefix`` are informative)."""


@dataclasses.dataclass
class BundlePointer:
    """One rank's record that another rank holds the full bundle of an incident step."""

    step: int
    kind: str
    cause: str
    action: str
    incident_id: str
    writer_rank: int
    world_size: int
    holders: dict[int, str]
    """Rank → its ``incidents`` directory, relative to the pointer's directory (lowest rank first)."""
    origin_ranks: list[int]
    """The ranks whose own data or gradients were non-finite (empty: none was; rank 0 holds the bundle)."""
    summary: str
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    """This rank's own figures of the step (loss, gradient norm, loss scale, non-finite counts)."""
    version: int = POINTER_VERSION
    path: Path | None = dataclasses.field(default=None, compare=False)
    """The pointer's directory (where it was read from or written); not stored, not compared."""

    @property
    def prefix(self) -> str:
        """The name prefix of the holder's bundle directory of this step (``step000003-``)."""
        return f"step{self.step:06d}-"

    def to_dict(self) -> dict[str, Any]:
        return {VERSION_KEY: self.version, "step": self.step, "kind": self.kind, "cause": self.cause,
                "action": self.action, "incident_id": self.incident_id, "writer_rank": self.writer_rank,
                "world_size": self.world_size, "origin_ranks": list(self.origin_ranks),
                "holders": [{"rank": r, "incidents": rel} for r, rel in self.holders.items()],
                "bundle_prefix": self.prefix, "summary": self.summary, "figures": self.figures}

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "pointer") -> "BundlePointer":
        """Parse the JSON of a pointer; anything malformed raises ``ValueError`` naming what."""
        if not isinstance(data, dict) or VERSION_KEY not in data:
            raise ValueError(f"{where} is not a nantrace bundle pointer (no {VERSION_KEY!r} field)")
        version = data[VERSION_KEY]
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ValueError(f"{where} has no valid pointer format version (found {version!r})")
        if version > POINTER_VERSION:
            raise ValueError(f"{where} was written in pointer format {version}; this nantrace reads formats "
                             f"1..{POINTER_VERSION}: upgrade nantrace to follow it")
        missing = [k for k in FIELDS if k not in data]
        if missing:
            raise ValueError(f"{where} is not a valid nantrace bundle pointer: missing {', '.join(missing)}")
        try:
            holders = {int(h["rank"]): str(h["incidents"]) for h in data["holders"]}
            pointer = cls(step=int(data["step"]), kind=str(data["kind"]), cause=str(data["cause"]),
                          action=str(data["action"]), incident_id=str(data["incident_id"]),
                          writer_rank=int(data["writer_rank"]), world_size=int(data["world_size"]), holders=holders,
                          origin_ranks=[int(r) for r in data["origin_ranks"]], summary=str(data["summary"]),
                          figures=dict(data.get("figures") or {}), version=version)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where} is not a valid nantrace bundle pointer: {type(exc).__name__}: {exc}") from None
        if not holders:
            raise ValueError(f"{where} is not a valid nantrace bundle pointer: it names no rank holding the bundle")
        return pointer


def rank_run_dir(root: Path, rank: int) -> Path:
    """Where rank ``rank`` of a job writes, given the job's ``run_dir``: itself for rank 0, ``rank{r}`` below it."""
    return root if rank == 0 else root / f"rank{rank}"


def job_run_dir(own_run_dir: Path, rank: int) -> Path:
    """The job's ``run_dir`` seen from one rank's own run directory (inverse of :func:`rank_run_dir`)."""
    return own_run_dir if rank == 0 else own_run_dir.parent


def own_figures(incident: Incident) -> dict[str, Any]:
    """This rank's figures of the step, small: the loss, gradient norm and loss scale, and how many
    gradients, parameters and inputs were non-finite here."""
    d = incident.details
    figures: dict[str, Any] = {}
    for key in ("loss", "grad_norm", "loss_scale"):
        value = d.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            figures[key] = value if math.isfinite(value) else str(value)
    for key in ("nonfinite_grads", "nonfinite_params", "nonfinite_inputs"):
        if isinstance(d.get(key), list):
            figures[key] = len(d[key])
    return figures


def write_pointer(watched: "Watched", incident: Incident, holders: list[int]) -> str:
    """Write ``run_dir/incidents/<name>-<id>/pointer.json`` atomically; set ``incident.bundle`` to its
    directory and ``incident.details["bundle_pointer"]`` (kept in the run store) to whom it names."""
    assert watched.run_dir is not None
    own = Path(watched.run_dir)
    root = own / "incidents"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{incident.name}-{incident.id}"
    job = job_run_dir(own, watched.rank)
    rel = {h: os.path.relpath(rank_run_dir(job, h) / "incidents", final) for h in holders}
    origins = incident.details.get("origin_ranks")
    pointer = BundlePointer(step=incident.step, kind=incident.kind, cause=str(incident.cause), action=str(incident.action),
                            incident_id=incident.id, writer_rank=watched.rank, world_size=watched.world_size,
                            holders=rel, origin_ranks=list(origins) if isinstance(origins, list) else [],
                            summary=incident.summary, figures=own_figures(incident), path=final)
    tmp = root / f".tmp-{incident.id}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        (tmp / POINTER_FILE).write_text(json.dumps(pointer.to_dict(), indent=1))
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    incident.bundle = str(final)
    incident.details["bundle_pointer"] = {"holder_ranks": list(rel), "incidents": {str(h): p for h, p in rel.items()},
                                          "bundle_prefix": pointer.prefix}
    return str(final)


def pointer_note(details: dict[str, Any]) -> str | None:
    """How an incident whose bundle is a pointer says so (console, report): ``None`` for a full bundle."""
    info = details.get("bundle_pointer")
    if not isinstance(info, dict) or not info.get("holder_ranks"):
        return None
    ranks = ", ".join(str(r) for r in info["holder_ranks"])
    return f"a pointer: rank {ranks} holds the full bundle; nantrace replay follows it"


def is_pointer(path: str | os.PathLike[str]) -> bool:
    """A pointer directory (holding ``pointer.json``) or the ``pointer.json`` file itself."""
    p = Path(path)
    return (p.is_dir() and (p / POINTER_FILE).is_file()) or (p.is_file() and p.name == POINTER_FILE)


def load_pointer(path: str | os.PathLike[str]) -> BundlePointer:
    """Read a pointer (its directory or its ``pointer.json``); a bad one raises ``ValueError`` saying why."""
    p = Path(path)
    file = p / POINTER_FILE if p.is_dir() else p
    if not file.is_file():
        raise ValueError(f"{str(p)!r} holds no {POINTER_FILE}: not a nantrace bundle pointer")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{str(file)!r} is corrupt or unreadable (truncated or not written by nantrace): "
                         f"{type(exc).__name__}: {exc}") from None
    pointer = BundlePointer.from_dict(data, where=repr(str(file)))
    pointer.path = file.parent
    return pointer


def find_target(pointer: BundlePointer) -> tuple[int, Path] | None:
    """The first holder rank (lowest first) whose full bundle of the step is on this filesystem."""
    assert pointer.path is not None
    for rank, rel in pointer.holders.items():
        incidents = Path(os.path.normpath(pointer.path / rel))
        if not incidents.is_dir():
            continue
        for candidate in sorted(incidents.glob(f"{pointer.prefix}*")):
            if candidate.is_dir() and (candidate / "env.json").is_file() and not (candidate / POINTER_FILE).exists():
                if _env_step(candidate) in (pointer.step, None):
                    return rank, candidate
    return None


def missing_message(pointer: BundlePointer) -> str:
    """One line: which rank holds the full bundle, where it was looked for, what to do."""
    assert pointer.path is not None
    where = "; ".join(f"rank {r}: {os.path.normpath(pointer.path / rel)}{os.sep}{pointer.prefix}*"
                      for r, rel in pointer.holders.items())
    ranks = ", ".join(str(r) for r in pointer.holders)
    return (f"{str(pointer.path)!r} is a pointer written by rank {pointer.writer_rank} for step {pointer.step} "
            f"({pointer.kind}): the full bundle is held by rank {ranks} and is not on this filesystem ({where}); "
            f"replay it where that rank's run directory is, or copy its incidents directory there (if it is not "
            f"there either, that rank wrote none for this step: past Config.outputs.max_bundles, or a repeat of "
            f"its episode's incident)")


def _env_step(bundle: Path) -> int | None:
    try:
        step = json.loads((bundle / "env.json").read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None
