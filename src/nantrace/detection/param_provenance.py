"""Which parameters the step check must read: finiteness from where the values came from.

The step check used to take the norm of every parameter every step: a pass over the whole
model (as much memory traffic as the gradients' pass) to learn, almost always, that the
weights the last update wrote are still finite. But the guard already knows where those
values came from:

- the last check read them finite (their norm bounds every element), and
- since then only the optimizer's update wrote them, and that update was proven finite from
  the step's figures (:func:`~nantrace.response.update_bounds.param_bound_after` gives the
  bound of every element after it) or checked after it (:mod:`~nantrace.response.update_check`).

Anything else that writes a parameter between steps leaves a mark the guard reads without
touching the values: an in-place op bumps the tensor's version counter (``load_state_dict``,
a rollback, ``with torch.no_grad(): p.clamp_(...)``, ``nn.init``), a ``p.data = t``
assignment changes its storage.

A write through ``p.data`` leaves neither mark: ``.data`` hands out a fresh alias of the
storage with a version counter of its own. The step's code reaches ``.data`` through the
torch-function layer, where the step's tapes already sit (the prelude between steps, the loss
tape, the gradient tape: :mod:`nantrace.loss_tape`); a tape that sees ``.data`` taken of a
watched parameter tells its provenance (:func:`data_touched`, one dictionary lookup per
``.data``, nothing on a step that takes none), which keeps the alias and the alias's version.
At the next check an alias whose version moved was written (``p.data[32:] = x``,
``p.data.mul_(s)``, ``nn.init.normal_(p.data)``, ``torch.mul(a, b, out=p.data)``): its
parameter is marked like any other. An alias only read (an EMA, a norm logged) marks nothing; one
the code still holds is watched (weakly) at the checks that follow, until it is dropped. A
``p.data = t`` assignment marks its parameter too.

Parameters with a mark are measured at the next check (only those). The writes that leave no
mark: a fused kernel run outside the watched optimizer; a write through ``.data`` taken where no
tape saw it (``Config.localisation.record_loss_code=False``, a prelude that stopped recording
after ``PRELUDE_RESTARTS`` start-overs, the watched model's own forward, where no tape runs, an alias
taken before ``watch()`` or before the first step); an alias from ``.detach()`` is no such case (it
shares the parameter's version counter). Those are caught
as soon as they matter: a non-finite parameter makes the forward, the loss or the gradients
non-finite, and any trouble in the step has every parameter measured before the triage (the
incident is the same ``nonfinite_param`` as before); a parameter nothing reads is measured at the
next full check, every ``DetectionConfig.param_check_every`` steps, which also gives the run store
its parameter norm curve.

What is given up: a non-finite value written without a mark, where no step's figures show it
(a unit behind a saturated ``tanh``, a parameter nothing reads), is found at the next full read
rather than at the next step; the incident says since when the parameters were known finite
(``details["params_last_read"]``).

Not used (every parameter measured every step) where the carried bound cannot work: updates
not checked (``check_updates=False``), FSDP2 shards (their norms combine across ranks), L2
weight decay of SGD or Adam (the update reads every parameter into the optimizer state, which
an unread value must not reach: :func:`~nantrace.response.update_bounds.update_folds_params`),
``param_check_every=1``.

Usage (inside the step's decision)::

    which = provenance.plan()             # None: measure all; []: none; [i, ...]: those
    ...                                   # the step check, with watched.params[i] for i in which
    provenance.measured(which, norms, step=7)  # the read figures (finite, or the step is in trouble)
    ...                                   # the update, proven or checked
    provenance.updated(update_check.param_bound)
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Sequence

import torch

__all__ = ["ParamProvenance", "data_touched", "WATCHED_DATA"]

_VERSION = operator.attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr

ALIAS_LIMIT = 256
"""``.data`` aliases a provenance keeps between two checks before it settles them early (code that takes
``.data`` in a long loop between steps): at most this many, or two per watched parameter."""

WATCHED_DATA: "dict[int, list[tuple[weakref.ref[ParamProvenance], int]]]" = {}
"""``id`` of each parameter an enabled provenance watches -> (that provenance, the parameter's index in
it): what a tape looks a ``.data`` access up in (:func:`data_touched`). Empty when none is enabled, so
the tapes skip the lookup."""


def data_touched(tensor: torch.Tensor, alias: torch.Tensor | None) -> None:
    """``tensor.data`` was taken (``alias``: the tensor it handed out) or assigned (``alias`` None), seen by
    a tape (:mod:`nantrace.loss_tape`): when ``tensor`` is a watched parameter, its provenance learns of it
    (:meth:`ParamProvenance.note_data`). Anything else costs one dictionary lookup."""
    entries = WATCHED_DATA.get(id(tensor))
    if not entries:
        return
    for ref, index in entries:
        owner = ref()
        if owner is not None and index < len(owner.params) and owner.params[index] is tensor:
            owner.note_data(index, alias)


def _unwatch(ref: "weakref.ref[ParamProvenance]", ids: list[int]) -> None:
    """Drop a provenance's entries from :data:`WATCHED_DATA` (when it is freed)."""
    for key in ids:
        entries = [e for e in WATCHED_DATA.get(key, ()) if e[0] is not ref]
        if entries:
            WATCHED_DATA[key] = entries
        else:
            WATCHED_DATA.pop(key, None)


class ParamProvenance:
    """Tracks whether the watched parameters are known finite without reading them.

    ``every``: a full measurement at least every this many steps (1: every step, the tracker is
    off). ``usable``: the run allows a carried bound at all (see the module doc).
    """

    def __init__(self, params: Sequence[torch.Tensor], *, every: int, usable: bool) -> None:
        self.params = list(params)
        self.every = every
        self.enabled = usable and every > 1 and bool(self.params)
        self.bound: float | None = None
        """An upper bound of every parameter element (``None``: unknown, measure them all)."""
        self._versions: list[int] | None = None
        self._pointers: list[int] | None = None
        self._since_full = 0
        self.marked: list[int] | None = None
        """This step (after :meth:`plan`): the parameters written with a mark since they were last
        known finite (``None``: not known finite, nothing to compare with)."""
        self.last_read: int | None = None
        """The last step whose check read every parameter and found them finite."""
        self.full_steps = 0
        """Steps whose check read every parameter."""
        self.partial_steps = 0
        """Steps whose check read only the parameters written outside the optimizer (or none)."""
        self._aliases: list[tuple[int, torch.Tensor | weakref.ref[torch.Tensor], int]] = []
        """(parameter index, a ``.data`` alias of it, the alias's version when last looked at): taken since
        the last check (held), or still alive from before (weak)."""
        self._written: set[int] = set()
        """Parameters written through ``.data`` (an alias's version moved, or ``.data`` assigned) since the
        last check."""
        if self.enabled:
            self._watch_data()

    def _watch_data(self) -> None:
        """Enter the parameters in :data:`WATCHED_DATA` (left when this provenance is freed)."""
        ref = weakref.ref(self)
        ids = [id(p) for p in self.params]
        for i, key in enumerate(ids):
            WATCHED_DATA.setdefault(key, []).append((ref, i))
        weakref.finalize(self, _unwatch, ref, ids)

    # ------------------------------------------------------------ between checks
    def note_data(self, index: int, alias: torch.Tensor | None) -> None:
        """``.data`` of parameter ``index`` was taken (``alias``) or assigned (``None``). A taken alias is
        kept with its version: only a write into it marks the parameter (:meth:`_settle_aliases`)."""
        if alias is None:
            self._written.add(index)
            return
        self._aliases.append((index, alias, _VERSION(alias)))
        if len(self._aliases) > max(ALIAS_LIMIT, 2 * len(self.params)):
            self._settle_aliases(newest_only=True)

    def _settle_aliases(self, *, newest_only: bool = False) -> None:
        """Move the parameters of the aliases written since they were taken (or last looked at) into
        :attr:`_written`; keep the live aliases weakly, to look at again at the next check (a dropped
        temporary dies with its last reference). ``newest_only`` (too many aliases taken before one
        check): of those not written, keep only the newest of each parameter, held."""
        kept: dict[int, tuple[int, torch.Tensor | weakref.ref[torch.Tensor], int]] = {}
        later: list[tuple[int, torch.Tensor | weakref.ref[torch.Tensor], int]] = []
        for index, held, version in self._aliases:
            alias = held() if isinstance(held, weakref.ref) else held
            if alias is None:
                continue
            now = _VERSION(alias)
            if now != version:
                self._written.add(index)
            if newest_only:
                kept[index] = (index, alias, now)
            else:
                later.append((index, weakref.ref(alias), now))
        self._aliases = list(kept.values()) if newest_only else later

    def _data_written(self) -> set[int]:
        """The parameters written through ``.data`` since the last check (and forget them)."""
        if self._aliases:
            self._settle_aliases()
        written, self._written = self._written, set()
        return written

    # ------------------------------------------------------------ before the check
    def plan(self) -> list[int] | None:
        """The indices of the parameters this step's check must read: ``None`` for all of them,
        ``[]`` for none (every one known finite), else those written since they were last known.
        Sets :attr:`marked` either way."""
        self.marked = None
        written = self._data_written() if self._written or self._aliases else ()
        if not self.enabled or self.bound is None or self._versions is None:
            return None
        versions = list(map(_VERSION, self.params))
        pointers = list(map(_DATA_PTR, self.params))
        if versions == self._versions and pointers == self._pointers:
            self.marked = []
        else:
            self.marked = [i for i, (v, w, p, q) in enumerate(zip(versions, self._versions, pointers, self._pointers))
                           if v != w or p != q]
        if written:
            self.marked = sorted(set(self.marked).union(written))
        return None if self._since_full + 1 >= self.every else self.marked

    # ------------------------------------------------------------ after the read
    def measured(self, which: list[int] | None, norms: Sequence[float], *, step: int) -> None:
        """What the check read of the parameters ``which`` (``None``: all, ``norms`` then holds every
        parameter's norm): finite ones become known (their norm bounds their elements); any
        non-finite one, or a full read that found trouble, leaves the parameters unknown."""
        if not self.enabled:
            return
        finite = all(map(math.isfinite, norms))
        if which is None:
            self.full_steps += 1
            self._since_full = 0
            self.bound = max(norms, default=0.0) if finite and len(norms) == len(self.params) else None
            if self.bound is not None:
                self.last_read = step
        else:
            self.partial_steps += 1
            self._since_full += 1
            if not which:
                return  # nothing was written since: what plan() compared with still holds
            if self.bound is not None:
                self.bound = max([self.bound, *norms]) if finite else None
        self._remember()

    def forget(self) -> None:
        """Something wrote the parameters that no bound covers (an unchecked update, an update the
        device decided, an undone one): the next check reads them all."""
        self.bound = None
        self._versions = self._pointers = None

    # ------------------------------------------------------------ after the update
    def updated(self, bound: float | None) -> None:
        """The optimizer's update has landed; ``bound`` bounds every parameter element after it
        (``UpdateCheck.param_bound``; ``None``: not known, the next check reads them all)."""
        if not self.enabled:
            return
        if bound is None or not math.isfinite(bound):
            self.forget()
            return
        self.bound = bound
        self._remember()

    def _remember(self) -> None:
        if self.bound is None:
            self._versions = self._pointers = None
            return
        self._versions = list(map(_VERSION, self.params))
        self._pointers = list(map(_DATA_PTR, self.params))
