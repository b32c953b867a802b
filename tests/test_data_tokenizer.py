"""Tokenizer consistency (nantrace.data.compare_tokenizers) on small tokenizers built here."""

from __future__ import annotations

import functools
import json

import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

from nantrace.data import TOKENIZER_FIELDS, compare_tokenizers  # noqa: E402

CORPUS = [
    "Hello world, hello again.",
    "The quick brown fox jumps over the lazy dog.",
    "Numbers like 42 and 3.14 appear in text.",
    "it's a small corpus for a small tokenizer",
    "Cafe and cafe are different words here",
] * 4
SPECIALS = ["[UNK]", "[PAD]", "[CLS]", "[SEP]"]


@functools.lru_cache(maxsize=None)
def _trained(kind: str) -> str:
    # Training breaks ties in hash order, so two trainings may number tokens differently:
    # train once per kind and hand out copies.
    if kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=SPECIALS, show_progress=False)
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        trainer = trainers.WordPieceTrainer(vocab_size=150, special_tokens=SPECIALS, show_progress=False)
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainer)
    return tok.to_str()


def bpe() -> Tokenizer:
    return Tokenizer.from_str(_trained("bpe"))


def wordpiece() -> Tokenizer:
    return Tokenizer.from_str(_trained("wordpiece"))


BUILDERS = {"bpe": bpe, "wordpiece": wordpiece}


def _edit_vocab(tok: Tokenizer, edit) -> Tokenizer:
    spec = json.loads(tok.to_str())
    edit(spec["model"]["vocab"])
    return Tokenizer.from_str(json.dumps(spec))


def _swap_ids(a: str, b: str):
    def edit(vocab):
        vocab[a], vocab[b] = vocab[b], vocab[a]
    return edit


def _rename(old: str, new: str):
    def edit(vocab):
        vocab[new] = vocab.pop(old)
    return edit


def _lowercase(t):
    t.normalizer = normalizers.Lowercase()


def _nfkc_lowercase(t):
    t.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])


def _whitespace_split(t):
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()


def _cls_sep_template(t):
    t.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", t.token_to_id("[CLS]")), ("[SEP]", t.token_to_id("[SEP]"))])


def _wordpiece_decoder(t):
    t.decoder = decoders.WordPiece()


def _pad_left(t):
    t.enable_padding(direction="left", pad_id=t.token_to_id("[PAD]"), pad_token="[PAD]")


def _pad_right(t):
    t.enable_padding(direction="right", pad_id=t.token_to_id("[PAD]"), pad_token="[PAD]")


def _pad_with_unk(t):
    t.enable_padding(direction="right", pad_id=t.token_to_id("[UNK]"), pad_token="[UNK]")


def _truncate_8(t):
    t.enable_truncation(max_length=8)


def _truncate_64(t):
    t.enable_truncation(max_length=64)


def _add_special(t):
    t.add_special_tokens(["<|extra|>"])


def _add_plain(t):
    t.add_tokens(["zebra"])


# (name, kind, change to train, change to infer, expected fields) - one aspect at a time
CASES = [
    ("identical-bpe", "bpe", None, None, []),
    ("identical-wordpiece", "wordpiece", None, None, []),
    ("lowercase", "bpe", None, _lowercase, ["normalizer", "encodings"]),
    ("nfkc-lowercase", "wordpiece", _lowercase, _nfkc_lowercase, ["normalizer", "encodings"]),
    ("pre-tokenizer", "wordpiece", None, _whitespace_split, ["pre_tokenizer", "encodings"]),
    ("post-processor", "wordpiece", None, _cls_sep_template, ["post_processor", "encodings"]),
    ("decoder", "wordpiece", None, _wordpiece_decoder, ["decoder"]),
    ("pad-side", "bpe", _pad_right, _pad_left, ["padding_side"]),
    ("pad-enabled-one-side", "bpe", None, _pad_right, ["padding_side"]),
    ("pad-token", "wordpiece", _pad_right, _pad_with_unk, ["pad_token"]),
    ("truncation", "bpe", _truncate_64, _truncate_8, ["truncation"]),
    ("added-special", "bpe", None, _add_special, ["vocab_size", "special_tokens"]),
    ("added-plain", "wordpiece", _add_plain, None, ["vocab_size", "added_tokens"]),
]


@pytest.mark.parametrize("name, kind, change_train, change_infer, expected", CASES, ids=[c[0] for c in CASES])
def test_one_aspect_at_a_time(name, kind, change_train, change_infer, expected):
    train, infer = BUILDERS[kind](), BUILDERS[kind]()
    for tok, change in ((train, change_train), (infer, change_infer)):
        if change is not None:
            change(tok)
    report = compare_tokenizers(train, infer)
    assert report.fields == expected, str(report)
    assert report.ok == (not expected)
    assert set(report.fields) <= set(TOKENIZER_FIELDS)
    json.dumps(report.to_dict(), allow_nan=False)


def test_lowercase_report_details():
    train, infer = bpe(), bpe()
    _lowercase(infer)
    report = compare_tokenizers(train, infer)
    norm = report.get("normalizer")
    assert norm.train is None and norm.infer == {"type": "Lowercase"}
    assert "none" in norm.summary and "Lowercase" in norm.summary
    enc = report.get("encodings")
    first = next(iter(enc.train))
    assert first == "Hello world"  # the first default probe that differs
    assert enc.train[first]["ids"] != enc.infer[first]["ids"]
    assert "'Hello world'" in enc.summary


def test_same_token_different_id():
    train = bpe()
    infer = _edit_vocab(bpe(), _swap_ids("e", "o"))
    report = compare_tokenizers(train, infer)
    assert report.fields == ["vocab_ids", "encodings"]
    diff = report.get("vocab_ids")
    assert diff.train == {"e": train.token_to_id("e"), "o": train.token_to_id("o")}
    assert diff.infer == {"e": train.token_to_id("o"), "o": train.token_to_id("e")}


def test_token_missing_on_one_side():
    train = wordpiece()
    infer = _edit_vocab(wordpiece(), _rename("fox", "f0x"))
    report = compare_tokenizers(train, infer, probe_texts=["the quick brown fox", "hello world"])
    assert report.fields == ["vocab_missing", "encodings"]
    diff = report.get("vocab_missing")
    assert (diff.train, diff.infer) == (["fox"], ["f0x"])
    assert list(report.get("encodings").train) == ["the quick brown fox"]


def test_probe_texts_limit_what_is_encoded():
    train, infer = bpe(), bpe()
    _lowercase(infer)
    report = compare_tokenizers(train, infer, probe_texts=["already lowercase text"])
    assert report.fields == ["normalizer"]
    assert report.probes_compared == 1


def test_bpe_vs_wordpiece_reports_model_and_merges_are_not_compared_across_kinds():
    report = compare_tokenizers(bpe(), wordpiece())
    assert "model" in report.fields and "merges" not in report.fields
    assert report.get("model").train["type"] == "BPE" and report.get("model").infer["type"] == "WordPiece"


# --------------------------------------------------------------------------- transformers


transformers = pytest.importorskip("transformers")


def hf(tok: Tokenizer | None = None, **kwargs):
    from transformers import PreTrainedTokenizerFast

    kwargs.setdefault("pad_token", "[PAD]")
    kwargs.setdefault("unk_token", "[UNK]")
    return PreTrainedTokenizerFast(tokenizer_object=tok or bpe(), **kwargs)


HF_CASES = [
    ("identical", {}, {}, []),
    ("padding-side", {"padding_side": "right"}, {"padding_side": "left"}, ["padding_side"]),
    ("max-length", {}, {"model_max_length": 16}, ["truncation"]),
    ("truncation-side", {"model_max_length": 16}, {"model_max_length": 16, "truncation_side": "left"},
     ["truncation"]),
    ("pad-token", {}, {"pad_token": "[SEP]"}, ["pad_token"]),
    ("eos-role", {}, {"eos_token": "[SEP]"}, ["special_token_roles"]),
]


@pytest.mark.parametrize("name, train_kwargs, infer_kwargs, expected", HF_CASES, ids=[c[0] for c in HF_CASES])
def test_transformers_fast_tokenizers(name, train_kwargs, infer_kwargs, expected):
    report = compare_tokenizers(hf(**train_kwargs), hf(**infer_kwargs))
    assert report.fields == expected, str(report)


def test_transformers_vs_bare_tokenizer_of_the_same_model_agree():
    assert compare_tokenizers(hf(), bpe()).ok
    lowered = bpe()
    _lowercase(lowered)
    assert compare_tokenizers(hf(), lowered).fields == ["normalizer", "encodings"]


def test_tokenizer_json_path(tmp_path):
    path = tmp_path / "tokenizer.json"
    bpe().save(str(path))
    assert compare_tokenizers(str(path), bpe()).ok


def test_bad_argument_names_the_parameter():
    with pytest.raises(TypeError, match="infer_tok must be a tokenizers.Tokenizer"):
        compare_tokenizers(bpe(), object())
    with pytest.raises(TypeError, match="probe_texts"):
        compare_tokenizers(bpe(), bpe(), probe_texts=[1, 2])
