"""The incident record: what went wrong, where, why, and what nantrace did about it.

Every field is plain data so that an incident can be printed, stored in the run store,
written to a bundle and compared in tests without holding any tensor alive.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

from .taxonomy import ACTIONS, CAUSES, KINDS, PHASES, Action, Cause, Kind, Phase

__all__ = ["ACTIONS", "CAUSES", "KINDS", "PHASES", "Incident"]


@dataclasses.dataclass
class Incident:
    """One numerical failure, as defined in the public contract (API.md).

    The first thirteen fields are the contract; ``id``, ``time``, ``chain``,
    ``input_stats``, ``details`` and ``history`` carry the evidence behind the diagnosis.
    """

    step: int
    kind: Kind
    phase: Phase | None
    op: str | None
    module: str | None
    source: str | None
    rank: int
    cause: Cause
    summary: str
    fix: str
    action: Action | str
    transient: bool | None = None
    bundle: str | None = None
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:12])
    time: float = dataclasses.field(default_factory=time.time)
    chain: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    input_stats: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind
        assert self.cause in CAUSES, self.cause
        assert self.phase is None or self.phase in PHASES, self.phase
        assert self.action in ACTIONS, self.action

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy (non-finite floats become the strings "nan"/"inf")."""
        return _jsonable(dataclasses.asdict(self))

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Incident":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: _from_jsonable(v) for k, v in data.items() if k in names})

    @property
    def name(self) -> str:
        """A short directory-safe label, e.g. ``step000812-nonfinite_loss``."""
        return f"step{self.step:06d}-{self.kind}"


_NONFINITE_TEXT = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _from_jsonable(value: Any) -> Any:
    """Undo :func:`_jsonable` for numbers: the strings "nan", "inf", "-inf" become floats again."""
    if isinstance(value, str):
        return _NONFINITE_TEXT.get(value, value)
    if isinstance(value, dict):
        return {k: _from_jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_jsonable(v) for v in value]
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, str):
        return str(value)  # an Action is stored as its plain value
    if isinstance(value, (int, bool)) or value is None:
        return value
    return str(value)
