"""The parts every settings group of :class:`nantrace.Config` shares: the base class that names a
misplaced or unknown field, and the validators that name the option, the bad value and what was
expected (``Config.detection.spike_window must be an integer >= 24, got 2``).

Each group is defined, documented and validated next to the code that reads it
(``detection/settings.py``, ``response/settings.py``, ...); ``config.py`` composes them.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, ClassVar

__all__ = ["SettingsGroup", "check_bools", "check_int", "check_number", "field_group", "group_classes"]

_GROUPS: dict[str, type["SettingsGroup"]] = {}


class SettingsGroup:
    """Base of one group of settings (a ``@dataclass(kw_only=True, slots=True)``).

    ``group`` is the attribute of :class:`nantrace.Config` that holds it. A keyword that is not a
    field of this group raises a ``TypeError`` that says which group it belongs to, or which
    fields exist.
    """

    __slots__ = ()
    group: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.group:
            _GROUPS[cls.group] = cls  # the slots dataclass made from it replaces it here

    def __new__(cls, *args: Any, **kwargs: Any) -> "SettingsGroup":
        if args:
            raise TypeError(f"Config.{cls.group} takes keyword arguments only, e.g. {cls.__name__}(name=value)")
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        for name in kwargs:
            if name not in names:
                raise TypeError(unknown_field_message(name, where=f"Config.{cls.group}"))
        return super().__new__(cls)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]


def group_classes() -> dict[str, type[SettingsGroup]]:
    """Every settings group by its ``Config`` attribute name (after the group modules are imported)."""
    return dict(_GROUPS)


def field_group(name: str) -> str | None:
    """The group a field belongs to (``"spike_sigma"`` -> ``"detection"``), or ``None``."""
    for group, cls in _GROUPS.items():
        if name in {f.name for f in dataclasses.fields(cls)}:  # type: ignore[arg-type]
            return group
    return None


def unknown_field_message(name: str, *, where: str) -> str:
    """Say where ``name`` belongs, or that it does not exist and what is close to it."""
    home = field_group(name)
    if home is not None:
        return (f"{where} has no field {name!r}: it belongs to Config.{home} "
                f"(nantrace.Config({home}={_GROUPS[home].__name__}({name}=...)))")
    every = sorted(f.name for cls in _GROUPS.values() for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    close = difflib.get_close_matches(name, every + list(_GROUPS), n=3)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    return f"{where} has no field {name!r}{hint} (groups: {', '.join(_GROUPS)}; see docs/api.md)"


def check_int(group: SettingsGroup, name: str, *, minimum: int) -> None:
    value = getattr(group, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"Config.{group.group}.{name} must be an integer >= {minimum}, got {value!r}")


def check_number(group: SettingsGroup, name: str, *, low: float, high: float | None = None,
                 low_inclusive: bool = True, high_inclusive: bool = False, expected: str) -> None:
    value = getattr(group, name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = (value >= low if low_inclusive else value > low) and (
            high is None or (value <= high if high_inclusive else value < high))
    if not ok:
        raise ValueError(f"Config.{group.group}.{name} must be {expected}, got {value!r}")


def check_bools(group: SettingsGroup) -> None:
    """Every field annotated ``bool`` holds a bool (``1`` or ``"yes"`` is a mistake, not a truth value)."""
    for f in dataclasses.fields(group):  # type: ignore[arg-type]
        if f.type in ("bool", bool) and not isinstance(getattr(group, f.name), bool):
            raise TypeError(f"Config.{group.group}.{f.name} must be a bool, got {getattr(group, f.name)!r}")
