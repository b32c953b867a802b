"""What a fused attention op's mask operand says: which query rows it leaves without any key.

The slow path of attention is a softmax over masked scores, where a fully masked row is plain to see (a row of
``-inf`` scores). The fused ops take the mask as an operand of their own and do the softmax inside
(``_native_multi_head_attention`` and ``_transformer_encoder_layer_fwd``, the fast paths of ``nn.MultiheadAttention``
and ``nn.TransformerEncoderLayer`` in inference; ``_masked_softmax``; the ``scaled_dot_product_attention``
kernels), so the rows a mask hides completely must be read from that operand, with the op's own conventions:
where the mask is, how its shape maps onto the query rows (``mask_type``), and what a boolean ``True`` means.
The tracer reads it to take a ``-inf`` mask from outside for intentional (:func:`mask_position`); the cause rules
to call NaN rows ``masked_softmax_all`` (:func:`masked_rows`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class MaskOperand:
    """Where a fused attention op reads its mask, and how."""

    name: str
    """The mask's argument name in the op's schema."""
    true_hides: bool
    """A boolean mask's ``True`` hides a key (``nn.MultiheadAttention``'s convention); else it lets the query
    attend to it (``scaled_dot_product_attention``'s). A floating mask is additive: ``-inf`` hides."""
    layout: str
    """``"heads"``: the output is ``(B, L, E)`` and the mask's shape follows ``mask_type`` (0: ``(L, S)``,
    1: key padding ``(B, S)``, 2: ``(B, H, L, S)``); ``"rows"``: the output is ``(..., L, E)`` and the mask
    broadcasts to ``(..., L, S)``; ``"scores"``: the output is the softmax of the scores (``args[0]``) along
    ``dim``, the mask shaped by ``mask_type`` (0: ``(L, S)``, 1: ``(B, S)``, 2 or none: the scores' shape)."""


FUSED_ATTENTION: dict[str, MaskOperand] = {
    "_native_multi_head_attention": MaskOperand("mask", True, "heads"),
    "_transformer_encoder_layer_fwd": MaskOperand("mask", True, "heads"),
    "_masked_softmax": MaskOperand("mask", True, "scores"),
    "scaled_dot_product_attention": MaskOperand("attn_mask", False, "rows"),
    "_scaled_dot_product_attention_math": MaskOperand("attn_mask", False, "rows"),
    "_scaled_dot_product_flash_attention_for_cpu": MaskOperand("attn_mask", False, "rows"),
    "_scaled_dot_product_efficient_attention": MaskOperand("attn_bias", False, "rows"),
    "_scaled_dot_product_cudnn_attention": MaskOperand("attn_bias", False, "rows"),
    "_scaled_dot_product_fused_attention_overrideable": MaskOperand("attn_bias", False, "rows"),
}
"""The fused attention ops (by their schema's short name) and their mask operand."""


def short_name(func: Any) -> str:
    """``_native_multi_head_attention`` for ``aten._native_multi_head_attention.default``."""
    return func._schema.name.split("::")[-1]


def _argument(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> tuple[str | None, Any]:
    """(position label as the tracer names it, value) of the schema argument ``name``; ``(None, None)`` if absent."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name != name:
            continue
        if not arg.kwarg_only and i < len(args):
            return f"arg{i}", args[i]
        return (name, kwargs[name]) if name in kwargs else (None, None)
    return None, None


def mask_position(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The position label (``arg9``, ``attn_mask``) of a fused attention op's mask operand, else ``None``."""
    operand = FUSED_ATTENTION.get(short_name(func))
    if operand is None:
        return None
    position, value = _argument(func, args, kwargs, operand.name)
    return position if isinstance(value, torch.Tensor) else None


def _hidden(mask: torch.Tensor, true_hides: bool) -> torch.Tensor:
    """``True`` where the mask hides a key from a query."""
    mask = mask.detach()
    if mask.dtype == torch.bool:
        return mask if true_hides else ~mask
    return torch.isneginf(mask) if mask.is_floating_point() else (mask != 0) == true_hides


def _int_argument(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> int | None:
    """An optional integer argument (``mask_type``, ``dim``) of the op, ``None`` when not given."""
    _, value = _argument(func, args, kwargs, name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _heads_rows(hidden: torch.Tensor, mask_type: int | None, bad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(bad rows, hidden rows) as ``(B, L)`` for an op whose output is ``(B, L, E)`` (or its weights, ``(B, L, S)``
    or ``(B, H, L, S)``): a query row is hidden when, in some head, its mask row hides every key."""
    if bad.dim() not in (3, 4):
        return None
    bad_rows = bad.any(-1)
    if bad_rows.dim() == 3:
        bad_rows = bad_rows.any(1)
    batch = bad_rows.shape[0]
    if mask_type == 1 and hidden.dim() == 2:  # key padding: every query of a batch row sees the same keys
        return bad_rows, hidden.all(-1).unsqueeze(-1)
    if hidden.dim() == 3:  # (B * H, L, S), as merge_masks views it
        hidden = hidden.reshape(batch, -1, *hidden.shape[-2:])
    rows = hidden.all(-1)
    if rows.dim() == 3:
        rows = rows.any(1)
    return bad_rows, rows


def _score_rows(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], hidden: torch.Tensor,
                mask_type: int | None, bad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(bad rows, hidden rows) of a masked softmax of the scores ``args[0]`` along ``dim``."""
    scores = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if scores is None or scores.shape != bad.shape or not bad.dim():
        return None
    if mask_type == 1 and hidden.dim() == 2 and scores.dim() > 2:  # key padding (B, S)
        hidden = hidden.reshape(hidden.shape[0], *([1] * (scores.dim() - 2)), hidden.shape[-1])
    dim = _int_argument(func, args, kwargs, "dim")
    dim = scores.dim() - 1 if dim is None else dim % scores.dim()
    return bad.any(dim), torch.broadcast_to(hidden, scores.shape).all(dim)


def masked_rows(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], bad: torch.Tensor) -> tuple[int, int] | None:
    """For a fused attention op whose output ``bad`` (the mask of its non-finite elements) was made: (query rows
    holding a bad element, of those the rows whose mask hides every key); ``None`` for another op, without a
    mask, or when the mask's shape cannot be laid over the output's rows."""
    func_short = short_name(func) if func is not None else ""
    operand = FUSED_ATTENTION.get(func_short)
    if operand is None or bad.is_nested:
        return None
    _, mask = _argument(func, args, kwargs, operand.name)
    if not isinstance(mask, torch.Tensor) or mask.is_nested or not mask.numel():
        return None
    hidden = _hidden(mask, operand.true_hides)
    mask_type = _int_argument(func, args, kwargs, "mask_type")
    try:
        if operand.layout == "heads":
            rows = _heads_rows(hidden, mask_type, bad)
        elif operand.layout == "scores":
            rows = _score_rows(func, args, kwargs, hidden, mask_type, bad)
        else:
            rows = (bad.any(-1), hidden.all(-1)) if bad.dim() else None
        if rows is None:
            return None
        bad_rows, hidden_rows = rows
        hidden_rows = torch.broadcast_to(hidden_rows, bad_rows.shape)
    except RuntimeError:  # a mask laid out otherwise than the op's convention says: no claim
        return None
    return int(bad_rows.sum()), int((bad_rows & hidden_rows).sum())
