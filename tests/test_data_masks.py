"""Attention-mask validation (nantrace.data.validate_attention_mask)."""

from __future__ import annotations

import json

import pytest
import torch

from nantrace.data import validate_attention_mask

PAD = 0
T = 5
IDS_RIGHT = torch.tensor([[5, 6, 7, PAD, PAD], [5, 6, 7, 8, 9]])
IDS_LEFT = torch.tensor([[PAD, PAD, 5, 6, 7], [5, 6, 7, 8, 9]])
MASK_RIGHT = (IDS_RIGHT != PAD).long()
MASK_LEFT = (IDS_LEFT != PAD).long()
TRIL = torch.tril(torch.ones(T, T, dtype=torch.bool))


def _additive(allowed: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill(~allowed, fill)


def _hf_4d(ids: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """(B, 1, T, T) boolean mask: causal AND key is not padding."""
    keys = (ids != PAD)[:, None, None, :]
    return (TRIL[None, None] if causal else torch.ones(1, 1, T, T, dtype=torch.bool)) & keys


def _summary(report):
    return [(i.cause, i.sample_indices, i.details.get("kind")) for i in report.issues]


# --------------------------------------------------------------------------- healthy


HEALTHY = [
    pytest.param(dict(input_ids=IDS_RIGHT, attention_mask=MASK_RIGHT, pad_token_id=PAD), id="right-padding"),
    pytest.param(dict(input_ids=IDS_LEFT, attention_mask=MASK_LEFT, pad_token_id=PAD), id="left-padding"),
    pytest.param(dict(input_ids=IDS_RIGHT, attention_mask=MASK_RIGHT.bool(), pad_token_id=PAD, causal=True),
                 id="right-padding-causal-bool"),
    pytest.param(dict(input_ids=IDS_RIGHT, attention_mask=MASK_RIGHT.float(), pad_token_id=PAD), id="float-0-1"),
    pytest.param(dict(input_ids=IDS_RIGHT, attention_mask=IDS_RIGHT == PAD, pad_token_id=PAD, convention="masked"),
                 id="mha-key-padding-mask"),
    pytest.param(dict(input_ids=torch.tensor([[5, 6, 2, 2, 2]]), attention_mask=torch.tensor([[1, 1, 1, 0, 0]]),
                      pad_token_id=2, eos_token_id=2), id="pad-is-eos"),
    pytest.param(dict(attention_mask=TRIL[None, None], causal=True), id="tril-4d"),
    pytest.param(dict(attention_mask=TRIL, causal=True), id="tril-2d"),
    pytest.param(dict(attention_mask=_additive(TRIL)[None].expand(6, T, T), causal=True), id="additive-3d"),
    pytest.param(dict(attention_mask=_additive(TRIL, torch.finfo(torch.float16).min).half()[None, None],
                      causal=True), id="additive-finfo-min-fp16"),
    pytest.param(dict(attention_mask=_additive(torch.ones(2, 5, dtype=torch.bool).tril(3))[None, None],
                      causal=True), id="kv-cache-offset"),
    pytest.param(dict(input_ids=IDS_RIGHT, attention_mask=_hf_4d(IDS_RIGHT), pad_token_id=PAD, causal=True),
                 id="hf-4d-right-padding"),
    pytest.param(dict(input_ids=IDS_RIGHT, attention_mask=_additive(_hf_4d(IDS_RIGHT), -1e4), pad_token_id=PAD,
                      causal=True), id="additive-minus-1e4"),
    pytest.param(dict(attention_mask=(TRIL & (torch.tensor([1, 1, 1, 2, 2])[:, None] == torch.tensor([1, 1, 1, 2, 2])))[None, None],
                      causal=True, segment_ids=torch.tensor([[1, 1, 1, 2, 2]])), id="packed-block-diagonal"),
]


@pytest.mark.parametrize("kwargs", HEALTHY)
def test_healthy_masks_have_no_issue(kwargs):
    report = validate_attention_mask(**kwargs)
    assert report.ok, str(report)


# --------------------------------------------------------------------------- padding


PADDING = [
    pytest.param(IDS_RIGHT, torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]), {},
                 [("padding_mask_mismatch", [0], "padding_attended")], [[0, 3]], id="off-by-one"),
    pytest.param(IDS_RIGHT, torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]), {},
                 [("padding_mask_mismatch", [0], "real_masked")], [[0, 2]], id="real-token-masked"),
    pytest.param(IDS_LEFT, torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]]), {},
                 [("padding_mask_mismatch", [0], "padding_attended")], [[0, 0]], id="left-padding-attended"),
    pytest.param(torch.tensor([[5, 6, 2, 2, 2]]), torch.tensor([[1, 1, 1, 0, 0]]), {},
                 [("padding_mask_mismatch", [0], "padding_attended")], [[0, 2]], id="pad-eos-without-eos-id"),
    pytest.param(IDS_RIGHT, IDS_RIGHT == PAD, {},
                 [("padding_mask_mismatch", [0], "padding_attended"),
                  ("padding_mask_mismatch", [0, 1], "real_masked"),
                  ("fully_masked_row", [1], None)], [[0, 3]], id="inverted-convention"),
]


@pytest.mark.parametrize("ids, mask, extra, expected, first", PADDING)
def test_padding_mismatch(ids, mask, extra, expected, first):
    report = validate_attention_mask(ids, mask, pad_token_id=PAD if 2 not in ids else 2, **extra)
    assert _summary(report) == expected
    assert report.issues[0].details["positions"][0] == first[0]
    assert report.form == "padding_2d"


def test_padding_checked_in_4d_masks():
    bad = _hf_4d(IDS_RIGHT).clone()
    bad[0, 0, 2, 3] = True  # real query 2 attends to the pad key 3
    report = validate_attention_mask(IDS_RIGHT, bad, pad_token_id=PAD, causal=False)
    assert _summary(report) == [("padding_mask_mismatch", [0], "padding_attended")]
    assert report.form == "attention_4d"
    hidden = _hf_4d(IDS_RIGHT).clone()
    hidden[1, 0, :, 4] = False  # nobody can see the real token 4 of sample 1
    report = validate_attention_mask(IDS_RIGHT, hidden, pad_token_id=PAD, causal=True)
    assert _summary(report) == [("padding_mask_mismatch", [1], "real_masked")]
    assert report.issues[0].details["positions"] == [[1, 4]]


# --------------------------------------------------------------------------- causal


CAUSAL = [
    pytest.param(torch.triu(torch.ones(T, T, dtype=torch.bool))[None, None], [0], (0, 1), id="triu-4d-bool"),
    pytest.param(_additive(torch.ones(T, T, dtype=torch.bool))[None].expand(4, T, T), [0, 1, 2, 3], (0, 1),
                 id="all-zero-additive-3d"),
    pytest.param(torch.ones(T, T, dtype=torch.long), [0], (0, 1), id="full-2d-int"),
    pytest.param(_additive(TRIL.T), [0], (0, 1), id="transposed-additive-2d"),
]


@pytest.mark.parametrize("mask, batches, first_pair", CAUSAL)
def test_not_causal(mask, batches, first_pair):
    report = validate_attention_mask(attention_mask=mask, causal=True)
    causes = report.causes
    assert causes[0] == "not_causal"
    issue = report.issues[0]
    assert issue.sample_indices == batches
    q, k = issue.details["positions"][0][2:]
    assert (q, k) == first_pair
    assert f"query {first_pair[0]} -> key {first_pair[1]}" in issue.summary
    assert causes == ["not_causal"] or causes == ["not_causal", "fully_masked_row"]


def test_causal_not_checked_unless_asked():
    assert validate_attention_mask(attention_mask=torch.ones(1, 1, T, T, dtype=torch.bool)).ok


# --------------------------------------------------------------------------- packing


SEG = torch.tensor([[1, 1, 1, 2, 2]])
POS = torch.tensor([[0, 1, 2, 0, 1]])


@pytest.mark.parametrize("kwargs", [dict(segment_ids=SEG), dict(position_ids=POS)], ids=["segment-ids", "position-ids"])
def test_cross_sample_attention(kwargs):
    report = validate_attention_mask(attention_mask=TRIL[None, None], causal=True, **kwargs)
    assert report.causes == ["cross_sample_attention"]
    issue = report.issues[0]
    assert issue.sample_indices == [0]
    assert issue.details["count"] == 6  # queries 3, 4 each see keys 0, 1, 2
    assert issue.details["positions"][0] == [0, 0, 3, 0]
    assert "query 3 (document 2) -> key 0 (document 1)" in issue.summary


def test_packed_rows_with_a_2d_mask_are_flagged_as_unverifiable():
    ids = torch.tensor([[5, 6, 7, 8, 9, PAD]])
    report = validate_attention_mask(ids, (ids != PAD).long(), pad_token_id=PAD,
                                     segment_ids=torch.tensor([[1, 1, 1, 2, 2, 0]]))
    assert _summary(report) == [("cross_sample_attention", [0], None)]
    assert report.issues[0].severity == "warning" and report.issues[0].details["verifiable"] is False


# --------------------------------------------------------------------------- fully masked rows


def test_left_padding_under_a_causal_mask_leaves_empty_rows():
    report = validate_attention_mask(IDS_LEFT, MASK_LEFT, pad_token_id=PAD, causal=True)
    assert report.causes == ["fully_masked_row"]
    issue = report.issues[0]
    assert issue.sample_indices == [0]
    assert issue.details["rows"] == [[0, 0], [0, 1]]
    assert "left padding" in issue.summary


def test_fully_masked_rows_in_4d_masks():
    allowed = _hf_4d(IDS_LEFT)  # left padding + causal: pad queries 0 and 1 of sample 0 see nothing
    report = validate_attention_mask(IDS_LEFT, _additive(allowed), pad_token_id=PAD, causal=True)
    assert report.causes == ["fully_masked_row"]
    assert report.issues[0].details["rows"] == [[0, 0], [0, 1]]
    # the same mask with finfo.min instead of -inf gives a finite softmax: not reported
    finite = _additive(allowed, torch.finfo(torch.float32).min)
    assert validate_attention_mask(IDS_LEFT, finite, pad_token_id=PAD, causal=True).ok


def test_empty_sequence_2d():
    ids = torch.tensor([[PAD, PAD, PAD], [5, 6, 7]])
    report = validate_attention_mask(ids, (ids != PAD).long(), pad_token_id=PAD)
    assert report.causes == ["fully_masked_row"]
    assert report.issues[0].details["rows"] == [[0, 0], [0, 1], [0, 2]]


def test_nan_in_an_additive_mask():
    mask = _additive(TRIL)[None, None].clone()
    mask[0, 0, 3, 1] = float("nan")
    report = validate_attention_mask(attention_mask=mask, causal=True)
    assert _summary(report) == [("nonfinite_input", [0], None)]
    assert report.issues[0].details["positions"] == [[0, 0, 3, 1]]


def test_mask_report_is_json_serialisable():
    report = validate_attention_mask(IDS_LEFT, MASK_LEFT, pad_token_id=PAD, causal=True)
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert data["form"] == "padding_2d" and data["issues"][0]["cause"] == "fully_masked_row"


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(attention_mask=MASK_RIGHT, convention="keep"), ValueError, ["convention", "'keep'", "attend"]),
    (dict(attention_mask=None), ValueError, ["attention_mask"]),
    (dict(attention_mask=torch.ones(T)), ValueError, ["attention_mask", "2D, 3D or 4D"]),
    (dict(attention_mask=MASK_RIGHT, pad_token_id=0), ValueError, ["pad_token_id", "input_ids"]),
    (dict(input_ids=[[1, 2]], attention_mask=MASK_RIGHT), TypeError, ["input_ids", "list"]),
    (dict(input_ids=IDS_RIGHT, attention_mask=torch.ones(2, 4), pad_token_id=0), ValueError, ["shape", "(2, 4)"]),
])
def test_bad_arguments(kwargs, exc, words):
    with pytest.raises(exc) as info:
        validate_attention_mask(**kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)
