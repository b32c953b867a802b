"""Layers: the watched parameter tensors grouped by the module that owns them.

``encoder.layers.0.attn.qkv.weight`` and ``...qkv.bias`` form the layer
``encoder.layers.0.attn.qkv``; a parameter of the root module forms the layer ``""``.
Per-layer norms are combined from per-tensor norms on the host (``sqrt(sum of squares)``),
so they come free with the sentinel's figures.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["LayerIndex", "layer_of_name"]


def layer_of_name(param_name: str) -> str:
    """The dotted path of the module that owns the parameter called ``param_name``."""
    return param_name.rpartition(".")[0]


class LayerIndex:
    """Which layer each watched tensor belongs to, layers in order of first appearance.

    Usage::

        index = LayerIndex(["body.0.weight", "body.0.bias", "head.weight"])
        index.names                      # ['body.0', 'head']
        index.combine([3.0, 4.0, 1.0])   # array([5., 1.]) : per-layer L2 norms
    """

    def __init__(self, param_names: Sequence[str]) -> None:
        names: list[str] = []
        position: dict[str, int] = {}
        layer_of: list[int] = []
        for name in param_names:
            layer = layer_of_name(name)
            if layer not in position:
                position[layer] = len(names)
                names.append(layer)
            layer_of.append(position[layer])
        self.names = names
        """Layer names (module paths), the row labels of ``layer_stats``."""
        self.layer_of = np.asarray(layer_of, dtype=np.int64)
        """Layer index of each watched tensor."""
        self.numel: np.ndarray = np.zeros(len(names), dtype=np.int64)
        """Number of elements in each layer (set by :meth:`set_numel`)."""
        self._empty_all = np.bincount(self.layer_of, minlength=len(names)) == 0
        self._order: np.ndarray | None = None
        self._starts = np.zeros(0, dtype=np.int64)
        """Layers without any tensor (none, unless built oddly): the per-step figures of all
        tensors reuse it instead of counting again."""

    def __len__(self) -> int:
        return len(self.names)

    def set_numel(self, numels: Sequence[int]) -> None:
        """Record each tensor's element count, to weigh per-layer fractions."""
        self.numel = np.bincount(self.layer_of, weights=np.asarray(numels, dtype=np.float64),
                                 minlength=len(self)).astype(np.int64)

    def combine(self, norms: Sequence[float], which: Sequence[int] | None = None) -> np.ndarray:
        """Per-layer L2 norms from per-tensor L2 norms.

        ``which`` gives the tensor index of each entry of ``norms`` (default: all tensors, in
        order). A layer without any entry is NaN (see :meth:`present`); a non-finite tensor
        norm makes its layer's norm non-finite (never hidden).
        """
        values = np.asarray(norms, dtype=np.float64)
        if which is not None and len(which) == len(self.layer_of):
            which = None  # ``which`` lists distinct tensor indices: as many as there are tensors means all of them
        idx = self.layer_of if which is None else self.layer_of[np.asarray(which, dtype=np.int64)]
        if len(values) != len(idx):
            raise ValueError(f"LayerIndex.combine: {len(values)} norms for {len(idx)} tensors")
        with np.errstate(over="ignore", invalid="ignore"):
            sq = np.bincount(idx, weights=values * values, minlength=len(self))
            out = np.sqrt(sq)
        empty = self._empty_all if which is None else np.bincount(idx, minlength=len(self)) == 0
        if empty.any():
            out[empty] = np.nan
        return out

    def combine_rows(self, norms: np.ndarray) -> np.ndarray:
        """:meth:`combine` of every tensor, for many steps at once: ``norms`` is (steps × tensors),
        the result (steps × layers), one reduction for all rows (a non-finite norm stays in its layer)."""
        if self._order is None:
            self._order = np.argsort(self.layer_of, kind="stable")
            self._starts = np.flatnonzero(np.r_[True, np.diff(self.layer_of[self._order]) != 0])
        values = np.asarray(norms, dtype=np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            sq = np.add.reduceat((values * values)[:, self._order], self._starts, axis=1)
            out = np.full((values.shape[0], len(self)), np.nan)
            out[:, ~self._empty_all] = np.sqrt(sq)
        return out

    def present(self, which: Sequence[int] | None = None) -> np.ndarray:
        """Boolean mask of the layers that have at least one of the tensors ``which``."""
        if which is None or len(which) == len(self.layer_of):
            return ~self._empty_all
        idx = self.layer_of[np.asarray(which, dtype=np.int64)]
        return np.bincount(idx, minlength=len(self)) > 0

    def sum(self, values: Sequence[float], which: Sequence[int] | None = None) -> np.ndarray:
        """Per-layer sums of per-tensor figures (counts)."""
        idx = self.layer_of if which is None else self.layer_of[np.asarray(which, dtype=np.int64)]
        return np.bincount(idx, weights=np.asarray(values, dtype=np.float64), minlength=len(self))

    def minimum(self, values: Sequence[float], which: Sequence[int] | None = None) -> np.ndarray:
        """Per-layer minima of per-tensor figures (NaN for a layer without entries)."""
        idx = self.layer_of if which is None else self.layer_of[np.asarray(which, dtype=np.int64)]
        out = np.full(len(self), np.inf)
        np.minimum.at(out, idx, np.asarray(values, dtype=np.float64))
        out[np.bincount(idx, minlength=len(self)) == 0] = np.nan
        return out

