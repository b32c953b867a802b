"""The mechanisms behind round 8c's fixes and the fixes that followed it (docs/diagnosis.md), each on programs of
other shapes than the held-out rounds'.

A1. A replay tracks the running module with process-wide module hooks filtered by identity
    (``localisation/modules.ModuleStack``): nothing is put on the user's modules, so a module that looks at its
    own hooks (``nn.TransformerEncoderLayer``'s fused inference path) computes in the replay what it computed in
    the real step, and an all-padding text is traced to the fused layer, at step 0 as at a later step.
A2. A fused attention op (``_native_multi_head_attention``, ``_transformer_encoder_layer_fwd``, ``_masked_softmax``,
    the ``scaled_dot_product_attention`` kernels) whose NaN rows are rows its mask operand leaves without any key
    is ``masked_softmax_all``, as the slow path's softmax is (``localisation/attention.masked_rows``).
A3. Nested tensors (``nn.TransformerEncoder``'s inference path packs the padded batch into one) are read through
    their parts (``tracer.nested_parts``): the replay goes on, and a NaN made from the encoder's output by the user's
    pooling is traced there.
B.  A replay that raises the real step's own exception (a gradient hook of the user's refusing a NaN gradient)
    reproduced the step up to its failure: what it traced is the evidence (``localiser.raised_again``), in the
    forward's replay and in the loss code's.
C.  Gradient accumulation: a forward that ran after other code of the step is traced in the step replayed in its
    real order (``loss_replay.replay_step(until=...)``): a model input the loss code made between two micro-batches
    is traced to the op that made it, and a divisor made from an earlier micro-batch keeps its provenance
    (``localiser._in_step_order``, ``_made_in_step``); a ``replayable`` re-run whose origin op read state an
    earlier call stored is diagnosed from the tape (``localiser._origin_read_earlier_state``).

Each program case asserts the first blocking incident's step, kind, phase, op, module, source line, cause and action,
zero-intrusive and with ``guard.replayable``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

import nantrace
from heldout_harness import Judge, Program, assert_diagnosis, case_params, sgd, train
from nantrace.diagnosis.classify import classify
from nantrace.localisation.attention import masked_rows
from nantrace.localisation.localiser import raised_again
from nantrace.localisation.modules import ModuleStack
from nantrace.localisation.origin import trace_back
from nantrace.localisation.tracer import OpTracer, _all_finite, _nan_inf, tensor_stats
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
              pytest.mark.usefixtures("one_thread")]

JUDGE = Judge(__file__)
STEPS = 4
CASES: dict[str, tuple[Callable[[], Program], Want]] = {}


def case(name: str, want: Want) -> Callable[[Callable[[], Program]], Callable[[], Program]]:
    """Register a program case under ``name``."""
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        CASES[name] = (build, want)
        return build

    return register


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _with_bad(batch: Callable[[int, bool], Any], bad_step: int) -> list[Any]:
    """``STEPS`` batches, the one at ``bad_step`` built bad."""
    return [batch(step, step == bad_step) for step in range(STEPS)]


# ======================================================================= A1 + A2: fused encoder layers
class FrozenReviewEncoder(nn.Module):
    """A frozen pretrained encoder kept in eval mode under a trainable regression head (fused fast path), pooled by
    the first token's state; the pre-norm variant and three heads of width 8 differ from r8c's probe."""

    def __init__(self, vocab: int = 50, d: int = 24, heads: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 1)
        self.embed.requires_grad_(False)
        self.encoder.requires_grad_(False)
        self.train()

    def train(self, mode: bool = True) -> FrozenReviewEncoder:
        super().train(mode)
        self.embed.eval()
        self.encoder.eval()
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens), src_key_padding_mask=tokens == 0)  # <origin:review_encoder>
        return self.head(h[:, 0]).squeeze(-1)


def _review_batches(seed: int, bad_step: int) -> list[Any]:
    g = _gen(seed)

    def batch(step: int, bad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(1, 50, (5, 9), generator=g)
        tokens[1, 6:] = 0
        if bad:
            tokens[3] = 0  # a review emptied by the cleaning step
        return tokens, torch.randn(5, generator=g)

    return _with_bad(batch, bad_step)


def _review(bad_step: int) -> Program:
    torch.manual_seed(1)
    model = FrozenReviewEncoder()
    return Program(model, sgd(model.head, 0.05), _review_batches(811, bad_step),
                   lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


for _step in (0, 2):
    case(f"frozen_prenorm_encoder_empty_review_at_step_{_step}",
         Want("nonfinite_loss", "forward", "aten._transformer_encoder_layer_fwd.default", "encoder.layers.0",
              "review_encoder", "masked_softmax_all", step=_step))(lambda s=_step: _review(s))


class FrozenCausalEncoder(nn.Module):
    """A frozen causal encoder (a decoder-only LM used as a feature extractor) fed a LEFT-padded batch: the causal
    mask and the key padding mask merge into one ``(B, H, L, S)`` mask (mask_type 2) that leaves the padding queries
    no key; the user's pooling reads the last token."""

    def __init__(self, vocab: int = 30, d: int = 16, ctx: int = 7) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 2)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(ctx))
        self.tok.requires_grad_(False)
        self.encoder.requires_grad_(False)
        self.train()

    def train(self, mode: bool = True) -> FrozenCausalEncoder:
        super().train(mode)
        self.tok.eval()
        self.encoder.eval()
        return self

    def forward(self, tokens: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.tok(tokens), mask=self.causal, src_key_padding_mask=pad)  # <origin:causal_encoder>
        return self.head(h.mean(1))


@case("frozen_causal_encoder_left_padded_batch_mean_pool",
      Want("nonfinite_loss", "forward", "aten._transformer_encoder_layer_fwd.default", "encoder.layers.0",
           "causal_encoder", "masked_softmax_all", step=2))
def _causal() -> Program:
    torch.manual_seed(2)
    model = FrozenCausalEncoder()
    g = _gen(812)

    def batch(step: int, bad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = torch.randint(1, 30, (4, 7), generator=g)
        pad = torch.zeros(4, 7, dtype=torch.bool)
        pad[2, 5:] = True  # right padding: every query keeps key 0
        if bad:  # a batch from the generation collator: left padding
            pad[2] = False
            pad[2, :3] = True
        tokens[pad] = 0
        return tokens, pad, torch.randint(0, 2, (4,), generator=g)

    return Program(model, sgd(model.head, 0.05), _with_bad(batch, 2),
                   lambda m, b, s: F.cross_entropy(m(b[0], b[1]), b[2]))


# ========================================================== A2: nn.MultiheadAttention's own fast path
class FrozenSessionAttention(nn.Module):
    """A frozen attention over a user's session of items (eval mode: ``_native_multi_head_attention``), summed over
    the items, under a trainable scorer; an empty session is all padding."""

    def __init__(self, items: int = 40, d: int = 12) -> None:
        super().__init__()
        self.items = nn.Embedding(items, d, padding_idx=0)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.score = nn.Linear(d, 1)
        self.items.requires_grad_(False)
        self.attn.requires_grad_(False)
        self.train()

    def train(self, mode: bool = True) -> FrozenSessionAttention:
        super().train(mode)
        self.items.eval()
        self.attn.eval()
        return self

    def forward(self, session: torch.Tensor) -> torch.Tensor:
        x = self.items(session)
        h, _ = self.attn(x, x, x, key_padding_mask=session == 0, need_weights=False)  # <origin:session_attn>
        return self.score(h.sum(1)).squeeze(-1)


@case("frozen_session_attention_empty_session",
      Want("nonfinite_loss", "forward", "aten._native_multi_head_attention.default", "attn", "session_attn",
           "masked_softmax_all", step=1))
def _session() -> Program:
    torch.manual_seed(3)
    model = FrozenSessionAttention()
    g = _gen(813)

    def batch(step: int, bad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        session = torch.randint(1, 40, (6, 5), generator=g)
        session[0, 3:] = 0
        if bad:
            session[4] = 0
        return session, torch.randint(0, 2, (6,), generator=g).float()

    return Program(model, sgd(model.score, 0.05), _with_bad(batch, 1),
                   lambda m, b, s: F.binary_cross_entropy_with_logits(m(b[0]), b[1]))


# ================================================================= A3: a nested-tensor encoder's output
class NestedEncoderPool(nn.Module):
    """A frozen encoder on its default nested-tensor inference path; the user pools its output. ``pool`` is the
    user's choice: a masked mean (0 / 0 at an empty text) or a length-normalised sum whose length is a float count."""

    def __init__(self, pool: str, vocab: int = 30, d: int = 8) -> None:
        super().__init__()
        self.pool = pool
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 3)
        self.head = nn.Linear(d, 3)
        self.embed.requires_grad_(False)
        self.encoder.requires_grad_(False)
        self.train()

    def train(self, mode: bool = True) -> NestedEncoderPool:
        super().train(mode)
        self.embed.eval()
        self.encoder.eval()
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pad = tokens == 0
        h = self.encoder(self.embed(tokens), src_key_padding_mask=pad)
        if self.pool == "mean":
            keep = (~pad).unsqueeze(-1).to(h.dtype)
            pooled = (h * keep).sum(1) / keep.sum(1)  # <origin:nested_mean>
        else:
            lengths = (~pad).sum(1, keepdim=True).to(h.dtype)
            pooled = h.sum(1) * lengths.rsqrt()  # <origin:nested_rsqrt>
        return self.head(pooled)


def _nested(pool: str) -> Program:
    torch.manual_seed(4)
    model = NestedEncoderPool(pool)
    g = _gen(814)

    def batch(step: int, bad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(1, 30, (3, 6), generator=g)
        tokens[0, 4:] = 0
        if bad:
            tokens[2] = 0
        return tokens, torch.randint(0, 3, (3,), generator=g)

    return Program(model, sgd(model.head, 0.05), _with_bad(batch, 2),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


case("nested_encoder_masked_mean_empty_text",
     Want("nonfinite_loss", "forward", "aten.div.Tensor", "", "nested_mean", "div_by_zero", step=2))(
    lambda: _nested("mean"))
case("nested_encoder_rsqrt_length_empty_text",
     Want("nonfinite_loss", "forward", "aten.rsqrt.default", "", "nested_rsqrt", "div_by_zero", step=2))(
    lambda: _nested("rsqrt"))


@pytest.mark.parametrize("name,mode", case_params(CASES, {}))
def test_program_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    assert_diagnosis(train(build(), replayable=mode == "replayable"), want, JUDGE)


# ===================================================================== A1: the module stack, directly
class Probe(nn.Module):
    """Notes the module stack's answer each time it runs."""

    def __init__(self, stack: list[ModuleStack], seen: list[str | None]) -> None:
        super().__init__()
        self.stack, self.seen = stack, seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.stack[0].current)
        return x


def test_module_stack_hooks_nothing_of_the_users_and_names_the_running_module() -> None:
    holder: list[ModuleStack] = []
    seen: list[str | None] = []
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(Probe(holder, seen), nn.ReLU()))
    outsider = Probe(holder, seen)  # not a module of the root
    stack = ModuleStack(model)
    holder.append(stack)
    before = (len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks))
    with stack:
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
        model(torch.ones(1, 3))
        outsider(torch.ones(1))
        assert stack.current is None
    assert seen == ["1.0", None]
    assert (len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks)) == before
    model(torch.ones(1, 3))  # no hook left: the probe sees the stack empty
    assert seen[-1] is None


def test_module_stack_unwinds_a_module_that_raised() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("bad")

    model = nn.Sequential(nn.Identity(), Boom())
    with ModuleStack(model) as stack:
        with pytest.raises(ValueError):
            model(torch.ones(1))
        assert stack.current is None


def test_fused_encoder_layer_stays_on_its_fast_path_under_the_replays_module_stack() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval().requires_grad_(False)
    x = torch.randn(2, 4, 8)
    pad = torch.zeros(2, 4, dtype=torch.bool)
    pad[1] = True
    plain = layer(x, src_key_padding_mask=pad)
    with ModuleStack(layer):
        replayed = layer(x, src_key_padding_mask=pad)
    assert torch.isnan(plain[1]).all()  # the fused path's all-padding row
    assert torch.equal(torch.nan_to_num(plain, 7.0), torch.nan_to_num(replayed, 7.0))


# ============================================================================ A2: the mask rule, directly
def _bad(t: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(t)


def test_masked_rows_reads_each_fused_ops_mask_convention() -> None:
    torch.manual_seed(0)
    scores = torch.randn(2, 3, 4, 4)
    padding = torch.zeros(2, 4, dtype=torch.bool)
    padding[1] = True  # True hides, as for nn.MultiheadAttention
    out = torch._masked_softmax(scores, padding, 3, 1)
    assert masked_rows(torch.ops.aten._masked_softmax.default, (scores, padding, 3, 1), {}, _bad(out)) == (12, 12)
    keep = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    keep[0, :, 2] = False  # True lets the query attend, as for scaled_dot_product_attention
    bad = torch.zeros(2, 3, 4, 8, dtype=torch.bool)
    bad[0, :, 2] = True
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert masked_rows(sdpa, (scores, scores, scores), {"attn_mask": keep}, bad) == (3, 3)
    bad[1, 0, 0] = True  # a NaN row its mask does not hide: no claim that covers it
    assert masked_rows(sdpa, (scores, scores, scores), {"attn_mask": keep}, bad) == (4, 3)
    assert masked_rows(torch.ops.aten.mul.Tensor, (scores, scores), {}, _bad(scores)) is None


def _classified(program: Callable[[], torch.Tensor], root: nn.Module) -> Any:
    """The cause of the first NaN ``program`` makes, replayed under the tracer."""
    tracer = OpTracer(ModuleStack(root), {})
    with torch.no_grad(), tracer.modules, tracer:
        program()
    origin = trace_back(next(r for r in tracer.records if r.out_nan))
    return classify(origin, observed_in="forward", low_precision_finite=None, param_modules={})


@pytest.mark.parametrize("masks", ["key_padding", "causal_and_left_padding"])
def test_multihead_attention_fast_path_fully_masked_rows(masks: str) -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval().requires_grad_(False)
    x = torch.randn(3, 5, 8)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    causal = None
    if masks == "key_padding":
        pad[2] = True
    else:
        pad[1, :2] = True
        causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    got = _classified(lambda: mha(x, x, x, attn_mask=causal, key_padding_mask=pad), mha)
    assert (got.op, got.cause) == ("aten._native_multi_head_attention.default", "masked_softmax_all"), got.detail


def test_a_fused_attention_nan_not_from_its_mask_keeps_another_cause() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval().requires_grad_(False)
    x = torch.randn(2, 4, 8)
    x[0, 1, 3] = 3e38  # an overflow inside the projection, no mask at all
    got = _classified(lambda: mha(x, x, x), mha)
    assert got.cause != "masked_softmax_all", got.detail


# =========================================================================== A3: nested tensors, directly
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_tensors_are_checked_through_their_parts(layout: torch.layout) -> None:
    a, b = torch.tensor([[1.0, -4.0], [9.0, 16.0]]), torch.tensor([[-1.0, 4.0]])
    nested = torch.nested.nested_tensor([a, b], layout=layout)
    assert _all_finite(nested) and _nan_inf(nested) == (False, False)
    tracer = OpTracer(ModuleStack(nn.Identity()), {})
    with tracer.modules, tracer:
        root = nested.sqrt()
        _ = root * 2.0
    assert _nan_inf(root) == (True, False)
    origin = trace_back(tracer.records[-1])
    got = classify(origin, observed_in="forward", low_precision_finite=None, param_modules={})
    assert (got.op, got.cause) == ("aten.sqrt.default", "sqrt_negative"), got.detail
    assert tensor_stats(nested, "x")["negatives"] == 2


# ============================================== B. a replay that raises the real step's own exception again
def _refuse_nonfinite(grad: torch.Tensor) -> None:
    """The user's own check, registered as a gradient hook: refuse a non-finite gradient."""
    if not torch.isfinite(grad).all():
        raise RuntimeError("non-finite gradient refused")


class AngleHead(nn.Module):
    """Predicts an angle as ``acos`` of a ``tanh``-squashed cosine: a far-out input saturates tanh to exactly 1,
    where acos's derivative is infinite (and tanh's 0: 0 * inf is NaN in the weights' gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos = torch.tanh(self.proj(x).squeeze(-1))
        return torch.acos(cos)  # <origin:angle_acos>


def _angle_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(900 + step)
    x = torch.randn(6, 5, generator=g) * 0.5
    if step == 2:
        x[3] = 100.0  # an unscaled sensor row: tanh rounds to exactly 1
    return x, torch.rand(6, generator=g)


class DistanceRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _self_supervised_distance(model: nn.Module, batch: Any) -> torch.Tensor:
    """Unlabelled rows supervise themselves (their target is the detached prediction): distance exactly 0, and
    sqrt's derivative there is infinite. The user checks the model output's gradient with a hook."""
    x, y, labelled = batch
    out = model(x)
    out.register_hook(_refuse_nonfinite)
    y = torch.where(labelled[:, None], y, out.detach())
    return torch.sqrt(((out - y) ** 2).sum(-1)).mean()  # <origin:self_distance>


def _distance_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(950 + step)
    labelled = torch.ones(5, dtype=torch.bool)
    if step == 2:
        labelled[1] = False
    return torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g), labelled


def _hooked_loop(model: nn.Module, loss_of: Callable[[nn.Module, Any], torch.Tensor], batch: Callable[[int], Any],
                 *, replayable: bool) -> tuple[list[Any], list[str]]:
    """A loop whose backward a gradient hook may stop: it logs the error and goes on with the next batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    loss_fn = guard.replayable(loss_of) if replayable else loss_of
    raised: list[str] = []
    try:
        for step in range(STEPS):
            opt.zero_grad()
            try:
                loss_fn(model, batch(step)).backward()
                opt.step()
            except RuntimeError as exc:
                raised.append(f"{step}: {exc}")
    finally:
        guard.close()
    return list(guard.incidents), raised


def _angle_head() -> AngleHead:
    """The head with fixed weights (a positive sum: the far-out row saturates at +1)."""
    model = AngleHead()
    with torch.no_grad():
        model.proj.weight.copy_(torch.tensor([[0.3, 0.2, -0.1, 0.25, 0.15]]))
        model.proj.bias.zero_()
    return model


def _angle_model() -> nn.Module:
    model = _angle_head()
    for p in model.parameters():
        p.register_hook(_refuse_nonfinite)
    return model


B_CASES: dict[str, tuple[Callable[[], nn.Module], Callable, Callable, str, str | None, str]] = {
    "parameter_hooks_acos_at_one": (_angle_model, lambda m, b: F.mse_loss(m(b[0]), b[1]), _angle_batch,
                                    "aten.acos.default", "", "angle_acos"),
    "output_hook_in_loss_code_sqrt_at_zero": (lambda: (torch.manual_seed(6), DistanceRegressor())[1],
                                              _self_supervised_distance, _distance_batch, "aten.sqrt.default", None,
                                              "self_distance"),
}


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_intrusive", "replayable"])
@pytest.mark.parametrize("name", sorted(B_CASES))
def test_a_replay_raising_the_steps_own_exception_is_evidence(name: str, replayable: bool) -> None:
    make, loss_of, batch, op, module, tag = B_CASES[name]
    incidents, raised = _hooked_loop(make(), loss_of, batch, replayable=replayable)
    assert raised == ["2: non-finite gradient refused"]
    first = incidents[0]
    assert (first.step, first.kind, first.phase, first.op, first.module, first.cause, first.action) == \
        (2, "exception", "backward", op, module, "grad_singularity", "raised"), first.summary
    assert JUDGE.line(first.source) == JUDGE.marked(tag)
    assert first.details["replay_raised_again"] == "RuntimeError: non-finite gradient refused"
    assert "not_replayable" not in first.details


def test_a_replay_raising_another_exception_is_still_not_replayable() -> None:
    calls = [0]

    def refuse_counting(grad: torch.Tensor) -> None:  # its message changes with every call: never the same twice
        calls[0] += 1
        if not torch.isfinite(grad).all():
            raise RuntimeError(f"non-finite gradient refused (call {calls[0]})")

    model = _angle_head()
    model.proj.weight.register_hook(refuse_counting)
    incidents, raised = _hooked_loop(model, lambda m, b: F.mse_loss(m(b[0]), b[1]), _angle_batch, replayable=False)
    assert len(raised) == 1 and raised[0].startswith("2: non-finite gradient refused")
    assert incidents[0].kind == "exception" and "not_replayable" in incidents[0].details
    assert "replay_raised_again" not in incidents[0].details


def test_raised_again_compares_type_and_message() -> None:
    assert raised_again(RuntimeError("gradient contains nan"), RuntimeError("gradient contains nan"))
    assert not raised_again(ValueError("gradient contains nan"), RuntimeError("gradient contains nan"))
    assert not raised_again(RuntimeError("gradient contains inf"), RuntimeError("gradient contains nan"))
    assert not raised_again(RuntimeError("x"), None) and not raised_again(None, RuntimeError("x"))


# ==================================== C. gradient accumulation: the step replayed in its real order
class CountShares:
    """Event counts of each micro-batch turned into shares of the previous micro-batch's column totals (computed in
    the loss code after that micro-batch's forward): a column the previous micro-batch never saw divides by 0."""

    def __init__(self) -> None:
        self.totals: torch.Tensor | None = None

    def __call__(self, model: nn.Module, micro: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        x, y = micro
        z = x if self.totals is None else x / self.totals  # <origin:count_shares>
        self.totals = x.sum(0)
        return F.mse_loss(model(z).squeeze(-1), y)


def _count_micro(g: torch.Generator, dead: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(1, 6, (4, 5), generator=g).float()
    if dead:
        x[:, 3] = 0.0  # a sensor that reported nothing in this micro-batch
    return x, torch.randn(4, generator=g)


class RunningStandardizer:
    """Three micro-batches a step: each standardised by the std of the one before it (its own must not leak in)."""

    def __init__(self) -> None:
        self.mean: torch.Tensor | None = None
        self.std: torch.Tensor | None = None

    def __call__(self, model: nn.Module, micro: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        x, y = micro
        z = x if self.mean is None else (x - self.mean) / self.std  # <origin:running_std>
        self.mean, self.std = x.mean(0), x.std(0)
        return F.binary_cross_entropy_with_logits(model(z).squeeze(-1), y)


def _sensor_micro(g: torch.Generator, stuck: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = 1.0 + torch.randn(6, 4, generator=g)
    if stuck:
        x[:, 0] = -2.0  # a stuck sensor: its column is constant
    return x, (torch.rand(6, generator=g) < 0.5).float()


def _accumulated(loss: Callable, micro: Callable[[torch.Generator, bool], Any], micros: int, bad_micro: int,
                 d: int, seed: int) -> Program:
    """An MLP trained with ``micros`` micro-batches a step; at step 2 micro-batch ``bad_micro`` is built bad."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d, 12), nn.Tanh(), nn.Linear(12, 1))
    g = _gen(seed)
    batches = [[micro(g, step == 2 and index == bad_micro) for index in range(micros)] for step in range(STEPS)]
    return Program(model, sgd(model, 0.02), batches, loss, accum=True)


class CalibratedScorer(nn.Module):
    """A scorer whose calibration layer divides its logits by a spread handed to the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
        self.calib = Calibration()

    def forward(self, x: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
        return self.calib(self.body(x), spread)


class Calibration(nn.Module):
    def forward(self, logits: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
        return (logits - logits.mean(0)) / spread  # <origin:calib_div>


class SpreadFromFirstMicro:
    """The first micro-batch of a step is scored with spread 1, and the per-class std of its logits is the spread
    the later micro-batches are scored with (the loss object keeps it)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.spread = torch.ones(3)

    def __call__(self, model: nn.Module, micro: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        x, y = micro
        if self.step != step:
            self.step = step
            logits = model(x, torch.ones(3))
            self.spread = logits.detach().std(0)
        else:
            logits = model(x, self.spread)
        return F.cross_entropy(logits, y)


def _spread() -> Program:
    torch.manual_seed(8)
    model = CalibratedScorer()
    g = _gen(880)

    def micro(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(5, 6, generator=g)
        if step == 2 and index == 0:
            x[:] = x[2]  # the sampler repeated one record
        return x, torch.randint(0, 3, (5,), generator=g)

    return Program(model, sgd(model, 0.05), [[micro(s, i) for i in range(3)] for s in range(STEPS)],
                   SpreadFromFirstMicro(), accum=True)


class WhitenedEncoder(nn.Module):
    """Returns its logits and its features; the features are whitened by a per-dimension scale handed to the forward
    (the loss code's std of the previous micro-batch's features)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.enc(x)
        return self.head(h / scale).squeeze(-1), h  # <origin:whiten_div>


class PreviousFeatureScale:
    """Three micro-batches a step: each later one is whitened by the std of the previous one's features."""

    def __init__(self) -> None:
        self.scale = torch.ones(6)

    def __call__(self, model: nn.Module, micro: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        x, y = micro
        logits, h = model(x, self.scale)
        self.scale = h.detach().std(0)
        return F.binary_cross_entropy_with_logits(logits, y)


def _whitened() -> Program:
    torch.manual_seed(9)
    model = WhitenedEncoder()
    g = _gen(890)

    def micro(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(6, 4, generator=g)
        if step == 2 and index == 1:
            x[:] = x[0]  # a repeated record: every feature constant over the micro-batch
        return x, (torch.rand(6, generator=g) < 0.5).float()

    return Program(model, sgd(model, 0.05), [[micro(s, i) for i in range(3)] for s in range(STEPS)],
                   PreviousFeatureScale(), accum=True)


C_CASES: dict[str, tuple[Callable[[], Program], Want]] = {
    "input_shares_of_previous_micro_batch_totals": (
        lambda: _accumulated(CountShares(), _count_micro, 2, 0, 5, 860),
        Want("nonfinite_input", "forward", "aten.div.Tensor", None, "count_shares", "div_by_zero", step=2)),
    "input_standardised_by_previous_of_three_micro_batches": (
        lambda: _accumulated(RunningStandardizer(), _sensor_micro, 3, 1, 4, 870),
        Want("nonfinite_input", "forward", "aten.div.Tensor", None, "running_std", "zero_variance_norm", step=2)),
    "spread_of_first_micro_batch_divides_in_a_submodule": (
        _spread, Want("nonfinite_loss", "forward", "aten.div.Tensor", "calib", "calib_div", "zero_variance_norm",
                      step=2)),
    "feature_scale_from_previous_of_three_micro_batches": (
        _whitened, Want("nonfinite_loss", "forward", "aten.div.Tensor", "", "whiten_div", "zero_variance_norm",
                        step=2)),
}


@pytest.mark.parametrize("name,mode", case_params(C_CASES, {}))
def test_accumulation_is_traced_in_the_steps_real_order(name: str, mode: str) -> None:
    build, want = C_CASES[name]
    assert_diagnosis(train(build(), replayable=mode == "replayable"), want, JUDGE)
