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
assignment changes its storage. Parameters with such a mark are measured at the next check
(only those). The two writes that leave no mark, an in-place op through ``p.data`` and a
fused kernel run outside the watched optimizer, are caught as soon as they matter: a
non-finite parameter makes the forward, the loss or the gradients non-finite, and any
trouble in the step has every parameter measured before the triage (the incident is the same
``nonfinite_param`` as before); a parameter nothing reads is measured at the next full check,
every ``DetectionConfig.param_check_every`` steps, which also gives the run store its
parameter norm curve.

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
from collections.abc import Sequence

import torch

__all__ = ["ParamProvenance"]

_VERSION = operator.attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr


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

    # ------------------------------------------------------------ before the check
    def plan(self) -> list[int] | None:
        """The indices of the parameters this step's check must read: ``None`` for all of them,
        ``[]`` for none (every one known finite), else those written since they were last known.
        Sets :attr:`marked` either way."""
        self.marked = None
        if not self.enabled or self.bound is None or self._versions is None:
            return None
        versions = list(map(_VERSION, self.params))
        pointers = list(map(_DATA_PTR, self.params))
        if versions == self._versions and pointers == self._pointers:
            self.marked = []
        else:
            self.marked = [i for i, (v, w, p, q) in enumerate(zip(versions, self._versions, pointers, self._pointers))
                           if v != w or p != q]
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
