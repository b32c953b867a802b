"""Tokenizer consistency: does the inference tokenizer turn text into the ids training saw?

A model trained with one tokenizer and served with a subtly different one (a lowercase
normaliser, another padding side, a special token added later, a re-trained vocab)
gets ids it never learned, which shows up as garbage or, with out-of-range ids,
as NaN/device asserts. `compare_tokenizers` lists every difference by field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .issues import jsonable

__all__ = [
    "DEFAULT_PROBE_TEXTS",
    "TOKENIZER_FIELDS",
    "TokenizerDifference",
    "TokenizerReport",
    "compare_tokenizers",
]

#: Texts encoded by both tokenizers when no probe set is given: casing, whitespace,
#: numbers, punctuation, accents (composed and decomposed), several scripts, emoji.
DEFAULT_PROBE_TEXTS: tuple[str, ...] = (
    "Hello world",
    "hello world",
    "HELLO WORLD",
    "The Quick Brown Fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "multiple   spaces\tand a tab",
    "line one\nline two\r\nline three",
    "Numbers: 0 7 42 123 4096 3.14159 -2.5e-3 1,000,000",
    "Dates 2024-01-31 and times 23:59:59",
    "it's, don't; can't: won't!",
    "email me@example.com or visit https://example.com/a?b=1&c=2",
    "CamelCaseWord snake_case_word kebab-case-word",
    "Café naïve résumé façade",
    "Cafe\u0301 decomposed accent",
    "Ünïcödé ÄÖÜ äöü ß",
    "Full-width ＡＢＣ１２３, ligature ﬁ, circled ①",
    "Ελληνικά γράμματα",
    "русский текст",
    "中文文本测试",
    "日本語のテキスト",
    "emoji 🙂 🚀 👍🏽",
    "",
    " ",
)

#: Every field a `TokenizerDifference` can name.
TOKENIZER_FIELDS: tuple[str, ...] = (
    "vocab_size",
    "vocab_missing",
    "vocab_ids",
    "added_tokens",
    "special_tokens",
    "special_token_roles",
    "pad_token",
    "padding_side",
    "truncation",
    "normalizer",
    "pre_tokenizer",
    "post_processor",
    "decoder",
    "model",
    "merges",
    "encodings",
)

_LISTED = 20  # tokens/texts listed per difference
_ROLES = ("bos_token", "eos_token", "unk_token", "sep_token", "cls_token", "mask_token")
_HUGE = 10**17  # transformers' "no model_max_length" sentinel is ~1e30


@dataclass
class TokenizerDifference:
    """One aspect in which the two tokenizers differ (`field` is in `TOKENIZER_FIELDS`)."""

    field: str
    train: Any
    infer: Any
    summary: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return {"field": self.field, "train": jsonable(self.train), "infer": jsonable(self.infer),
                "summary": self.summary}


@dataclass
class TokenizerReport:
    """Result of `compare_tokenizers`: `ok` when no difference was found."""

    differences: list[TokenizerDifference] = field(default_factory=list)
    probes_compared: int = 0

    @property
    def ok(self) -> bool:
        return not self.differences

    @property
    def fields(self) -> list[str]:
        """The differing fields, in report order."""
        return [d.field for d in self.differences]

    def get(self, field_name: str) -> TokenizerDifference | None:
        """The difference for this field, or None."""
        return next((d for d in self.differences if d.field == field_name), None)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "probes_compared": self.probes_compared,
                "differences": [d.to_dict() for d in self.differences]}

    def __str__(self) -> str:
        if self.ok:
            return f"tokenizers agree ({self.probes_compared} probe texts encode identically)"
        lines = [f"tokenizers differ in {len(self.differences)} field(s):"]
        lines += [f"  - {d.field}: {d.summary}" for d in self.differences]
        return "\n".join(lines)


# --------------------------------------------------------------------------- views


@dataclass
class _View:
    backend: Any  # tokenizers.Tokenizer (untouched)
    hf: Any  # transformers fast tokenizer or None
    spec: dict[str, Any]  # the backend's JSON description
    encoder: Any  # backend copy without truncation/padding, for raw encodings

    @property
    def kind(self) -> str:
        return "transformers" if self.hf is not None else "tokenizers"


def _view(tok: Any, side: str) -> _View:
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - optional extra
        raise ImportError("compare_tokenizers needs the 'tokenizers' package (pip install nantrace[tokenizers])") from exc
    if isinstance(tok, (str, Path)):
        tok = Tokenizer.from_file(str(tok))
    if isinstance(tok, Tokenizer):
        backend, hf = tok, None
    elif isinstance(getattr(tok, "backend_tokenizer", None), Tokenizer):
        backend, hf = tok.backend_tokenizer, tok
    else:
        raise TypeError(
            f"{side} must be a tokenizers.Tokenizer, a transformers fast tokenizer "
            f"(PreTrainedTokenizerFast) or a path to a tokenizer.json; got {type(tok).__name__}"
        )
    raw = backend.to_str()
    encoder = Tokenizer.from_str(raw)
    encoder.no_truncation()
    encoder.no_padding()
    return _View(backend, hf, json.loads(raw), encoder)


def _vocab(v: _View) -> dict[str, int]:
    return v.backend.get_vocab(with_added_tokens=False)


def _added(v: _View, special: bool) -> dict[str, int]:
    return {t.content: int(i) for i, t in v.backend.get_added_tokens_decoder().items() if bool(t.special) == special}


def _padding(v: _View) -> tuple[bool, str | None, tuple[str | None, int | None] | None]:
    """(known, side, (pad token, pad id)) as the tokenizer would pad a batch."""
    if v.hf is not None:
        pad = v.hf.pad_token
        pad_id = v.hf.pad_token_id if pad is not None else None
        return True, getattr(v.hf, "padding_side", None), (str(pad) if pad is not None else None, pad_id)
    p = v.backend.padding
    if p is None:
        return False, None, None
    return True, p.get("direction"), (p.get("pad_token"), p.get("pad_id"))


def _truncation(v: _View) -> dict[str, Any] | None:
    if v.hf is not None:
        mml = getattr(v.hf, "model_max_length", None)
        if mml is None or mml >= _HUGE:
            return None  # no limit: nothing is ever truncated
        return {"max_length": int(mml), "direction": getattr(v.hf, "truncation_side", None)}
    t = v.backend.truncation
    if t is None:
        return None
    return {"max_length": t.get("max_length"), "direction": t.get("direction"),
            "strategy": t.get("strategy"), "stride": t.get("stride")}


def _encode(v: _View, text: str) -> list[int]:
    if v.hf is not None:
        try:
            enc = v.hf(text, add_special_tokens=True, truncation=False, padding=False, verbose=False)
        except TypeError:  # older signature without `verbose`
            enc = v.hf(text, add_special_tokens=True, truncation=False, padding=False)
        return list(enc["input_ids"])
    return list(v.encoder.encode(text).ids)


def _tokens(v: _View, ids: list[int]) -> list[str | None]:
    return [v.backend.id_to_token(i) for i in ids]


def _component(spec: Any) -> str:
    """Short human name of a normaliser / pre-tokeniser / ... spec."""
    if spec is None:
        return "none"
    if isinstance(spec, dict):
        kind = spec.get("type", "?")
        for key in ("normalizers", "pretokenizers", "processors", "decoders"):
            if isinstance(spec.get(key), list):
                return f"{kind}[{', '.join(_component(s) for s in spec[key])}]"
        extras = {k: val for k, val in spec.items() if k != "type" and not isinstance(val, (dict, list))}
        return kind + (f"({', '.join(f'{k}={val!r}' for k, val in sorted(extras.items()))})" if extras else "")
    return repr(spec)


def _canonical(key: str, spec: Any) -> Any:
    """Treat components that change nothing as absent (transformers installs such a
    template post-processor when it wraps a tokenizer)."""
    identity = {
        "single": [{"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    }
    if (key == "post_processor" and isinstance(spec, dict) and spec.get("type") == "TemplateProcessing"
            and not spec.get("special_tokens")
            and all(spec.get(k) == v for k, v in identity.items())):
        return None
    return spec


def _model_settings(spec: dict[str, Any]) -> dict[str, Any]:
    model = spec.get("model") or {}
    return {k: val for k, val in model.items() if k not in ("vocab", "merges")}


def _merges(spec: dict[str, Any]) -> list[str] | None:
    merges = (spec.get("model") or {}).get("merges")
    if merges is None:
        return None
    return [" ".join(m) if isinstance(m, list) else str(m) for m in merges]


def _head(items: list[Any]) -> list[Any]:
    return items[:_LISTED]


# --------------------------------------------------------------------------- compare


def compare_tokenizers(
    train_tok: Any, infer_tok: Any, probe_texts: list[str] | tuple[str, ...] | None = None,
    *, max_examples: int = 5,
) -> TokenizerReport:
    """Compare a training and an inference tokenizer field by field and on probe texts.

    Accepts `tokenizers.Tokenizer` objects, transformers fast tokenizers (their backend
    is inspected, plus padding side, pad token, special-token roles and
    `model_max_length`) and paths to ``tokenizer.json`` files. Encodings are compared
    with special tokens added and without truncation or padding, so they show
    tokenisation differences only; truncation and padding are fields of their own.
    """
    train = _view(train_tok, "train_tok")
    infer = _view(infer_tok, "infer_tok")
    probes = list(DEFAULT_PROBE_TEXTS if probe_texts is None else probe_texts)
    if not all(isinstance(t, str) for t in probes):
        raise TypeError("probe_texts must be a list of str")
    diffs: list[TokenizerDifference] = []
    add = diffs.append

    # vocabulary ------------------------------------------------------------------------
    size_t = train.backend.get_vocab_size(with_added_tokens=True)
    size_i = infer.backend.get_vocab_size(with_added_tokens=True)
    if size_t != size_i:
        add(TokenizerDifference("vocab_size", size_t, size_i,
                                f"vocabulary size (added tokens included) is {size_t} for training "
                                f"but {size_i} for inference: the embedding matrix and the ids do not line up."))
    vt, vi = _vocab(train), _vocab(infer)
    only_t = sorted(set(vt) - set(vi), key=lambda t: vt[t])
    only_i = sorted(set(vi) - set(vt), key=lambda t: vi[t])
    if only_t or only_i:
        add(TokenizerDifference("vocab_missing", _head(only_t), _head(only_i),
                                f"{len(only_t)} token(s) exist only in the training vocabulary "
                                f"(e.g. {_head(only_t)[:5]}) and {len(only_i)} only in the inference "
                                f"one (e.g. {_head(only_i)[:5]})."))
    moved = sorted((t for t in set(vt) & set(vi) if vt[t] != vi[t]), key=lambda t: vt[t])
    if moved:
        add(TokenizerDifference("vocab_ids", {t: vt[t] for t in _head(moved)}, {t: vi[t] for t in _head(moved)},
                                f"{len(moved)} token(s) have different ids, e.g. {moved[0]!r}: "
                                f"{vt[moved[0]]} (train) vs {vi[moved[0]]} (infer)."))
    for special, name in ((False, "added_tokens"), (True, "special_tokens")):
        at, ai = _added(train, special), _added(infer, special)
        if at != ai:
            missing_i = sorted(set(at) - set(ai))
            missing_t = sorted(set(ai) - set(at))
            other_id = sorted(t for t in set(at) & set(ai) if at[t] != ai[t])
            parts = []
            if missing_i:
                parts.append(f"only training has {missing_i}")
            if missing_t:
                parts.append(f"only inference has {missing_t}")
            if other_id:
                parts.append("different ids for " + ", ".join(f"{t!r} ({at[t]} vs {ai[t]})" for t in other_id))
            add(TokenizerDifference(name, at, ai, f"{name.replace('_', ' ')} differ: " + "; ".join(parts) + "."))

    # special-token roles (transformers only) ---------------------------------------------
    if train.hf is not None and infer.hf is not None:
        rt = {r: (_s(getattr(train.hf, r, None)), _role_id(train.hf, r)) for r in _ROLES}
        ri = {r: (_s(getattr(infer.hf, r, None)), _role_id(infer.hf, r)) for r in _ROLES}
        changed = [r for r in _ROLES if rt[r] != ri[r]]
        if changed:
            add(TokenizerDifference("special_token_roles", {r: rt[r] for r in changed}, {r: ri[r] for r in changed},
                                    "special-token roles differ: " + ", ".join(
                                        f"{r} {rt[r][0]!r}/{rt[r][1]} vs {ri[r][0]!r}/{ri[r][1]}" for r in changed) + "."))

    # padding and truncation -------------------------------------------------------------
    known_t, side_t, pad_t = _padding(train)
    known_i, side_i, pad_i = _padding(infer)
    # A bare tokenizers.Tokenizer without padding configured says nothing about the side a
    # collator will pad on; compare it only with another bare tokenizer.
    comparable = (known_t and known_i) or (train.hf is None and infer.hf is None)
    if comparable and side_t != side_i:
        add(TokenizerDifference("padding_side", side_t, side_i,
                                f"padding side is {side_t or 'unset (padding disabled)'} for training but "
                                f"{side_i or 'unset (padding disabled)'} for inference: position ids and "
                                f"the last-token pooling of decoder models change."))
    if known_t and known_i and pad_t != pad_i:
        add(TokenizerDifference("pad_token", pad_t, pad_i,
                                f"pad token (token, id) is {pad_t} for training but {pad_i} for inference."))
    tt, ti = _truncation(train), _truncation(infer)
    if tt is None or ti is None:
        trunc_differs = tt != ti
    else:
        common = set(tt) & set(ti)
        trunc_differs = any(tt[k] != ti[k] for k in common)
    if trunc_differs:
        add(TokenizerDifference("truncation", tt, ti,
                                f"truncation is {tt or 'disabled'} for training but {ti or 'disabled'} for inference."))

    # pipeline components ----------------------------------------------------------------
    for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        ct, ci = _canonical(key, train.spec.get(key)), _canonical(key, infer.spec.get(key))
        if ct != ci:
            add(TokenizerDifference(key, ct, ci,
                                    f"{key.replace('_', '-')} is {_component(ct)} for training but "
                                    f"{_component(ci)} for inference."))
    mt, mi = _model_settings(train.spec), _model_settings(infer.spec)
    if mt != mi:
        keys = sorted(k for k in set(mt) | set(mi) if mt.get(k) != mi.get(k))
        add(TokenizerDifference("model", {k: mt.get(k) for k in keys}, {k: mi.get(k) for k in keys},
                                "tokenizer model settings differ: " + ", ".join(
                                    f"{k} {mt.get(k)!r} vs {mi.get(k)!r}" for k in keys) + "."))
    gt, gi = _merges(train.spec), _merges(infer.spec)
    if gt is not None and gi is not None and gt != gi:
        first = next((k for k, (a, b) in enumerate(zip(gt, gi)) if a != b), min(len(gt), len(gi)))
        add(TokenizerDifference("merges", gt[first:first + _LISTED], gi[first:first + _LISTED],
                                f"BPE merges differ ({len(gt)} vs {len(gi)} rules; first difference at "
                                f"rule {first}): the same text splits into different pieces."))

    # encodings of the probe texts ----------------------------------------------------------
    bad_t: dict[str, Any] = {}
    bad_i: dict[str, Any] = {}
    n_bad = 0
    for text in probes:
        et, ei = _encode(train, text), _encode(infer, text)
        if et != ei:
            n_bad += 1
            if len(bad_t) < max_examples:
                bad_t[text] = {"ids": et, "tokens": _tokens(train, et)}
                bad_i[text] = {"ids": ei, "tokens": _tokens(infer, ei)}
    if n_bad:
        text = next(iter(bad_t))
        add(TokenizerDifference("encodings", bad_t, bad_i,
                                f"{n_bad} of {len(probes)} probe texts encode differently; first {text!r}: "
                                f"train {bad_t[text]['tokens']} {bad_t[text]['ids']} vs infer "
                                f"{bad_i[text]['tokens']} {bad_i[text]['ids']}."))
    return TokenizerReport(differences=diffs, probes_compared=len(probes))


def _s(value: Any) -> str | None:
    return None if value is None else str(value)


def _role_id(hf: Any, role: str) -> int | None:
    value = getattr(hf, role, None)
    if value is None:
        return None
    try:
        return int(hf.convert_tokens_to_ids(str(value)))
    except Exception:
        return None
