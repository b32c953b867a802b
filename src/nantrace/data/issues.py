"""Shared result types of the data layer: one finding (`DataIssue`), the error raised on it.

Every check in `nantrace.data` reports what it found as `DataIssue` objects so that the
collate wrapper, the guard and the run log can treat them alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..taxonomy import BATCH_CAUSES, MASK_CAUSES

__all__ = [
    "BATCH_CAUSES",
    "MASK_CAUSES",
    "DataIssue",
    "DataValidationError",
    "IssueReport",
    "jsonable",
]



def jsonable(value: Any) -> Any:
    """Return `value` as plain JSON data: non-finite floats become strings, keys strings."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [jsonable(v) for v in items]
    if hasattr(value, "tolist"):  # numpy / torch scalars and arrays
        return jsonable(value.tolist())
    if hasattr(value, "to_dict"):
        return jsonable(value.to_dict())
    return str(value)


@dataclass
class DataIssue:
    """One problem found in the data, with where it is, what was seen and how to fix it.

    `cause` is a code (see `BATCH_CAUSES`, `MASK_CAUSES` and the sampler/seed causes);
    `path` locates the tensor inside the batch (``batch["pixel_values"]``, ``batch[1]``);
    `sample_indices` are positions along dim 0 (empty when the issue concerns the batch
    as a whole); `summary` is one sentence with the values seen; `fix` a recommendation.
    """

    cause: str
    path: str
    sample_indices: list[int]
    summary: str
    fix: str
    details: dict[str, Any] = field(default_factory=dict)
    severity: str = "error"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (non-finite floats are written as strings)."""
        return {
            "cause": self.cause,
            "path": self.path,
            "sample_indices": [int(i) for i in self.sample_indices],
            "summary": self.summary,
            "fix": self.fix,
            "details": jsonable(self.details),
            "severity": self.severity,
        }

    def __str__(self) -> str:
        return f"[{self.cause}] {self.summary} Fix: {self.fix}"


@dataclass
class IssueReport:
    """Base of the reports that hold a list of `DataIssue` (`ok` when the list is empty)."""

    issues: list[DataIssue] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing was found."""
        return not self.issues

    @property
    def causes(self) -> list[str]:
        """The cause of each issue, in order."""
        return [issue.cause for issue in self.issues]

    def by_cause(self, cause: str) -> list[DataIssue]:
        """The issues with this cause."""
        return [issue for issue in self.issues if issue.cause == cause]

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return {"ok": self.ok, "issues": [issue.to_dict() for issue in self.issues]}

    def __str__(self) -> str:
        if self.ok:
            return f"{type(self).__name__}: no issue found"
        lines = [f"{type(self).__name__}: {len(self.issues)} issue(s)"]
        lines += [f"  - {issue}" for issue in self.issues]
        return "\n".join(lines)


class DataValidationError(ValueError):
    """A batch failed validation under ``policy="raise"`` (or could not be repaired).

    `issues` holds the `DataIssue` objects; when the error crossed a DataLoader worker
    boundary only the message survives (PyTorch re-creates the exception from its text).
    """

    def __init__(self, msg: str = "", issues: list[DataIssue] | None = None) -> None:
        super().__init__(msg)
        self.issues: list[DataIssue] = list(issues or [])
