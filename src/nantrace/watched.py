"""What a guard watches, as a small read-only view for the components that serve it.

Monitors, the bundle writer, the TensorBoard writer and the localiser need to know the model,
the optimizer, the parameters and their names, the run directory, the store, the config and
the current step. They receive a :class:`Watched`, never the :class:`~nantrace.guard.Guard`
itself, so none of them can reach (or come to depend on) the guard's private state.

Usage::

    class MyMonitor(nantrace.dynamics.Monitor):
        def attach(self, watched):
            self.names = watched.param_names      # read-only
        def on_step(self, ctx):
            ...
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .config import Config
    from .storage.runstore import RunStore

__all__ = ["GuardState", "Watched"]


class GuardState:
    """The few figures of a guard that change as it runs: the step, whether it is closed, and
    whether a replay of the step is running (then the capture hooks ignore the replay's own calls).
    Owned and advanced by the guard; the view reads it."""

    __slots__ = ("closed", "replaying", "step", "unscaled")

    def __init__(self) -> None:
        self.step = 0
        self.closed = False
        self.replaying = False
        self.unscaled = False


@dataclasses.dataclass(frozen=True, eq=False)
class Watched:
    """A read-only view of what one guard watches."""

    model: nn.Module
    """The model as given to ``watch`` (perhaps a DDP / ``torch.compile`` wrapper)."""
    root: nn.Module
    """The user's own module inside any wrapper: module paths are relative to it."""
    optimizer: torch.optim.Optimizer | None
    scaler: Any
    params: Sequence[torch.Tensor]
    """The trainable parameters the optimizer steps, in a fixed order (the per-tensor figures use it)."""
    param_names: Sequence[str]
    """Their names, as in ``root.named_parameters()``."""
    run_dir: str | None
    store: "RunStore | None"
    config: "Config"
    policy: str
    rank: int
    world_size: int
    sharded: bool
    """Parameters are DTensor shards (FSDP2)."""
    _state: GuardState = dataclasses.field(repr=False)

    @property
    def step(self) -> int:
        """The step now in progress (the index of the coming ``optimizer.step()``)."""
        return self._state.step

    @property
    def closed(self) -> bool:
        return self._state.closed

    @property
    def replaying(self) -> bool:
        """A replay of the step is running (its forwards and losses are not the user's)."""
        return self._state.replaying

    @property
    def unscaled(self) -> bool:
        """This step's gradients were unscaled (``scaler.unscale_(optimizer)``): no longer multiplied by the scale."""
        return self._state.unscaled

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Mark the guard as replaying while the block runs (the one change a component may make)."""
        before = self._state.replaying
        self._state.replaying = True
        try:
            yield
        finally:
            self._state.replaying = before
