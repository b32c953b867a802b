"""Attention-mask validation: padding agreement, causality, packing isolation, empty rows.

Masks come in many forms: a 2D padding mask ``(batch, seq)``, or an attention mask
``(L, S)``, ``(batch or batch*heads, L, S)``, ``(batch, heads, L, S)``; boolean, 0/1
integer, 0/1 float, or additive (0 where allowed, ``-inf`` / ``finfo.min`` / ``-1e4``
where masked). `validate_attention_mask` turns any of them into "may query i attend
to key j" and checks that against what the batch says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .issues import DataIssue, IssueReport

__all__ = ["MaskReport", "validate_attention_mask"]

_MASKED_AT = -1e4  # an additive value at or below this is "masked"
_LISTED = 20
_CONVENTIONS = ("attend", "masked")


@dataclass
class MaskReport(IssueReport):
    """Result of `validate_attention_mask`; `form` says how the mask was read."""

    form: str = ""
    additive: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.update(form=self.form, additive=self.additive)
        return out


def _positions(idx: torch.Tensor) -> list[list[int]]:
    return idx[:_LISTED].tolist()


def _edge_runs(is_pad: torch.Tensor, innermost_ok: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(padding, may_attend): pad-id runs touching either end; innermost element exempt if asked."""
    left = torch.cumprod(is_pad.to(torch.int8), dim=1).bool()
    right = torch.cumprod(is_pad.flip(1).to(torch.int8), dim=1).bool().flip(1)
    padding = left | right
    exempt = torch.zeros_like(padding)
    if innermost_ok:
        t = is_pad.shape[1]
        ar = torch.arange(t, device=is_pad.device)
        n_left = left.sum(1, keepdim=True)
        n_right = right.sum(1, keepdim=True)
        exempt |= left & (ar == n_left - 1)
        exempt |= right & (ar == t - n_right)
    return padding, exempt


def _segments(position_ids: torch.Tensor | None, segment_ids: torch.Tensor | None) -> torch.Tensor | None:
    if segment_ids is not None:
        return segment_ids
    if position_ids is None:
        return None
    pos = position_ids
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = (pos[:, 1:] <= pos[:, :-1]) | (pos[:, 1:] == 0)
    return torch.cumsum(starts.to(torch.int64), dim=1)


def validate_attention_mask(
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    pad_token_id: int | None = None,
    eos_token_id: int | None = None,
    causal: bool | None = None,
    position_ids: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    additive: bool | None = None,
    convention: str = "attend",
) -> MaskReport:
    """Check an attention mask against the batch it belongs to.

    * padding (needs `input_ids` and `pad_token_id`): pad-id runs at either end of a row
      must be masked and every other token must stay visible. When `eos_token_id` equals
      `pad_token_id` (GPT-2 style) the pad-id token next to the text may be attended.
    * causality (``causal=True``): no query may attend to a later key.
    * packing (`segment_ids`, or `position_ids` whose resets start a new document): no
      query may attend to a key of another document.
    * fully masked query rows (softmax over nothing: NaN), with their (batch, row).

    `additive` (``None`` = detect) says whether a floating mask is added to the scores;
    `convention` says what True/1 means for boolean and integer masks: ``"attend"``
    (PyTorch SDPA, Hugging Face) or ``"masked"`` (``nn.MultiheadAttention``).
    """
    if convention not in _CONVENTIONS:
        raise ValueError(f"convention must be one of {_CONVENTIONS}; got {convention!r}")
    for name, t in (("input_ids", input_ids), ("attention_mask", attention_mask),
                    ("position_ids", position_ids), ("segment_ids", segment_ids)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None; got {type(t).__name__}")
    if input_ids is not None and input_ids.ndim != 2:
        raise ValueError(f"input_ids must be 2D (batch, seq); got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        raise ValueError("attention_mask is required")
    if attention_mask.ndim not in (2, 3, 4):
        raise ValueError(f"attention_mask must be 2D, 3D or 4D; got shape {tuple(attention_mask.shape)}")
    if pad_token_id is not None and input_ids is None:
        raise ValueError("pad_token_id needs input_ids to compare the mask with")

    m = attention_mask.detach()
    issues: list[DataIssue] = []
    if m.is_floating_point():
        finite_or_neg_inf = torch.isfinite(m) | (m == -torch.inf)
        if not bool(finite_or_neg_inf.all()):
            bad = (~finite_or_neg_inf).nonzero()
            batches = sorted(set(bad[:, 0].tolist())) if m.ndim > 2 or input_ids is not None else []
            issues.append(DataIssue(
                "nonfinite_input", "attention_mask", batches,
                f"attention_mask holds {int((~finite_or_neg_inf).sum())} NaN/+Inf value(s), first at "
                f"{tuple(bad[0].tolist())}: every score they touch becomes NaN.",
                "Build additive masks from a boolean mask with masked_fill(-inf) or finfo.min, "
                "never by multiplying -inf with 0 or adding -inf to +inf.",
                {"positions": _positions(bad)},
            ))
        if additive is None:
            additive = bool((m < 0).any()) or not bool(((m == 0) | (m == 1)).all()) or not bool((m == 1).any())
        if additive:
            allowed = m > _MASKED_AT
            nan_row_source = m == -torch.inf  # only a row of -inf turns softmax into NaN
        else:
            allowed = m != 0
            nan_row_source = ~allowed
    else:
        additive = False
        allowed = m.bool() if convention == "attend" else ~m.bool()
        nan_row_source = ~allowed

    batch = input_ids.shape[0] if input_ids is not None else None
    padding_2d = m.ndim == 2 and not (
        causal and m.shape[0] == m.shape[1] and (input_ids is None or tuple(input_ids.shape) != tuple(m.shape))
    )
    form = "padding_2d" if padding_2d else f"attention_{m.ndim}d"

    pad = exempt = None
    if input_ids is not None and pad_token_id is not None:
        innermost_ok = eos_token_id is not None and eos_token_id == pad_token_id
        pad, exempt = _edge_runs(input_ids == pad_token_id, innermost_ok)
    seg = _segments(position_ids, segment_ids)

    if padding_2d:
        issues += _check_padding_2d(allowed, nan_row_source, input_ids, pad, exempt, seg, causal)
    else:
        allowed4 = _to4d(allowed, batch)
        nan4 = _to4d(nan_row_source, batch)
        issues += _check_attention(allowed4, nan4, pad, exempt, seg, causal)
    return MaskReport(issues=issues, form=form, additive=bool(additive))


def _to4d(t: torch.Tensor, batch: int | None) -> torch.Tensor:
    if t.ndim == 2:
        return t[None, None]
    if t.ndim == 3:
        n = t.shape[0]
        if batch and n != batch and n % batch == 0:  # (batch * heads, L, S), batch-major
            return t.reshape(batch, n // batch, *t.shape[1:])
        return t[:, None]
    return t


def _check_padding_2d(
    allowed: torch.Tensor, nan_src: torch.Tensor, input_ids: torch.Tensor | None,
    pad: torch.Tensor | None, exempt: torch.Tensor | None, seg: torch.Tensor | None, causal: bool | None,
) -> list[DataIssue]:
    issues: list[DataIssue] = []
    if input_ids is not None and tuple(input_ids.shape) != tuple(allowed.shape):
        raise ValueError(f"attention_mask shape {tuple(allowed.shape)} does not match input_ids "
                         f"shape {tuple(input_ids.shape)}")
    if pad is not None:
        assert exempt is not None
        attended_pad = pad & allowed & ~exempt
        masked_real = ~pad & ~allowed
        issues += _padding_issues(attended_pad, masked_real)
    if seg is not None:
        multi = (seg != seg[:, :1])
        if pad is not None:
            multi &= ~pad
        rows = multi.any(dim=1).nonzero().flatten().tolist()
        if rows:
            issues.append(DataIssue(
                "cross_sample_attention", "attention_mask", rows,
                f"rows {rows[:_LISTED]} pack several documents but the mask is a 2D padding mask, "
                "which cannot keep them apart: every token may attend to earlier documents.",
                "Use a block-diagonal (3D/4D) mask built from the document ids, or an attention "
                "kernel that separates documents by position_ids / cu_seqlens (flash-attention "
                "varlen); otherwise packed samples leak into each other.",
                {"verifiable": False},
                severity="warning",
            ))
    # Fully masked query rows: a row with nothing to attend to.
    key_ok = ~nan_src
    if causal:
        # query i sees keys j <= i: it is empty while no allowed key has appeared yet
        empty = torch.cumsum(key_ok.to(torch.int64), dim=1) == 0
        empty_rows = empty.nonzero()
    else:
        empty_b = ~key_ok.any(dim=1)
        empty_rows = torch.stack(torch.meshgrid(
            empty_b.nonzero().flatten(), torch.arange(key_ok.shape[1], device=key_ok.device), indexing="ij"
        ), dim=-1).reshape(-1, 2)
    if empty_rows.numel():
        issues.append(_empty_row_issue(empty_rows, causal, two_d=True))
    return issues


def _padding_issues(attended_pad: torch.Tensor, masked_real: torch.Tensor) -> list[DataIssue]:
    issues: list[DataIssue] = []
    if bool(attended_pad.any()):
        where = attended_pad.nonzero()
        rows = sorted(set(where[:, 0].tolist()))
        issues.append(DataIssue(
            "padding_mask_mismatch", "attention_mask", rows,
            f"{int(attended_pad.sum())} padding position(s) are attended (mask says attend, "
            f"input_ids hold pad_token_id) in samples {rows[:_LISTED]}, first at "
            f"(batch, position) {tuple(where[0].tolist())}.",
            "Build the mask from the padding (input_ids != pad_token_id, or the tokenizer's "
            "attention_mask); an off-by-one in sequence lengths or a mask computed before "
            "re-padding is the usual cause. If pad and eos share an id, pass eos_token_id.",
            {"kind": "padding_attended", "count": int(attended_pad.sum()), "positions": _positions(where)},
        ))
    if bool(masked_real.any()):
        where = masked_real.nonzero()
        rows = sorted(set(where[:, 0].tolist()))
        issues.append(DataIssue(
            "padding_mask_mismatch", "attention_mask", rows,
            f"{int(masked_real.sum())} real token(s) are masked out in samples {rows[:_LISTED]}, "
            f"first at (batch, position) {tuple(where[0].tolist())}: the model cannot see them.",
            "Mask only padding: check the mask's convention (1 = attend for Hugging Face / SDPA, "
            "True = masked for nn.MultiheadAttention) and the sequence lengths it was built from.",
            {"kind": "real_masked", "count": int(masked_real.sum()), "positions": _positions(where)},
        ))
    return issues


def _empty_row_issue(rows: torch.Tensor, causal: bool | None, two_d: bool) -> DataIssue:
    batches = sorted(set(rows[:, 0].tolist()))
    pairs = rows[:, :2].tolist()
    uniq = sorted({(b, i) for b, i in pairs})
    why = (" (under the causal mask, these query positions come before the first visible "
           "key: left padding)" if causal and two_d else "")
    return DataIssue(
        "fully_masked_row", "attention_mask", batches,
        f"{len(uniq)} query row(s) have every key masked{why}; softmax over them is 0/0 = NaN. "
        f"(batch, row): {uniq[:_LISTED]}.",
        "Let every query attend to at least one key (e.g. to itself), use finfo(dtype).min "
        "instead of -inf in additive masks, or zero the rows of padding queries after "
        "attention (what Hugging Face does for SDPA).",
        {"rows": [list(p) for p in uniq[:_LISTED]], "count": len(uniq)},
    )


def _check_attention(
    allowed: torch.Tensor, nan_src: torch.Tensor, pad: torch.Tensor | None, exempt: torch.Tensor | None,
    seg: torch.Tensor | None, causal: bool | None,
) -> list[DataIssue]:
    issues: list[DataIssue] = []
    b, h, q, k = allowed.shape
    if causal:
        offset = k - q  # with a KV cache, queries are the last q positions
        qi = torch.arange(q, device=allowed.device)[:, None]
        kj = torch.arange(k, device=allowed.device)[None, :]
        future = kj > qi + offset
        bad = allowed & future
        if bool(bad.any()):
            where = bad.nonzero()
            batches = sorted(set(where[:, 0].tolist()))
            issues.append(DataIssue(
                "not_causal", "attention_mask", batches,
                f"the mask lets {int(bad.sum())} (query, key) pair(s) attend to the future, first "
                f"query {int(where[0, 2])} -> key {int(where[0, 3])} (batch {int(where[0, 0])}, head "
                f"{int(where[0, 1])}): the model sees the tokens it must predict.",
                "Combine the padding mask with torch.tril(ones(L, S)) (keep the lower triangle); "
                "check for a transposed mask (triu vs tril) or an inverted convention.",
                {"count": int(bad.sum()), "positions": _positions(where)},
            ))
    seq_match = pad is not None and q == k == pad.shape[1] and b in (1, pad.shape[0])
    if pad is not None and seq_match:
        assert exempt is not None
        pad_k = (pad & ~exempt)[:, None, None, :]
        real_q = (~pad)[:, None, :, None]
        attended_pad = (allowed & pad_k & real_q).any(dim=(1, 2))  # (B, S)
        visible = allowed.any(dim=(1, 2)).expand(pad.shape[0], -1)
        masked_real = ~pad & ~visible
        issues += _padding_issues(attended_pad.expand_as(pad), masked_real)
    if seg is not None and q == k == seg.shape[1]:
        cross = seg[:, None, :, None] != seg[:, None, None, :]
        if pad is not None:
            cross = cross & ~pad[:, None, :, None] & ~pad[:, None, None, :]
        bad = allowed & cross
        if bool(bad.any()):
            where = bad.nonzero()
            batches = sorted(set(where[:, 0].tolist()))
            first = where[0].tolist()
            issues.append(DataIssue(
                "cross_sample_attention", "attention_mask", batches,
                f"{int(bad.sum())} (query, key) pair(s) attend across packed documents in samples "
                f"{batches[:_LISTED]}, first query {first[2]} (document {int(seg[first[0], first[2]])}) -> "
                f"key {first[3]} (document {int(seg[first[0], first[3]])}).",
                "Make the mask block-diagonal per document (AND it with segment_ids[:, :, None] == "
                "segment_ids[:, None, :]) or reset it at every position_ids == 0.",
                {"count": int(bad.sum()), "positions": _positions(where)},
            ))
    empty = ~((~nan_src).any(dim=-1))  # (B, H, Q)
    if bool(empty.any()):
        where = empty.nonzero()  # (b, h, i)
        rows = torch.stack([where[:, 0], where[:, 2]], dim=1)
        issues.append(_empty_row_issue(rows, causal, two_d=False))
    return issues
