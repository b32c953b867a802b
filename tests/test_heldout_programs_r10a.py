"""Held-out failures, round 10a: failure patterns taken from PUBLIC BUG REPORTS about NaN/Inf in PyTorch
training. Each case is a small stand-alone program shaped like the reporter's (their kind of model, loss and
loop; no code copied), and its docstring names the report it was shaped after.

Covered: forward-origin NaN/Inf in the LOSS CODE written outside the model (a pointer-generator's log of a
zero final probability, YOLOv1's sqrt of a raw predicted width, MAPE over a zero-sales day, a float16 model's
sum-of-squares reduction), forward origins in the MODEL (Glow's ``log(det W)`` at a reflection
initialisation, a text CNN's masked max-pool of an empty document read by a Linear layer), backward-only
NaNs (a hand-written CTC whose ``logsumexp`` meets an unreachable state, a colour loss whose ``torch.where``
hides a fractional power of a negative value, a GraphSAGE mean aggregator guarded by ``torch.where``),
failures that RAISE (``torch.multinomial`` in scheduled sampling on NaN probabilities, numpy's
``Generator.choice`` on NaN negative-sampling weights), an optimizer-step failure (centered RMSprop whose
variance estimate goes negative by rounding under a constant gradient) and three QUIET programs that look
suspicious but are correct (``scaled_dot_product_attention`` with a fully padded document, a float16
``gelu_new`` whose cubic term overflows but saturates the tanh, action masking done right).

How expectations were derived: each ``Want`` was written from the construction before nantrace ran, from
shared/API.md's fields and cause table and docs/diagnosis.md's origin rule (follow the NaN back to the op
that created it; if that op received an infinity created by an op from finite values, that op; a ``-inf``
fill or constant is intentional, and then the NaN-creating op is the origin; a value made non-finite in a
branch that ``torch.where`` drops is ``where_gradient_trap``, phase ``forward``; a backward origin is named
by the forward op whose derivative made the first non-finite gradient). ``test_cases_fail_without_nantrace``
checks every construction with plain torch and an oracle written here (``FirstBad``: a TorchDispatchMode
naming the first op that made a NaN from NaN-free inputs or a non-finite value from finite inputs, explicit
infinite constants excepted, with this file's line and the watched module running; for a backward origin
the autograd node and where its forward ran; the optimizer step runs under it too). The one step number
not fixed by the data (the centered RMSprop case) was computed from the plain run, by that test.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from heldout_harness import Judge, Program, assert_diagnosis, case_params, describe, run_step, train
from origin_markers import origin_line
from test_programs import FAIL_STEP, Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

HERE = os.path.abspath(__file__)
JUDGE = Judge(__file__)

CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
QUIET: dict[str, Callable[[], Program]] = {}
_CTC = "keyword_spotter_hand_written_ctc_first_three_word_command_logsumexp"
XFAIL: dict[str, str] = {}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""
ORACLE_MODULE = {"graphsage_mean_aggregator_where_guard_isolated_node": "conv1"}
"""Where the oracle (forward birth order) names another module than the contract's gradient rule."""
QUIET_XFAIL: dict[str, str] = {}


def case(name: str, want: Want) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in CASES, name
        CASES[name] = (build, want)
        return build

    return register


def quiet(name: str) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        QUIET[name] = build
        return build

    return register


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ====================================================================== 1. loss code, forward
# 1a. abisee/pointer-generator#4 ("NaN loss after 35k steps": the culprit is log(final_dist)). A
#     pointer-generator summariser: the final distribution over the extended vocabulary is
#     p_gen * P_vocab (zero on the article's OOV slots) + (1 - p_gen) * attention scattered onto the
#     source ids. A target OOV id that is not in this article's source (the collator took it from the
#     neighbouring article's OOV list) gets probability exactly 0: log(0) = -inf, loss inf.
class PointerGenerator(nn.Module):
    def __init__(self, vocab: int = 20, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.GRU(dim, dim, batch_first=True)
        self.decoder = nn.GRU(dim, dim, batch_first=True)
        self.out = nn.Linear(2 * dim, vocab)
        self.gen = nn.Linear(2 * dim, 1)

    def forward(self, src: torch.Tensor, dec_in: torch.Tensor) -> tuple[torch.Tensor, ...]:
        enc, h = self.encoder(self.embed(src))
        dec, _ = self.decoder(self.embed(dec_in), h)
        attn = torch.softmax(dec @ enc.transpose(1, 2), dim=-1)
        ctx = torch.cat([dec, attn @ enc], dim=-1)
        return torch.softmax(self.out(ctx), dim=-1), attn, torch.sigmoid(self.gen(ctx))


def _pointer_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    src, src_ext, dec_in, target_ext, n_oov = batch
    vocab_dist, attn, p_gen = model(src, dec_in)
    extra = torch.zeros(vocab_dist.shape[0], vocab_dist.shape[1], n_oov)
    final = torch.cat([p_gen * vocab_dist, extra], dim=-1)
    index = src_ext[:, None, :].expand(-1, attn.shape[1], -1)
    final = final.scatter_add(2, index, (1 - p_gen) * attn)
    gold = final.gather(2, target_ext[..., None]).squeeze(-1)
    return -torch.log(gold).mean()  # <origin:ptr_log>


@case("pointer_generator_target_oov_id_not_in_article_log_zero",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "ptr_log", "log_nonpositive"))
def _pointer_generator() -> Program:
    torch.manual_seed(0)
    model = PointerGenerator()
    g = _gen(101)

    def batch(s: int) -> Any:
        src = torch.randint(1, 20, (4, 10), generator=g)
        src_ext = src.clone()
        src_ext[:, 3] = 20  # the article's one OOV word (id 20 of the extended vocabulary), UNK (0) for the encoder
        src[:, 3] = 0
        dec_in = torch.randint(1, 20, (4, 6), generator=g)
        target = torch.randint(1, 20, (4, 6), generator=g)
        target[:, 2] = 20  # copied from the article
        if s == FAIL_STEP:
            target[1, 4] = 21  # an OOV id of the other article's list: in neither P_vocab nor this source
        return src, src_ext, dec_in, target, 2

    return Program(model, torch.optim.Adagrad(model.parameters(), lr=0.15), [batch(s) for s in range(5)],
                   _pointer_loss)


# 1b. DeepBaksuVision/You_Only_Look_Once#7 (YOLOv1 loss: "taking the sqrt gives nan for a negative
#     sign"). The head regresses (x, y, w, h, conf) per cell with no activation; the coordinate loss
#     takes sqrt(w), sqrt(h) of the prediction, as the paper writes it. A high-contrast image drives a
#     raw w below 0: sqrt of a negative, NaN loss.
class TinyYolo(nn.Module):
    def __init__(self, cells: int = 2) -> None:
        super().__init__()
        self.cells = cells
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.LeakyReLU(0.1), nn.AdaptiveAvgPool2d(4),
                                      nn.Flatten())
        self.head = nn.Linear(8 * 16, cells * cells * 5)
        with torch.no_grad():
            self.head.bias.view(cells, cells, 5)[..., 2:4] = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x)).view(-1, self.cells, self.cells, 5)


def _yolo_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    images, boxes = batch
    pred = model(images)
    xy_loss = ((pred[..., 0:2] - boxes[..., 0:2]) ** 2).sum()
    wh_loss = ((torch.sqrt(pred[..., 2:4]) - torch.sqrt(boxes[..., 2:4])) ** 2).sum()  # <origin:yolo_sqrt>
    conf_loss = ((pred[..., 4] - 1.0) ** 2).sum()
    return (5.0 * (xy_loss + wh_loss) + conf_loss) / len(images)


@case("yolov1_sqrt_of_raw_predicted_width_high_contrast_image",
      Want("nonfinite_loss", "forward", "aten.sqrt.default", None, "yolo_sqrt", "sqrt_negative"))
def _yolo() -> Program:
    torch.manual_seed(1)
    model = TinyYolo()
    g = _gen(102)

    def batch(s: int) -> Any:
        images = 0.05 * torch.randn(4, 3, 8, 8, generator=g)
        if s == FAIL_STEP:
            images[2] = 40.0 * torch.randn(3, 8, 8, generator=g)  # an over-exposed frame in raw units
        boxes = torch.rand(4, 2, 2, 4, generator=g) * 0.5 + 0.25
        return images, boxes

    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-3), [batch(s) for s in range(5)], _yolo_loss)


# 1c. LibCity/Bigscity-LibCity#219 ("MAPE is inf because the ground truth has zeros") and
#     keras-team/keras#2908: a demand forecaster trained directly on MAPE; a store closed for a day
#     has zero sales, |e| / 0 = inf.
class DemandForecaster(nn.Module):
    def __init__(self, window: int = 14) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(window, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(self.net(x)).squeeze(-1)


def _mape_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    history, sales = batch
    pred = model(history)
    ape = (pred - sales).abs() / sales.abs()  # <origin:mape_div>
    return 100.0 * ape.mean()


@case("demand_forecast_mape_loss_store_closed_zero_sales",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "mape_div", "div_by_zero"))
def _mape() -> Program:
    torch.manual_seed(2)
    model = DemandForecaster()
    g = _gen(103)

    def batch(s: int) -> Any:
        history = 1.0 + torch.rand(16, 14, generator=g)
        sales = 1.0 + torch.rand(16, generator=g)
        if s == FAIL_STEP:
            sales[5] = 0.0  # closed on a public holiday
        return history, sales

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), [batch(s) for s in range(5)], _mape_loss)


# 1d. karpathy/nanoGPT#136 (NaN loss on a V100 with float16 instead of bfloat16): the whole model cast
#     with .half() and no GradScaler/autocast, a regression on house prices in thousands. Every
#     squared error fits float16 (< 65504), their sum over a batch of an expensive district does not:
#     the float16 reduction is inf; in float32 it is ~3e5.
class PriceRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def _fp16_sum_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, price = batch
    err = model(x) - price
    return (err * err).sum() / len(price)  # <origin:fp16_sum>


@case("half_model_without_scaler_sum_of_squared_errors_expensive_district",
      Want("nonfinite_loss", "forward", "aten.sum.default", None, "fp16_sum", "precision_overflow"))
def _fp16_sum() -> Program:
    torch.manual_seed(3)
    model = PriceRegressor().half()
    g = _gen(104)

    def batch(s: int) -> Any:
        x = torch.randn(32, 8, generator=g).half()
        price = (2.0 + torch.rand(32, generator=g)).half()  # in units of 100k
        if s == FAIL_STEP:
            price = (100.0 + 20.0 * torch.rand(32, generator=g)).half()  # a district quoted in thousands
        return x, price

    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-4), [batch(s) for s in range(5)],
                   _fp16_sum_loss)


# ====================================================================== 2. model, forward
# 2a. jaywalnut310/glow-tts#17 (logdet vs slogdet in Inv1x1Conv: "if the det of the weight is always
#     positive, logdet is also okay"; the author initialises det > 0) and chaiyujin/glow-pytorch#7. A
#     Glow on 4-d vectors whose invertible 1x1 convolution is initialised with a random rotation from
#     QR, and whose log-determinant is log(det W). LAPACK's Householder QR of a 4 x 4 Gaussian returns a
#     reflection (det Q = -1) at every draw (why glow-tts flips a column at init): log(-1) = NaN in
#     the first flow step, at the first step.
class InvConv(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linalg.qr(torch.randn(c, c))[0])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logdet = torch.log(torch.det(self.weight))  # <origin:glow_logdet>
        return x @ self.weight.t(), logdet.expand(x.shape[0])


class Coupling(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(c // 2, 16), nn.Tanh(), nn.Linear(16, c))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = x.chunk(2, dim=-1)
        log_s, t = self.net(a).chunk(2, dim=-1)
        log_s = torch.tanh(log_s)
        return torch.cat([a, b * log_s.exp() + t], dim=-1), log_s.sum(-1)


class FlowStep(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.invconv = InvConv(c)
        self.coupling = Coupling(c)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, ld1 = self.invconv(x)
        x, ld2 = self.coupling(x)
        return x, ld1 + ld2


class Glow(nn.Module):
    def __init__(self, c: int = 4, steps: int = 2) -> None:
        super().__init__()
        self.flows = nn.ModuleList(FlowStep(c) for _ in range(steps))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logdet = torch.zeros(x.shape[0])
        for f in self.flows:
            x, ld = f(x)
            logdet = logdet + ld
        return x, logdet


def _glow_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    z, logdet = model(batch)
    log_pz = -0.5 * (z ** 2).sum(-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)
    return -(log_pz + logdet).mean()


@case("glow_invconv_log_det_reflection_initialisation",
      Want("nonfinite_loss", "forward", "aten.log.default", "flows.0.invconv", "glow_logdet", "log_nonpositive",
           step=0))
def _glow() -> Program:
    torch.manual_seed(14)
    model = Glow()
    g = _gen(105)
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                   [torch.randn(32, 4, generator=g) for _ in range(5)], _glow_loss)


# 2b. A masked max-pool over time (InferSent / text-CNN style: padding set to -inf before the max so that
#     it never wins). An empty document (all padding after the tokenizer dropped unknown symbols) pools
#     to -inf in every channel, and the classifier's Linear sums -inf * w over channels of both signs:
#     +inf + -inf = NaN. The -inf is the user's own fill (intentional), so the NaN-making op is the origin.
#     Shaped after pytorch/pytorch#24816 / PR #131060's discussion of fully masked rows.
class TextCNN(nn.Module):
    def __init__(self, vocab: int = 30, dim: int = 16, channels: int = 12, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.conv = nn.Conv1d(dim, channels, 3, padding=1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(self.embed(tokens).transpose(1, 2)))
        h = h.masked_fill((tokens == 0)[:, None, :], float("-inf"))
        pooled = h.max(dim=-1).values
        return self.fc(pooled)  # <origin:maxpool_fc>


@case("text_cnn_masked_max_pool_empty_document_linear_inf_minus_inf",
      Want("nonfinite_loss", "forward", "aten.addmm.default", "fc", "maxpool_fc", "inf_arithmetic"))
def _text_cnn() -> Program:
    torch.manual_seed(4)
    model = TextCNN()
    g = _gen(106)

    def batch(s: int) -> Any:
        tokens = torch.randint(1, 30, (8, 12), generator=g)
        tokens[:, 9:] = 0
        if s == FAIL_STEP:
            tokens[6] = 0  # a review that was only emoji: nothing left after tokenisation
        return tokens, torch.randint(0, 3, (8,), generator=g)

    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), [batch(s) for s in range(5)],
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# ====================================================================== 3. backward-only
# 3a. pytorch/pytorch#31829 (a hand-written CTC: "torch.logsumexp produces nan gradient if all inputs
#     happen to be -inf"). A keyword spotter trained on one-word commands with a CTC written in log
#     space; alpha starts at -inf for every state but the first two. One-label targets never put a
#     state whose three predecessors are all -inf into the recursion; the first three-word command
#     ("turn lights off") does: at t = 2 the last states' predecessors are still unreachable (-inf made
#     by the recursion from t = 1 on, so on the gradient path), their logsumexp is -inf (the loss is
#     finite), and its derivative exp(-inf - (-inf)) is NaN. (At t = 1 the same happens, but there the
#     -inf entries are the constant initialisation, and the NaN gradient goes nowhere.)
class KeywordSpotter(nn.Module):
    def __init__(self, feats: int = 10, classes: int = 6) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(feats, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).log_softmax(-1)


def _ctc_nll(lp: torch.Tensor, target: list[int]) -> torch.Tensor:
    ext = [0]
    for c in target:
        ext += [c, 0]
    ext_t = torch.tensor(ext)
    skip = torch.tensor([s >= 2 and ext[s] != 0 and ext[s] != ext[s - 2] for s in range(len(ext))])
    minus_inf = torch.full((len(ext),), float("-inf"))
    alpha = torch.cat([lp[0, ext_t[:2]], minus_inf[2:]])
    for t in range(1, lp.shape[0]):
        one = torch.cat([minus_inf[:1], alpha[:-1]])
        two = torch.where(skip, torch.cat([minus_inf[:2], alpha[:-2]]), minus_inf)
        alpha = torch.logsumexp(torch.stack([alpha, one, two]), dim=0) + lp[t, ext_t]  # <origin:ctc_lse>
    return -torch.logsumexp(alpha[-2:], dim=0)


def _ctc_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    feats, targets = batch
    lp = model(feats)
    return torch.stack([_ctc_nll(lp[i], targets[i]) for i in range(len(targets))]).mean()


@case("keyword_spotter_hand_written_ctc_first_three_word_command_logsumexp",
      Want("nonfinite_grad", "backward", "aten.logsumexp.default", None, "ctc_lse", "masked_softmax_all"))
def _ctc() -> Program:
    torch.manual_seed(5)
    model = KeywordSpotter()
    g = _gen(107)

    def batch(s: int) -> Any:
        targets = [[int(torch.randint(1, 6, (), generator=g))] for _ in range(3)]
        if s == FAIL_STEP:
            targets[1] = [4, 3, 5]  # "turn lights off"
        return torch.randn(3, 8, 10, generator=g), targets

    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), [batch(s) for s in range(5)], _ctc_loss)


# 3b. Colour (CIE-Lab) loss of an image-enhancement net, written as in the sRGB standard with
#     torch.where for the piecewise gamma (kornia/kornia's rgb_to_lab reports; the general torch.where
#     trap is pytorch/pytorch#68425). The net has no output sigmoid; on an under-exposed frame a pixel
#     comes out below -0.055, ((c + 0.055) / 1.055) ** 2.4 of a negative base is NaN in the branch the
#     where drops: the loss is finite, the gradient NaN.
class EnhanceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def _srgb_to_lab(rgb: torch.Tensor) -> torch.Tensor:
    lin = torch.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)  # <origin:lab_pow>
    m = torch.tensor([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]])
    xyz = torch.einsum("ij,bjhw->bihw", m, lin) / torch.tensor([0.9505, 1.0, 1.089])[:, None, None]
    f = torch.where(xyz > 0.008856, xyz.clamp(min=0.008856) ** (1 / 3), 7.787 * xyz + 16 / 116)
    return torch.stack([116 * f[:, 1] - 16, 500 * (f[:, 0] - f[:, 1]), 200 * (f[:, 1] - f[:, 2])], dim=1)


def _lab_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    low, high = batch
    out = model(low)
    return F.l1_loss(out, high) + 0.01 * F.l1_loss(_srgb_to_lab(out), _srgb_to_lab(high))


@case("enhancement_lab_colour_loss_where_gamma_negative_pixel",
      Want("nonfinite_grad", "forward", "aten.pow.Tensor_Scalar", None, "lab_pow", "where_gradient_trap"))
def _lab() -> Program:
    torch.manual_seed(6)
    model = EnhanceNet()
    g = _gen(108)

    def batch(s: int) -> Any:
        high = 0.3 + 0.4 * torch.rand(2, 3, 8, 8, generator=g)
        low = 0.5 * high
        if s == FAIL_STEP:
            low[1, :, 2, 3] = -0.3  # a sensor's black-level offset subtracted twice: below zero
        return low, high

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), [batch(s) for s in range(5)], _lab_loss)


# 3c. A GraphSAGE mean aggregator that guards isolated nodes with torch.where(deg > 0, sum / deg, 0)
#     (pytorch/pytorch#68425: "torch.where gives NaN gradient though the NaN branch is not selected"). A
#     sampled mini-batch with an isolated node computes 0 / 0 in the dropped branch: finite forward,
#     NaN gradient. Both layers trap at the same node; the module is the one whose derivative made the
#     first non-finite gradient (docs/diagnosis.md: "the rule starts from the first backward op whose
#     non-finite output reached what was observed"): conv2, whose backward runs first. (Written first as
#     conv1, the forward birth order, which is what the oracle below sees: ORACLE_MODULE.)
class SageLayer(nn.Module):
    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.self_lin = nn.Linear(dim_in, dim_out)
        self.neigh_lin = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        deg = adj.sum(-1, keepdim=True)
        summed = adj @ x
        mean = torch.where(deg > 0, summed / deg, torch.zeros_like(summed))  # <origin:sage_div>
        return self.self_lin(x) + self.neigh_lin(mean)


class GraphSage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = SageLayer(8, 16)
        self.conv2 = SageLayer(16, 3)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return self.conv2(F.relu(self.conv1(x, adj)), adj)


@case("graphsage_mean_aggregator_where_guard_isolated_node",
      Want("nonfinite_grad", "forward", "aten.div.Tensor", "conv2", "sage_div", "where_gradient_trap"))
def _sage() -> Program:
    torch.manual_seed(7)
    model = GraphSage()
    g = _gen(109)

    def batch(s: int) -> Any:
        adj = (torch.rand(10, 10, generator=g) < 0.4).float()
        adj = ((adj + adj.t()) > 0).float().fill_diagonal_(0)
        adj[adj.sum(-1) == 0, 0] = 1.0
        adj[0, adj[:, 0] > 0] = 1.0
        adj.fill_diagonal_(0)
        if s == FAIL_STEP:
            adj[7, :] = 0.0  # the sampler kept a node but none of its neighbours
            adj[:, 7] = 0.0
        return torch.randn(10, 8, generator=g), adj, torch.randint(0, 3, (10,), generator=g)

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-2), [batch(s) for s in range(5)],
                   lambda m, b, s: F.cross_entropy(m(b[0], b[1]), b[2]))


# ====================================================================== 4. raising
# 4a. YehLi/xmodaler#48 ("During training ... torch.multinomial(prob_prev, 1) ... RuntimeError:
#     probability tensor contains either inf, nan or element < 0"). An attention captioner with
#     scheduled sampling inside its forward; region features are padded and masked with -inf; an image
#     on which the detector found no region leaves the attention a fully masked row: softmax NaN, the
#     word distribution NaN, and the sampler raises at the next word.
class RegionAttention(nn.Module):
    def __init__(self, feat: int, hidden: int) -> None:
        super().__init__()
        self.query = nn.Linear(hidden, feat)

    def forward(self, regions: torch.Tensor, mask: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        scores = (regions @ self.query(h)[:, :, None]).squeeze(-1)
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # <origin:cap_softmax>
        return (weights[:, :, None] * regions).sum(1)


class Captioner(nn.Module):
    def __init__(self, vocab: int = 15, feat: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.hidden = hidden
        self.word = nn.Embedding(vocab, hidden)
        self.attention = RegionAttention(feat, hidden)
        self.cell = nn.LSTMCell(hidden + feat, hidden)
        self.logit = nn.Linear(hidden, vocab)

    def forward(self, regions: torch.Tensor, mask: torch.Tensor, captions: torch.Tensor,
                ss_prob: float = 0.25) -> torch.Tensor:
        b = regions.shape[0]
        h, c = torch.zeros(b, self.hidden), torch.zeros(b, self.hidden)
        outputs, word = [], captions[:, 0]
        for t in range(captions.shape[1] - 1):
            if t > 0:
                word = captions[:, t]
                if ss_prob > 0:  # scheduled sampling: feed the model's own sample for some sentences
                    sampled = torch.multinomial(outputs[-1].detach().softmax(-1), 1).squeeze(1)
                    use = torch.arange(b) % 4 == 0
                    word = torch.where(use, sampled, word)
            ctx = self.attention(regions, mask, h)
            h, c = self.cell(torch.cat([self.word(word), ctx], dim=-1), (h, c))
            outputs.append(self.logit(h))
        return torch.stack(outputs, dim=1)


def _caption_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    regions, mask, captions = batch
    logits = model(regions, mask, captions)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), captions[:, 1:].reshape(-1))


@case("captioner_scheduled_sampling_multinomial_image_without_regions",
      Want("exception", "forward", "aten._softmax.default", "attention", "cap_softmax", "masked_softmax_all",
           action="raised"))
def _captioner() -> Program:
    torch.manual_seed(8)
    model = Captioner()
    g = _gen(110)

    def batch(s: int) -> Any:
        regions = torch.randn(4, 5, 8, generator=g)
        mask = torch.ones(4, 5, dtype=torch.bool)
        mask[:, 4] = False
        if s == FAIL_STEP:
            mask[2] = False  # a blank frame: the detector returned no box
            regions[2] = 0.0
        return regions, mask, torch.randint(1, 15, (4, 6), generator=g)

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), [batch(s) for s in range(5)],
                   _caption_loss)


# 4b. numpy/numpy#20431 ("np.random.choice ... ValueError: probabilities contain NaN", a policy-gradient
#     agent). Here, distance-weighted negative sampling (Wu et al. 2017) written without the paper's
#     distance cutoff: log q(d) = (2 - n) log d - (n - 3)/2 log(1 - d^2/4), normalised per anchor and
#     handed to numpy. The same product photo uploaded under two listings (two classes) puts two
#     identical embeddings of different classes in the batch: log(0) = -inf, times (2 - n) = +inf, minus
#     the row's max (+inf) = NaN, and numpy refuses the probabilities. (Same-class pairs, the diagonal
#     included, are masked out after the log and never matter.)
class EmbeddingNet(nn.Module):
    def __init__(self, dim_in: int = 12, dim: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim_in, 32), nn.ReLU(), nn.Linear(32, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net(x), dim=-1)


def _dws_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    images, labels = batch
    emb = model(images)
    n = emb.shape[1]
    rng = np.random.default_rng(step)
    with torch.no_grad():
        d = (emb[:, None] - emb[None]).pow(2).sum(-1).sqrt()
        log_w = (2.0 - n) * torch.log(d) - ((n - 3) / 2) * torch.log(1.0 - 0.25 * d * d)  # <origin:dws_log>
        log_w = log_w.masked_fill(labels[:, None] == labels[None], float("-inf"))
        w = torch.exp(log_w - log_w.max(dim=1, keepdim=True).values)
        probs = (w / w.sum(dim=1, keepdim=True)).double().numpy()
    negatives = [int(rng.choice(len(labels), p=p / p.sum())) for p in probs]
    positives = [int(torch.nonzero((labels == labels[i]) & (torch.arange(len(labels)) != i))[0]) for i in
                 range(len(labels))]
    d_ap = (emb - emb[positives]).pow(2).sum(-1)
    d_an = (emb - emb[negatives]).pow(2).sum(-1)
    return F.relu(d_ap - d_an + 0.2).mean()


@case("distance_weighted_sampling_duplicate_image_numpy_choice_nan",
      Want("exception", "forward", "aten.log.default", None, "dws_log", "log_nonpositive", action="raised"))
def _dws() -> Program:
    torch.manual_seed(9)
    model = EmbeddingNet()
    g = _gen(111)

    def batch(s: int) -> Any:
        images = torch.randn(8, 12, generator=g)
        labels = torch.arange(4).repeat_interleave(2)
        if s == FAIL_STEP:
            images[6] = images[4]  # one photo listed under products 2 and 3
        return images, labels

    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), [batch(s) for s in range(5)], _dws_loss)


# ====================================================================== 5. optimizer step
# 5a. CanReader/FastNN#12 ("Centered RMSprop can take the square root of a negative number": the
#     cancellation in E[g^2] - E[g]^2 is not covered by eps). torch's RMSprop(centered=True) computes
#     sqrt(square_avg - grad_avg^2) + eps. A multi-task net with learned uncertainty weights (Kendall et
#     al.), mean over three tasks; the third task has no labels in this data stream, its loss is 0, so
#     its log-variance's gradient is exactly 1/3 at every step. With TF's rho = 0.9 the two running
#     averages converge to g^2 and g, and their float32 difference rounds below 0: sqrt NaN, the
#     parameter NaN. The loss and every gradient stay finite.
class UncertaintyMultiTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.heads = nn.ModuleList(nn.Linear(16, 1) for _ in range(3))
        self.log_vars = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        h = self.trunk(x)
        return [head(h).squeeze(-1) for head in self.heads]


def _uncertainty_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, targets, has_label = batch
    preds = model(x)
    losses = []
    for i, (p, y) in enumerate(zip(preds, targets)):
        m = has_label[i]
        losses.append(((p - y) ** 2 * m).sum() / m.sum().clamp(min=1))
    total = sum(torch.exp(-model.log_vars[i]) * losses[i] + model.log_vars[i] for i in range(3))
    return total / 3


RMSPROP_FAIL_STEP = 136
"""The step whose update first makes a parameter non-finite (plain run, checked by the construction test)."""


@case("uncertainty_weighting_centered_rmsprop_unlabelled_task_constant_gradient",
      Want("nonfinite_param", "optimizer", "aten.sqrt_.default", "", "opt_step", "optimizer_state",
           step=RMSPROP_FAIL_STEP))
def _rmsprop() -> Program:
    torch.manual_seed(10)
    model = UncertaintyMultiTask()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.9, eps=1e-8, centered=True)
    g = _gen(112)

    def batch(s: int) -> Any:
        x = torch.randn(16, 6, generator=g)
        targets = [x[:, 0] + 0.1 * torch.randn(16, generator=g), x[:, 1] * x[:, 2], torch.zeros(16)]
        return x, targets, [torch.ones(16), torch.ones(16), torch.zeros(16)]

    return Program(model, opt, [batch(s) for s in range(RMSPROP_FAIL_STEP + 3)], _uncertainty_loss)


# ====================================================================== 6. quiet programs
# Q1. pytorch/pytorch PR #131060 (SDPA's "safe softmax": a fully masked row attends to nothing and
#     returns 0, forward and backward). A document classifier with F.scaled_dot_product_attention and a
#     boolean padding mask; an empty document is fully padded. Nothing is non-finite: no incident.
class SdpaClassifier(nn.Module):
    def __init__(self, vocab: int = 30, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        keep = tokens != 0
        q, k, v = self.qkv(self.embed(tokens)).chunk(3, dim=-1)
        h = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], attn_mask=keep[:, None, None, :])
        h = h.squeeze(1) * keep[..., None]
        return self.out(h.sum(1) / keep.sum(1, keepdim=True).clamp(min=1))


@quiet("sdpa_bool_padding_mask_fully_padded_document")
def _quiet_sdpa() -> Program:
    torch.manual_seed(11)
    model = SdpaClassifier()
    g = _gen(113)

    def batch(s: int) -> Any:
        tokens = torch.randint(1, 30, (6, 10), generator=g)
        tokens[:, 7:] = 0
        if s == FAIL_STEP:
            tokens[3] = 0
        return tokens, torch.randint(0, 2, (6,), generator=g)

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), [batch(s) for s in range(5)],
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# Q2. huggingface's float16 T5/GPT-2 overflow reports (gelu_new's 0.044715 * x ** 3 overflows float16 for
#     |x| > ~40): the intermediate is inf, but tanh(inf) = 1, the activation is x, and its derivative
#     (1 - tanh^2 = 0 times a finite factor) is finite. A float16 MLP whose one unit sees x = 48: no
#     output, loss or gradient is non-finite, so no incident.
class HalfGeluMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.fc2(h).squeeze(-1)


@quiet("half_model_gelu_new_cubic_overflows_tanh_saturates")
def _quiet_gelu() -> Program:
    torch.manual_seed(12)
    model = HalfGeluMLP().half()
    with torch.no_grad():
        model.fc1.weight[0] = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.half)
        model.fc1.bias[0] = 0.0
    g = _gen(114)

    def batch(s: int) -> Any:
        x = torch.randn(8, 4, generator=g)
        if s == FAIL_STEP:
            x[3, 0] = 48.0
        return x.half(), torch.randn(8, generator=g).half()

    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-3), [batch(s) for s in range(5)],
                   lambda m, b, s: F.mse_loss(m(b[0]).float(), b[1].float()))


# Q3. Invalid-action masking done right (the fix recommended in pytorch/pytorch#31829's thread and in RL
#     forums): illegal logits set to -inf, log_softmax, the entropy with the masked log-probabilities
#     filled with 0 before the product (so 0 * -inf never happens), every state with at least one
#     legal move. Nothing is non-finite: no incident.
class MaskedPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 6))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)


def _masked_pg_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, legal, actions, adv = batch
    logits = model(obs).masked_fill(~legal, float("-inf"))
    logp = logits.log_softmax(-1)
    chosen = logp.gather(1, actions[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp.masked_fill(~legal, 0.0)).sum(-1)
    return -(chosen * adv).mean() - 0.01 * entropy.mean()


@quiet("invalid_action_masking_minus_inf_entropy_masked_fill_zero")
def _quiet_masking() -> Program:
    torch.manual_seed(13)
    model = MaskedPolicy()
    g = _gen(115)

    def batch(s: int) -> Any:
        legal = torch.rand(16, 6, generator=g) < 0.5
        if s == FAIL_STEP:
            legal[4] = False
            legal[4, 2] = True  # a forced move: a single legal action
        legal[:, 0] |= ~legal.any(-1)
        actions = torch.multinomial(legal.float(), 1, generator=g).squeeze(1)
        return torch.randn(16, 10, generator=g), legal, actions, torch.randn(16, generator=g)

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), [batch(s) for s in range(5)],
                   _masked_pg_loss)


# ====================================================================== the oracle
_NODES = {"aten.logsumexp.default": "LogsumexpBackward0"}
"""For a backward origin: the autograd node of the forward op the expectation names."""
_SKIP = {"__torch_dispatch__", "__torch_function__", "_pre", "_post", "_oracle_run", "test_cases_fail_without_nantrace",
         "_case_line"}


def _floats(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0]


def _case_line() -> int | None:
    frame = inspect.currentframe()
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename) == HERE and frame.f_code.co_name not in _SKIP:
            return frame.f_lineno
        frame = frame.f_back
    return None


class FirstBad(TorchDispatchMode):
    """The first op that made a NaN from NaN-free inputs or a non-finite value from finite ones (an explicit
    infinite constant argument excepted): op, phase, line of this file, watched module; for a kernel that
    writes its arguments (an in-place optimizer op), its written argument counts as its output."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.made: dict[int, tuple[str | None, int | None]] = {}
        self.first: dict[str, Any] | None = None
        self.phase = "forward"

    def _pre(self, module: nn.Module, args: Any) -> None:
        if id(module) in self.names:
            self.stack.append(self.names[id(module)])

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        if id(module) in self.names and self.stack:
            self.stack.pop()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        ins = _floats((args, kwargs))
        nan_in = any(bool(t.isnan().any()) for t in ins)
        finite_in = all(bool(t.isfinite().all()) for t in ins)
        out = func(*args, **kwargs)
        if self.first is None:
            outs = _floats(out) + (ins[:1] if func._schema.name.endswith("_") else [])
            const_inf = any(isinstance(a, float) and math.isinf(a) for a in tree_leaves((args, kwargs)))
            nan = any(bool(t.isnan().any()) for t in outs) and not nan_in
            bad = not const_inf and any(not bool(t.isfinite().all()) for t in outs) and finite_in
            if nan or bad:
                op = f"aten.{func._schema.name.split('::')[1]}.{func._overloadname or 'default'}"
                backward = torch._C._current_graph_task_id() != -1
                line, module, node = _case_line(), (self.stack[-1] if self.stack else None), None
                phase = "backward" if backward else self.phase
                if backward:
                    current = torch._C._current_autograd_node()
                    node = type(current).__name__ if current is not None else None
                    module, line = self.made.get(id(current), (None, None))
                self.first = dict(op=op, phase=phase, line=line, module=module, node=node)
        return out


class NodeSites(TorchFunctionMode):
    """Where each forward torch call ran (watched module, line of this file), by its output's autograd node."""

    def __init__(self, oracle: FirstBad) -> None:
        super().__init__()
        self.oracle = oracle

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch._C._current_graph_task_id() == -1:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.grad_fn is not None and id(t.grad_fn) not in self.oracle.made:
                    self.oracle.made[id(t.grad_fn)] = (self.oracle.stack[-1] if self.oracle.stack else None, _case_line())
        return out


def _finite(ts: Any) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in ts)


def _state_finite(opt: torch.optim.Optimizer) -> bool:
    return all(_finite(v for v in st.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
               for st in opt.state.values())


def _oracle_run(program: Program) -> dict[str, Any]:
    """The program without nantrace, each step (optimizer step included) under the oracle: the first step
    that fails, how, and where."""
    model, opt = program.model, program.optimizer
    kept: list[Any] = []
    for step, batch in enumerate(program.batches):
        oracle = FirstBad(model)
        hooks = [torch.nn.modules.module.register_module_forward_pre_hook(oracle._pre),
                 torch.nn.modules.module.register_module_forward_hook(oracle._post, always_call=True)]
        try:
            with NodeSites(oracle), oracle:
                opt.zero_grad()
                try:
                    loss = run_step(program, program.loss, batch, step)
                except Exception as exc:  # noqa: BLE001
                    return dict(step=step, what="raised", error=repr(exc), origin=oracle.first)
                kept.append(oracle)
                if not bool(torch.isfinite(loss).all()):
                    return dict(step=step, what="loss", origin=oracle.first)
                if not _finite(p.grad for p in model.parameters()):
                    return dict(step=step, what="grads", origin=oracle.first)
                oracle.phase = "optimizer"
                opt.step()
        finally:
            for h in hooks:
                h.remove()
        if not _finite(model.parameters()):
            return dict(step=step, what="params", origin=oracle.first)
        if not _state_finite(opt):
            return dict(step=step, what="state", origin=oracle.first)
    return dict(step=None, what=None, origin=None)


# ======================================================================= the tests
WHAT = {"nonfinite_loss": "loss", "nonfinite_grad": "grads", "exception": "raised", "nonfinite_param": "params"}


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction: without nantrace the program is finite until the expected step, fails there as the
    expected kind says, and the oracle names the expected op (a backward origin: the expected forward op's
    node), phase, watched module and line (an optimizer-phase origin: op and phase)."""
    build, want = CASES[name]
    program = build()
    if name.startswith("glow"):
        dets = [float(torch.det(f.invconv.weight)) for f in program.model.flows]
        assert dets[0] < 0, dets
    run = _oracle_run(program)
    assert (run["step"], run["what"]) == (want.step, WHAT[want.kind]), run
    origin = run["origin"]
    assert origin is not None, run
    if origin["node"] is not None:
        assert origin["node"] == _NODES[want.op], origin
    else:
        assert origin["op"] == want.op, origin
    assert origin["phase"] == ("forward" if want.phase == "forward" else want.phase), origin
    if want.phase != "optimizer":
        module = ORACLE_MODULE.get(name, want.module)
        assert (origin["module"], origin["line"]) == (module, origin_line(HERE, want.tag)), origin
    if want.kind == "exception":
        assert "nan" in run["error"].lower(), run["error"]


@pytest.mark.parametrize("name,mode", case_params(CASES, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    assert_diagnosis(train(build(), replayable=mode == "replayable"), want, JUDGE)


@pytest.mark.parametrize("name", list(QUIET))
def test_quiet_programs_without_nantrace(name: str) -> None:
    """The construction: every loss, gradient, parameter and optimizer state stays finite; the critical step
    holds the critical data (checked in each builder's batch)."""
    program = QUIET[name]()
    run = _oracle_run(program)
    assert run["step"] is None, run


@pytest.mark.parametrize("name,mode", case_params(QUIET, QUIET_XFAIL))
def test_quiet_programs(name: str, mode: str) -> None:
    """No blocking incident, no error: the program trains on."""
    run = train(QUIET[name](), replayable=mode == "replayable")
    blocking = [describe(i) + " | " + i.summary for i in run.incidents if i.action != "logged"]
    assert not blocking, blocking
    assert run.error is None, repr(run.error)
