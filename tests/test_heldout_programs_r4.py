"""Held-out failures, round 4: programs shaped like public training code from areas the earlier
rounds did not cover: object detection (IoU loss, DETR's num_boxes, focal loss, box encoding),
audio (log-mel front end, CTC, SI-SNR), normalizing flows and density models (a conditional
linear flow's slogdet, an affine coupling layer, a mixture log-likelihood), mixture-of-experts
(a load-balancing loss, Switch capacity dropping), quantization-aware training with a
straight-through estimator, gradient accumulation, distillation from an EMA teacher,
``torch.compile``'d models, packed LSTMs, a Transformer encoder with a fully padded sample,
tabular standardisation and target transforms, and MoCo with a memory queue.

The expected diagnosis (kind, phase, ATen op, module, cause and the ``# <origin:TAG>`` line) of
each case was written from how the failure was constructed, following docs/api.md's rules,
before nantrace ran on it; where the construction turned out to fail differently in torch 2.13
(checked with plain torch and ``torch.autograd.detect_anomaly``), the comment says so. Every case
runs zero-intrusive and with the loss code wrapped in ``guard.replayable``; a third test checks
that diagnosing left the model's state (parameters, frozen ones included, and buffers) as a plain
run that skipped the failing updates left it.

Ideas tried and dropped because torch 2.13 does not fail that way: a CTC target holding the blank
index or an index equal to num_classes (a finite loss on the CPU); a TransformerEncoderLayer with
a fully padded sample (scaled_dot_product_attention returns finite rows, so case 9b fails in the
pooling instead); torch's fused learnable fake-quantisation with scale 0 (returns zeros, no NaN).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from heldout_harness import MODES, Judge, Program, aligned, assert_diagnosis, case_params, run_step, same, sgd, steps, train
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

FAIL_STEP = 3
STEPS = 5


JUDGE = Judge(__file__)
got_of, want_of = JUDGE.got, JUDGE.want


def _steps(normal: Callable[[int], Any], bad: Callable[[int], Any]) -> list[Any]:
    return steps(normal, bad, FAIL_STEP, STEPS)


CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
XFAIL: dict[str, str] = {
}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""
STATE_XFAIL: dict[str, str] = {}
"""name -> why a replay still changes the user's state (a strict xfail, both modes unless in STATE_OK)."""
STATE_OK: set[tuple[str, str]] = set()


def case(name: str, want: Want) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in CASES, name
        CASES[name] = (build, want)
        return build

    return register


# ===================================================================== 1. object detection
# 1a. An IoU loss written by hand (UnitBox / YOLO style) on a box head whose width and height go
#     through a ReLU; one annotation is a zero-area box (x1 == x2, y1 == y2: a click, not a drag)
#     and the prediction for that image has width 0 too: union = 0 + 0 - 0, iou = 0 / 0.
class BoxHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = self.net(x)
        return torch.cat([o[:, :2], F.relu(o[:, 2:])], 1)  # cx, cy, w, h


def iou_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, gt = batch  # gt: x1, y1, x2, y2
    p = model(x)
    px1, py1, px2, py2 = p[:, 0] - p[:, 2] / 2, p[:, 1] - p[:, 3] / 2, p[:, 0] + p[:, 2] / 2, p[:, 1] + p[:, 3] / 2
    iw = (torch.min(px2, gt[:, 2]) - torch.max(px1, gt[:, 0])).clamp(min=0)
    ih = (torch.min(py2, gt[:, 3]) - torch.max(py1, gt[:, 1])).clamp(min=0)
    inter = iw * ih
    union = p[:, 2] * p[:, 3] + (gt[:, 2] - gt[:, 0]) * (gt[:, 3] - gt[:, 1]) - inter
    iou = inter / union  # <origin:iou_div>
    return (1 - iou).mean()


@case("iou_loss_zero_area_annotation_and_prediction",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "iou_div", "div_by_zero"))
def _iou() -> Program:
    torch.manual_seed(0)
    model = BoxHead()
    raw = aligned(lambda v: model.net(v)[:, 2], 12, -1.0, 30.0, 1101)
    g = torch.Generator().manual_seed(1101)

    def batch(step: int, bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 12, generator=g)
        xy = torch.rand(8, 2, generator=g)
        gt = torch.cat([xy, xy + 0.2 + torch.rand(8, 2, generator=g)], 1)
        if bad:
            x[3] = raw
            gt[3, 2:] = gt[3, :2]  # a point annotation
        return x, gt

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), iou_loss)


# 1b. DETR's SetCriterion without the clamp on num_boxes: a batch in which no image has an object
#     (negatives mined for the background class) has no matched box, the summed L1 is 0 and
#     num_boxes is 0: 0 / 0.
class QueryDetector(nn.Module):
    def __init__(self, queries: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.q, self.c = queries, classes
        self.body = nn.Sequential(nn.Linear(12, 32), nn.ReLU())
        self.class_embed = nn.Linear(32, queries * (classes + 1))
        self.bbox_embed = nn.Linear(32, queries * 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.class_embed(h).view(-1, self.q, self.c + 1), self.bbox_embed(h).view(-1, self.q, 4).sigmoid()


def detr_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, targets = batch
    logits, boxes = model(x)
    tgt_classes = torch.full(logits.shape[:2], model.c, dtype=torch.long)  # "no object"
    src, tgt = [], []
    for b, (labels, bx) in enumerate(targets):  # a fixed-order matcher: query i <-> object i
        n = len(labels)
        tgt_classes[b, :n] = labels
        src.append(boxes[b, :n])
        tgt.append(bx)
    empty_weight = torch.ones(model.c + 1)
    empty_weight[-1] = 0.1
    loss_ce = F.cross_entropy(logits.flatten(0, 1), tgt_classes.flatten(), weight=empty_weight)
    num_boxes = torch.as_tensor(float(sum(len(labels) for labels, _ in targets)))
    loss_bbox = F.l1_loss(torch.cat(src), torch.cat(tgt), reduction="none").sum() / num_boxes  # <origin:detr_nbox>
    return loss_ce + 5.0 * loss_bbox


@case("detr_num_boxes_zero_batch_without_objects",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "detr_nbox", "div_by_zero"))
def _detr() -> Program:
    torch.manual_seed(0)
    model = QueryDetector()
    g = torch.Generator().manual_seed(1102)

    def batch(step: int, empty: bool = False) -> tuple[torch.Tensor, list[Any]]:
        targets = []
        for b in range(4):
            n = 0 if empty else 1 + (b + step) % 3
            targets.append((torch.randint(0, 3, (n,), generator=g), torch.rand(n, 4, generator=g)))
        return torch.randn(4, 12, generator=g), targets

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), detr_loss)


# 1c. RetinaNet's sigmoid focal loss written by hand as -alpha_t (1 - p_t)^gamma log(p_t): a
#     background image in raw units makes one anchor's logit large, sigmoid rounds to exactly 1,
#     p_t = 1 - p = 0 for that negative anchor and log(0) = -inf.
def sigmoid_focal(model: nn.Module, batch: Any, step: int, alpha: float = 0.25, gamma: float = 2.0) -> torch.Tensor:
    x, y = batch
    p = torch.sigmoid(model(x))
    p_t = p * y + (1 - p) * (1 - y)
    alpha_t = alpha * y + (1 - alpha) * (1 - y)
    ce = -torch.log(p_t)  # <origin:focal_log>
    return (alpha_t * (1 - p_t) ** gamma * ce).sum() / y.sum().clamp(min=1)


@case("retinanet_focal_loss_saturated_background_anchor",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "focal_log", "log_nonpositive"))
def _focal() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 6))  # 6 anchors
    raw = aligned(lambda v: model(v)[:, 2], 10, +1.0, 1e3, 1103)
    g = torch.Generator().manual_seed(1103)

    def batch(step: int, bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 10, generator=g)
        y = (torch.rand(8, 6, generator=g) < 0.2).float()
        if bad:
            x[4], y[4] = raw, 0.0  # a background image, unnormalised
        return x, y

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), sigmoid_focal)


# 1d. Faster R-CNN box encoding (dw = log(gt_w / anchor_w)) done before the forward, as the
#     target assignment of a data-side pipeline: one annotation has zero width, log(0) = -inf and
#     the smooth-L1 against a -inf target is inf.
def rpn_box_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, gt, anchors = batch  # cx, cy, w, h
    tx = (gt[:, 0] - anchors[:, 0]) / anchors[:, 2]
    ty = (gt[:, 1] - anchors[:, 1]) / anchors[:, 3]
    tw = torch.log(gt[:, 2] / anchors[:, 2])  # <origin:encode_log>
    th = torch.log(gt[:, 3] / anchors[:, 3])
    targets = torch.stack([tx, ty, tw, th], 1)
    return F.smooth_l1_loss(model(x), targets, beta=1 / 9)


@case("faster_rcnn_box_encoding_zero_width_box",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "encode_log", "log_nonpositive"))
def _box_encode() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1104)

    def batch(step: int, bad: bool = False) -> tuple[torch.Tensor, ...]:
        anchors = torch.cat([torch.rand(8, 2, generator=g), 0.2 + torch.rand(8, 2, generator=g)], 1)
        gt = anchors + 0.05 * torch.randn(8, 4, generator=g)
        if bad:
            gt[5, 2] = 0.0  # x1 == x2 after clipping to the image
        return torch.randn(8, 10, generator=g), gt, anchors

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), rpn_box_loss)


# 1e. DETR's generalized_box_iou with its sanity asserts, on targets normalised by the image size
#     before the forward; one record lost its size metadata (0 x 0): 0 / 0 = NaN for the x1 = 0
#     corner and 10 / 0 = inf for x2, and the assert x2 >= x1 fails on the NaN. The script dies
#     (AssertionError); the value that made it fail came from the division.
def box_cxcywh_to_xyxy(b: torch.Tensor) -> torch.Tensor:
    cx, cy, w, h = b.unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


def generalized_box_iou(b1: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    assert (b1[:, 2:] >= b1[:, :2]).all()
    assert (b2[:, 2:] >= b2[:, :2]).all()
    area1 = (b1[:, 2] - b1[:, 0]) * (b1[:, 3] - b1[:, 1])
    area2 = (b2[:, 2] - b2[:, 0]) * (b2[:, 3] - b2[:, 1])
    lt, rb = torch.max(b1[:, None, :2], b2[:, :2]), torch.min(b1[:, None, 2:], b2[:, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    union = area1[:, None] + area2 - inter
    iou = inter / union
    lt_c, rb_c = torch.min(b1[:, None, :2], b2[:, :2]), torch.max(b1[:, None, 2:], b2[:, 2:])
    area_c = (rb_c - lt_c).clamp(min=0).prod(-1)
    return iou - (area_c - union) / area_c


def giou_step(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, boxes_px, sizes = batch
    tgt = boxes_px / sizes.repeat(1, 2)  # <origin:norm_boxes>
    pred = box_cxcywh_to_xyxy(model(x).sigmoid())
    giou = torch.diag(generalized_box_iou(pred, tgt))
    return (1 - giou).mean() + F.l1_loss(pred, tgt)


@case("detr_giou_assert_on_box_normalised_by_missing_image_size",
      Want("exception", "forward", "aten.div.Tensor", None, "norm_boxes", "div_by_zero", action="raised"))
def _giou_assert() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1105)

    def batch(step: int, bad: bool = False) -> tuple[torch.Tensor, ...]:
        sizes = torch.randint(200, 640, (6, 2), generator=g).float()
        xy = torch.rand(6, 2, generator=g) * 100
        boxes = torch.cat([xy, xy + 20 + torch.rand(6, 2, generator=g) * 80], 1)
        if bad:
            sizes[2] = 0.0
            boxes[2] = torch.tensor([0.0, 0.0, 10.0, 12.0])
        return torch.randn(6, 12, generator=g), boxes, sizes

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), giou_step)


# ============================================================================== 2. audio
# 2a. A keyword-spotting model with its own log-mel front end, log(mel) with no epsilon: a silent
#     clip (all-zero waveform) has zero power, log(0) = -inf, and the conv encoder mixes -inf
#     with +inf (NaN).
class LogMel(nn.Module):
    def __init__(self, n_fft: int = 64, hop: int = 16, n_mels: int = 8) -> None:
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft))
        g = torch.Generator().manual_seed(7)
        self.register_buffer("fb", torch.rand(n_mels, n_fft // 2 + 1, generator=g))

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(wav, self.n_fft, self.hop, window=self.window, return_complex=True)
        power = spec.real ** 2 + spec.imag ** 2
        return torch.log(torch.matmul(self.fb, power))  # <origin:logmel_log>


class KeywordSpotter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frontend = LogMel()
        self.encoder = nn.Sequential(nn.Conv1d(8, 16, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.frontend(wav)).mean(-1))


@case("keyword_spotting_log_mel_silent_clip",
      Want("nonfinite_loss", "forward", "aten.log.default", "frontend", "logmel_log", "log_nonpositive"))
def _logmel() -> Program:
    torch.manual_seed(0)
    model = KeywordSpotter()
    g = torch.Generator().manual_seed(1201)

    def batch(step: int, silent: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        wav = 0.1 * torch.randn(4, 256, generator=g)
        if silent:
            wav[2] = 0.0  # a silent clip (a muted microphone)
        return wav, torch.randint(0, 4, (4,), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 2b. CTC with a transcript of doubled letters ("aa"): between two equal labels the alignment
#     needs a blank frame, so a 4-frame utterance cannot carry the 4-label transcript [2, 2, 3, 1]
#     (it needs 5 frames). No alignment exists: inf. (A blank/label mix-up, a label equal to the
#     blank index or to num_classes, was tried first: torch 2.13's CPU CTC returns a finite loss.)
def ctc_repeat_step(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    feats, targets, in_lens, tgt_lens = batch
    log_probs = F.log_softmax(model(feats), dim=-1).transpose(0, 1)  # (T, N, C)
    return F.ctc_loss(log_probs, targets, in_lens, tgt_lens)  # <origin:ctc_repeat>


@case("ctc_doubled_letters_need_blank_frames",
      Want("nonfinite_loss", "forward", "aten._ctc_loss.Tensor", None, "ctc_repeat", "domain_error"))
def _ctc_repeat() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 6))
    g = torch.Generator().manual_seed(1202)

    def batch(step: int, bad: bool = False) -> tuple[torch.Tensor, ...]:
        feats = torch.randn(3, 12, 8, generator=g)
        targets = torch.randint(1, 6, (3, 4), generator=g)
        in_lens, tgt_lens = torch.tensor([12, 10, 11]), torch.tensor([4, 3, 4])
        if bad:
            targets[1] = torch.tensor([2, 2, 3, 1])  # "aab.": a fast speaker, 4 frames
            in_lens[1], tgt_lens[1] = 4, 4
        return feats, targets, in_lens, tgt_lens

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), ctc_repeat_step)


# 2c. Speech separation with an SI-SNR loss whose projection has no epsilon: one source of the
#     mixture is absent (a silent reference): its zero-mean energy is 0 and alpha = 0 / 0. The
#     divisor is the (unnormalised) variance of a constant signal.
def si_snr_loss(model: nn.Module, batch: Any, step: int, eps: float = 1e-8) -> torch.Tensor:
    mix, ref = batch
    est = model(mix[:, None]).squeeze(1)
    est = est - est.mean(-1, keepdim=True)
    ref = ref - ref.mean(-1, keepdim=True)
    alpha = (est * ref).sum(-1, keepdim=True) / ref.pow(2).sum(-1, keepdim=True)  # <origin:sisnr_proj>
    target = alpha * ref
    noise = est - target
    si_snr = 10 * torch.log10(target.pow(2).sum(-1) / (noise.pow(2).sum(-1) + eps) + eps)
    return -si_snr.mean()


@case("separation_si_snr_silent_reference",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "sisnr_proj", "zero_variance_norm"))
def _sisnr() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 8, 5, padding=2), nn.ReLU(), nn.Conv1d(8, 1, 5, padding=2))
    g = torch.Generator().manual_seed(1203)

    def batch(step: int, silent: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        ref = torch.randn(4, 64, generator=g)
        if silent:
            ref[1] = 0.0
        return ref + 0.3 * torch.randn(4, 64, generator=g), ref

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), si_snr_loss)


# ======================================================== 3. normalizing flows and densities
# 3a. A conditional linear flow z = W(c) x whose matrix comes from a bias-free hypernetwork of the
#     context; a sample with a missing context (zeros) gets W = 0, slogdet's log|det| = -inf, and
#     the NLL (.. - logdet) = +inf in the loss code. The origin is the op that made the infinity:
#     slogdet in the flow (a -inf made from finite values is not an intentional mask).
class CondLinearFlow(nn.Module):
    def __init__(self, d: int = 4, dc: int = 3) -> None:
        super().__init__()
        self.d = d
        self.hyper = nn.Linear(dc, d * d, bias=False)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.hyper(c).view(-1, self.d, self.d)
        logdet = torch.linalg.slogdet(w).logabsdet  # <origin:flow_slogdet>
        return (w @ x[..., None]).squeeze(-1), logdet


class CondFlowModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flow = CondLinearFlow()
        self.shift = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z, logdet = self.flow(x, c)
        return z + self.shift, logdet


def flow_nll(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, c = batch
    z, logdet = model(x, c)
    return (0.5 * z.pow(2).sum(-1) + 2 * math.log(2 * math.pi) - logdet).mean()


@case("conditional_flow_slogdet_zero_context",
      Want("nonfinite_loss", "forward", "aten._linalg_slogdet.default", "flow", "flow_slogdet", "domain_error"))
def _slogdet() -> Program:
    torch.manual_seed(0)
    model = CondFlowModel()
    g = torch.Generator().manual_seed(1301)

    def batch(step: int, missing: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        c = torch.randn(6, 3, generator=g)
        if missing:
            c[2] = 0.0  # missing metadata filled with zeros
        return torch.randn(6, 4, generator=g), c

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), flow_nll)


# 3b. RealNVP affine coupling y2 = x2 * exp(s(x1)) + t(x1) with an unbounded scale net (no tanh):
#     a batch of images not dequantised / rescaled (raw 0..255 style values) drives s past 88.7 in
#     the first coupling: exp overflows float32.
class AffineCoupling(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d // 2, 32), nn.ReLU(), nn.Linear(32, d))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x1, x2 = x.chunk(2, -1)
        s, t = self.net(x1).chunk(2, -1)
        y2 = x2 * torch.exp(s) + t  # <origin:coupling_exp>
        return torch.cat([y2, x1], -1), s.sum(-1)


class RealNVP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.couplings = nn.ModuleList([AffineCoupling(), AffineCoupling()])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logdet = torch.zeros(x.shape[0])
        for layer in self.couplings:
            x, ld = layer(x)
            logdet = logdet + ld
        return x, logdet


@case("realnvp_coupling_exp_scale_raw_pixels",
      Want("nonfinite_loss", "forward", "aten.exp.default", "couplings.0", "coupling_exp", "exp_overflow"))
def _coupling() -> Program:
    torch.manual_seed(0)
    model = RealNVP()
    g = torch.Generator().manual_seed(1302)

    def batch(step: int, raw: bool = False) -> torch.Tensor:
        x = torch.rand(8, 6, generator=g) - 0.5
        if raw:
            x[6] = torch.randint(0, 256, (6,), generator=g).float() * 4.0  # an un-rescaled record
        return x

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: (lambda z, ld: (0.5 * z.pow(2).sum(-1) - ld).mean())(*m(b)))


# 3c. A mixture density model with learned mixture weights and fixed components, log(softmax(.))
#     written by hand, then logsumexp over components: an outlier input makes one weight
#     underflow to exactly 0, log(0) = -inf, which logsumexp absorbs (the loss is finite), but the
#     backward of log computes 0 / 0 = NaN: a gradient trap through an unselected (masked) term.
def mixture_nll(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    log_pi = torch.log(F.softmax(model(x), -1))  # <origin:gmm_log_pi>
    mu, sigma = torch.tensor([-2.0, 0.0, 2.0]), 0.7
    comp = -0.5 * ((y[:, None] - mu) / sigma) ** 2 - math.log(sigma) - 0.5 * math.log(2 * math.pi)
    return -torch.logsumexp(log_pi + comp, -1).mean()


@case("mixture_density_log_of_zero_weight_under_logsumexp",
      Want("nonfinite_grad", "forward", "aten.log.default", None, "gmm_log_pi", "where_gradient_trap"))
def _gmm() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))
    g = torch.Generator().manual_seed(1303)
    raw = 300.0 * torch.randn(6, generator=g)

    def batch(step: int, outlier: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 6, generator=g)
        if outlier:
            x[1] = raw
        return x, 2 * torch.randn(8, generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), mixture_nll)


# ========================================================================= 4. mixture of experts
# 4a. A top-1 MoE layer whose load-balancing term averages the router probability over the tokens
#     each expert received (sum / count): a batch of all-padding sequences routes every token to
#     one expert, the other experts get 0 tokens: 0 / 0.
class MoE(nn.Module):
    def __init__(self, d: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.e = experts
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(experts)])

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.router(h), -1)
        mask = F.one_hot(probs.argmax(-1), self.e).float()
        tokens_per_expert = mask.sum(0)
        prob_per_expert = (probs * mask).sum(0) / tokens_per_expert  # <origin:moe_balance>
        aux = self.e * (tokens_per_expert / h.shape[0] * prob_per_expert).sum()
        out = torch.stack([expert(h) for expert in self.experts], 1)
        return (out * (mask * probs)[..., None]).sum(1), aux


class MoELM(nn.Module):
    def __init__(self, vocab: int = 20, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.moe = MoE(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, aux = self.moe(self.emb(tokens).flatten(0, 1))
        return self.head(h), aux


def moe_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    tokens, labels = batch
    logits, aux = model(tokens)
    return F.cross_entropy(logits, labels.flatten()) + 0.01 * aux


@case("moe_load_balance_expert_without_tokens",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "moe", "moe_balance", "div_by_zero"))
def _moe_balance() -> Program:
    torch.manual_seed(0)
    model = MoELM()
    g = torch.Generator().manual_seed(1401)

    def batch(step: int, padded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(1, 20, (4, 8), generator=g)
        if padded:
            tokens.zero_()  # a batch of empty documents: all padding
        return tokens, torch.randint(0, 20, (4, 8), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), moe_loss)


# 4b. A Switch-Transformer router with token dropping written as a -inf mask over the experts a
#     token may use (its top-1 expert, if the expert still has capacity): a batch of identical
#     tokens overflows one expert's capacity and every dropped token's row is all -inf.
class SwitchRouter(nn.Module):
    def __init__(self, d: int = 16, experts: int = 4, capacity_factor: float = 2.0) -> None:
        super().__init__()
        self.e, self.cf = experts, capacity_factor
        self.gate = nn.Linear(d, experts)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.gate(h)
        onehot = F.one_hot(logits.argmax(-1), self.e).bool()
        position = torch.cumsum(onehot.long(), 0)
        keep = onehot & (position <= int(self.cf * h.shape[0] / self.e))
        return F.softmax(logits.masked_fill(~keep, float("-inf")), -1)  # <origin:switch_softmax>


class SwitchFFN(nn.Module):
    def __init__(self, d: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.router = SwitchRouter(d, experts)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, d)) for _ in range(experts)])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gates = self.router(h)
        out = torch.stack([expert(h) for expert in self.experts], 1)
        return h + (out * gates[..., None]).sum(1)


class SwitchLM(nn.Module):
    def __init__(self, vocab: int = 20, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ffn = SwitchFFN(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.ffn(self.emb(tokens).flatten(0, 1)))


@case("switch_router_capacity_dropped_tokens_all_masked",
      Want("nonfinite_loss", "forward", "aten._softmax.default", "ffn.router", "switch_softmax", "masked_softmax_all"))
def _switch() -> Program:
    torch.manual_seed(0)
    model = SwitchLM()
    g = torch.Generator().manual_seed(1402)

    def batch(step: int, same: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 20, (2, 8), generator=g)
        if same:
            tokens.fill_(7)  # a run of one repeated token (a scraped page of "=====")
        return tokens, torch.randint(0, 20, (2, 8), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1].flatten()))


# 4c. GShard-style top-2 gating with expert capacity: the kept gates of a token are renormalised
#     to sum to 1 (gates / gates.sum()). A batch of one repeated token sends every token to the same
#     two experts; past their capacity both choices of a token are dropped and its kept gates sum
#     to 0: 0 / 0 (a sum of masked probabilities, not a norm).
class Top2Gate(nn.Module):
    def __init__(self, d: int = 16, experts: int = 4, capacity_factor: float = 1.5) -> None:
        super().__init__()
        self.e, self.cf = experts, capacity_factor
        self.wg = nn.Linear(d, experts, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.wg(h), -1)
        top2 = probs.topk(2, -1).indices
        chosen = F.one_hot(top2, self.e).sum(1).bool()
        position = torch.cumsum(chosen.long(), 0)
        kept = probs * (chosen & (position <= int(self.cf * 2 * h.shape[0] / self.e)))
        return kept / kept.sum(-1, keepdim=True)  # <origin:top2_renorm>


class Top2MoE(nn.Module):
    def __init__(self, vocab: int = 20, d: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.gate = Top2Gate(d, experts)
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(experts)])
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens).flatten(0, 1)
        gates = self.gate(h)
        out = torch.stack([expert(h) for expert in self.experts], 1)
        return self.head(h + (out * gates[..., None]).sum(1))


@case("gshard_top2_gate_renormalise_dropped_token",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "gate", "top2_renorm", "div_by_zero"))
def _top2() -> Program:
    torch.manual_seed(0)
    model = Top2MoE()
    g = torch.Generator().manual_seed(1403)

    def batch(step: int, same: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 20, (2, 8), generator=g)
        if same:
            tokens.fill_(3)
        return tokens, torch.randint(0, 20, (2, 8), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1].flatten()))


# ============================================================ 5. quantization-aware training
# QAT starts at FAIL_STEP (a quant delay): the fake-quantiser's learned per-channel step size is
# initialised from its observer's running max of the float steps, scale = max / qmax. One ReLU
# channel is dead (never positive), so its scale is 0, and x / scale = 0 / 0 there. Rounding
# goes through a straight-through-estimator autograd.Function.
class RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class FakeQuant(nn.Module):
    def __init__(self, channels: int, bits: int = 8) -> None:
        super().__init__()
        self.qmax = 2 ** bits - 1
        self.scale = nn.Parameter(torch.ones(channels))
        self.register_buffer("running_max", torch.zeros(channels))
        self.enabled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            with torch.no_grad():
                self.running_max = torch.maximum(self.running_max, x.amax(0))
            return x
        q = RoundSTE.apply((x / self.scale).clamp(0, self.qmax))  # <origin:fq_div>
        return q * self.scale


class QATNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act_q = FakeQuant(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act_q(F.relu(self.fc1(x))))


def start_qat(model: nn.Module, step: int) -> None:
    if step == FAIL_STEP:
        model.act_q.scale.copy_(model.act_q.running_max / model.act_q.qmax)
        model.act_q.enabled = True


@case("qat_step_size_init_dead_channel_zero_scale",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "act_q", "fq_div", "div_by_zero"))
def _qat() -> Program:
    torch.manual_seed(0)
    model = QATNet()
    with torch.no_grad():
        model.fc1.weight[5].mul_(0.01)
        model.fc1.bias[5] = -5.0  # a dead unit
    g = torch.Generator().manual_seed(1501)
    batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(STEPS)]
    return Program(model, sgd(model), batches, lambda m, b, s: F.cross_entropy(m(b[0]), b[1]), before_step=start_qat)


# ================================================================== 6. gradient accumulation
# Four micro-batches per optimizer step, each loss divided by 4; a token classifier with a masked
# mean over its labelled tokens. The third micro-batch of step FAIL_STEP has no labelled token
# (all padding): 0 / 0 in that micro-batch's loss.
def token_loss(model: nn.Module, micro: Any, step: int) -> torch.Tensor:
    tokens, labels, mask = micro
    per_tok = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), reduction="none")
    return (per_tok * mask.flatten()).sum() / mask.sum()  # <origin:accum_div>


@case("grad_accumulation_third_micro_batch_no_labels",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "accum_div", "div_by_zero"))
def _accum() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(30, 16), nn.ReLU(), nn.Linear(16, 5))
    g = torch.Generator().manual_seed(1601)

    def micro(empty: bool) -> tuple[torch.Tensor, ...]:
        tokens = torch.randint(0, 30, (2, 6), generator=g)
        mask = torch.ones(2, 6)
        mask[:, 4:] = 0.0
        if empty:
            mask.zero_()
        return tokens, torch.randint(0, 5, (2, 6), generator=g), mask

    batches = [[micro(s == FAIL_STEP and i == 2) for i in range(4)] for s in range(STEPS)]
    return Program(model, sgd(model), batches, token_loss, accum=True)


# 6b. The same accumulation loop with a contrastive (Hadsell et al.) pair loss on a hand-written
#     Euclidean distance: the third micro-batch of step FAIL_STEP holds a positive pair made of one
#     image twice (the pair sampler drew the same index), its distance is sqrt(0): a finite loss,
#     but the derivative of sqrt is infinite there and the backward computes 0 / 0.
def pair_loss(model: nn.Module, micro: Any, step: int, margin: float = 1.0) -> torch.Tensor:
    a, b, same = micro
    d = (model(a) - model(b)).pow(2).sum(-1).sqrt()  # <origin:accum_sqrt>
    return torch.where(same, d, F.relu(margin - d)).pow(2).mean()


@case("grad_accumulation_third_micro_batch_duplicate_pair",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", None, "accum_sqrt", "grad_singularity"))
def _accum_pair() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 8))
    g = torch.Generator().manual_seed(1602)

    def micro(dup: bool) -> tuple[torch.Tensor, ...]:
        a = torch.randn(4, 10, generator=g)
        same = torch.tensor([True, True, False, False])
        b = torch.where(same[:, None], a + 0.1 * torch.randn(4, 10, generator=g), torch.randn(4, 10, generator=g))
        if dup:
            b[1] = a[1]
        return a, b, same

    batches = [[micro(s == FAIL_STEP and i == 2) for i in range(4)] for s in range(STEPS)]
    return Program(model, sgd(model), batches, pair_loss, accum=True)


# 6c. Accumulation over four micro-batches of a classifier whose third micro-batch at FAIL_STEP
#     comes from a shard labelled with a newer label map (class id 5 of a 5-class head): the
#     cross-entropy raises after two micro-batches were already accumulated; the script dies.
def micro_ce(model: nn.Module, micro: Any, step: int) -> torch.Tensor:
    x, y = micro
    return F.cross_entropy(model(x), y)  # <origin:accum_ce>


@case("grad_accumulation_third_micro_batch_label_from_new_label_map",
      Want("exception", "forward", "aten.nll_loss_forward.default", None, "accum_ce", "label_out_of_range",
           action="raised"))
def _accum_label() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))
    g = torch.Generator().manual_seed(1603)

    def micro(bad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 5, (4,), generator=g)
        if bad:
            y[2] = 5
        return torch.randn(4, 10, generator=g), y

    batches = [[micro(s == FAIL_STEP and i == 2) for i in range(4)] for s in range(STEPS)]
    return Program(model, sgd(model), batches, micro_ce, accum=True)


# ======================================================================= 7. distillation
# Self-distillation from an EMA teacher (mean teacher / DINO-style): the teacher is an unwatched
# copy updated in place under no_grad at the start of each step, and its softened probabilities
# are computed before the student's forward. KL(teacher || student) is written by hand as
# sum p_t (log p_t - log p_s): a raw-unit batch saturates the teacher's softmax, p_t = 0 for some
# classes, log(0) = -inf and 0 * -inf = NaN. The infinity was made by log, which is the origin.
def make_kd_loss(teacher: nn.Module, temperature: float = 2.0, decay: float = 0.9) -> Callable:
    def kd_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
        x, y = batch
        with torch.no_grad():
            for pt, ps in zip(teacher.parameters(), model.parameters()):
                pt.mul_(decay).add_(ps, alpha=1 - decay)
            p_t = F.softmax(teacher(x) / temperature, -1)
        logits = model(x)
        log_p_s = F.log_softmax(logits / temperature, -1)
        kl = (p_t * (torch.log(p_t) - log_p_s)).sum(-1).mean()  # <origin:kd_teacher_log>
        return F.cross_entropy(logits, y) + temperature ** 2 * kl

    return kd_loss


@case("ema_teacher_hand_written_kl_saturated_teacher",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "kd_teacher_log", "log_nonpositive"))
def _kd() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))
    teacher = copy.deepcopy(model).requires_grad_(False)
    g = torch.Generator().manual_seed(1701)

    def batch(step: int, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 10, generator=g)
        if raw:
            x[3] *= 1e3
        return x, torch.randint(0, 5, (8,), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), make_kd_loss(teacher))


# ======================================================================= 8. torch.compile
# 8a. A count-feature model compiled with aot_eager whose feature module takes log(counts)
#     (log1p was meant): a zero count gives -inf, which the first Linear mixes into NaN.
class LogCounts(nn.Module):
    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return torch.log(counts)  # <origin:compiled_log>


class CountModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = LogCounts()
        self.net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return self.net(self.features(counts)).squeeze(-1)


@case("compiled_count_model_log_of_zero_count",
      Want("nonfinite_loss", "forward", "aten.log.default", "features", "compiled_log", "log_nonpositive"))
def _compiled_log() -> Program:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = CountModel()
    g = torch.Generator().manual_seed(1801)

    def batch(step: int, zero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.randint(1, 50, (8, 6), generator=g).float()
        if zero:
            counts[2, 4] = 0.0
        return counts, torch.randn(8, generator=g)

    opt = sgd(model, 1e-3)
    return Program(torch.compile(model, backend="aot_eager"), opt, _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# 8b. A compiled prototype network: a bias-free encoder and fixed class prototypes, one of them
#     the origin (the "background" prototype); a blank input embeds exactly onto it, the distance
#     sqrt(0) is finite but its derivative is infinite: NaN gradients.
class Prototypes(nn.Module):
    def __init__(self, d: int = 8, classes: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(11)
        protos = torch.randn(classes, d, generator=g)
        protos[0] = 0.0
        self.register_buffer("protos", protos)

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        return -((e[:, None] - self.protos) ** 2).sum(-1).sqrt()  # <origin:proto_sqrt>


class ProtoNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(10, 32, bias=False), nn.ReLU(), nn.Linear(32, 8, bias=False))
        self.proto = Prototypes()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proto(self.encoder(x))


@case("compiled_prototype_net_blank_input_on_zero_prototype",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", "proto", "proto_sqrt", "grad_singularity"))
def _compiled_proto() -> Program:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ProtoNet()
    g = torch.Generator().manual_seed(1802)

    def batch(step: int, blank: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(6, 10, generator=g)
        if blank:
            x[2] = 0.0
        return x, torch.randint(0, 4, (6,), generator=g)

    opt = sgd(model)
    return Program(torch.compile(model, backend="aot_eager"), opt, _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# ===================================================================== 9. sequence models
# 9a. An LSTM tagger that packs its padded batch; a sentence emptied by the tokenizer's filter has
#     length 0 and pack_padded_sequence refuses it (a finite value outside the op's domain).
class PackedTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 8, padding_idx=0)
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.emb(tokens), lengths, batch_first=True, enforce_sorted=False)  # <origin:pack>
        _, (h, _) = self.lstm(packed)
        return self.head(h[-1])


@case("lstm_pack_padded_zero_length_sentence",
      Want("exception", "forward", "aten._pack_padded_sequence.default", "", "pack", "domain_error", action="raised"))
def _packed() -> Program:
    torch.manual_seed(0)
    model = PackedTagger()
    g = torch.Generator().manual_seed(1901)

    def batch(step: int, empty: bool = False) -> tuple[torch.Tensor, ...]:
        lengths = torch.randint(2, 7, (4,), generator=g)
        if empty:
            lengths[1] = 0
        tokens = torch.randint(1, 30, (4, 6), generator=g)
        tokens[torch.arange(6)[None] >= lengths[:, None]] = 0
        return tokens, lengths, torch.randint(0, 3, (4,), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0], b[1]), b[2]))


# 9b. A Transformer encoder classifier with src_key_padding_mask and a masked mean pool; one text
#     is empty after cleaning (every position padded). Checked in torch 2.13: the encoder layers'
#     attention (scaled_dot_product_attention) returns finite values for a fully masked row, so
#     the first NaN is the pooling's 0 / 0.
class EncoderClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 2)

    def forward(self, tokens: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.emb(tokens), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).float()
        return self.head((h * keep).sum(1) / keep.sum(1))  # <origin:enc_pool>


@case("transformer_encoder_fully_padded_text_mean_pool",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "", "enc_pool", "div_by_zero"))
def _encoder() -> Program:
    torch.manual_seed(0)
    model = EncoderClassifier()
    g = torch.Generator().manual_seed(1902)

    def batch(step: int, empty: bool = False) -> tuple[torch.Tensor, ...]:
        pad = torch.zeros(4, 7, dtype=torch.bool)
        pad[0, 5:] = True
        if empty:
            pad[3] = True
        return torch.randint(1, 30, (4, 7), generator=g), pad, torch.randint(0, 2, (4,), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0], b[1]), b[2]))


# ================================================================================ 10. tabular
# 10a. Features standardised with the batch's own statistics before the forward; in one batch
#      every row comes from the same store, so the "store size" column is constant: 0 / 0. The
#      model receives the NaN (kind: a non-finite input was observed), but the batch did not carry
#      it: the division before the forward made it.
def tabular_step(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    x = (x - x.mean(0)) / x.std(0)  # <origin:tab_std>
    return F.mse_loss(model(x).squeeze(-1), y)


@case("tabular_batch_standardisation_constant_column",
      Want("nonfinite_input", "forward", "aten.div.Tensor", None, "tab_std", "zero_variance_norm"))
def _tab_std() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 32), nn.ReLU(), nn.Linear(32, 1))
    g = torch.Generator().manual_seed(2001)

    def batch(step: int, one_store: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 5, generator=g) * 3 + 10
        if one_store:
            x[:, 1] = 3.0
        return x, torch.randn(8, generator=g)

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), tabular_step)


# 10b. Sales forecasting on log-sales: features go through log1p, but the target through log; a
#      day with zero sales gives a -inf target and an infinite squared error.
def log_target_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, sales = batch
    pred = model(torch.log1p(x)).squeeze(-1)
    target = torch.log(sales)  # <origin:log_target>
    return F.mse_loss(pred, target)


@case("sales_forecast_log_target_zero_sales",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "log_target", "log_nonpositive"))
def _log_target() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))
    g = torch.Generator().manual_seed(2002)

    def batch(step: int, zero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        sales = torch.randint(1, 100, (8,), generator=g).float()
        if zero:
            sales[6] = 0.0  # the shop was closed
        return torch.randint(0, 20, (8, 6), generator=g).float(), sales

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), log_target_loss)


# ======================================================================= 11. MoCo
# MoCo v2 with a memory queue (a buffer enqueued in the forward) and a momentum key encoder
# updated under no_grad in the forward; the inverse temperature is learned per sample, as
# exp(log-scale head) on the query features, with no clamp: a raw-unit query image drives the
# log-scale past 88.7 and exp overflows.
class MoCo(nn.Module):
    def __init__(self, dim: int = 8, queue: int = 16, m: float = 0.99) -> None:
        super().__init__()
        self.m = m
        self.body_q = nn.Sequential(nn.Linear(12, 32), nn.ReLU())
        self.proj_q = nn.Linear(32, dim)
        self.scale_head = nn.Linear(32, 1)
        self.body_k = copy.deepcopy(self.body_q).requires_grad_(False)
        self.proj_k = copy.deepcopy(self.proj_q).requires_grad_(False)
        self.register_buffer("queue", F.normalize(torch.randn(dim, queue), dim=0))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    def forward(self, im_q: torch.Tensor, im_k: torch.Tensor) -> torch.Tensor:
        hq = self.body_q(im_q)
        q = F.normalize(self.proj_q(hq), dim=1)
        with torch.no_grad():
            for pq, pk in zip([*self.body_q.parameters(), *self.proj_q.parameters()],
                              [*self.body_k.parameters(), *self.proj_k.parameters()]):
                pk.mul_(self.m).add_(pq.detach(), alpha=1 - self.m)
            k = F.normalize(self.proj_k(self.body_k(im_k)), dim=1)
        l_pos = (q * k).sum(1, keepdim=True)
        l_neg = q @ self.queue.clone().detach()
        logits = torch.cat([l_pos, l_neg], 1) * torch.exp(self.scale_head(hq))  # <origin:moco_scale>
        with torch.no_grad():
            i = int(self.ptr)
            self.queue[:, i:i + k.shape[0]] = k.t()
            self.ptr.fill_((i + k.shape[0]) % self.queue.shape[1])
        return logits


@case("moco_queue_learned_inverse_temperature_exp_overflow",
      Want("nonfinite_loss", "forward", "aten.exp.default", "", "moco_scale", "exp_overflow"))
def _moco() -> Program:
    torch.manual_seed(0)
    model = MoCo()
    raw = aligned(lambda v: model.scale_head(model.body_q(v)), 12, +1.0, 1e3, 2101)
    g = torch.Generator().manual_seed(2101)

    def batch(step: int, bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(4, 12, generator=g)
        if bad:
            x[1] = raw
        return x + 0.1 * torch.randn(4, 12, generator=g), x + 0.1 * torch.randn(4, 12, generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0], b[1]), torch.zeros(b[0].shape[0], dtype=torch.long)))


# ======================================================================= the tests
@pytest.mark.parametrize("name,mode", case_params(CASES, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    assert_diagnosis(train(build(), replayable=mode == "replayable"), want, JUDGE)


def _plain_state(program: Program) -> dict[str, torch.Tensor]:
    """The model's state (parameters and buffers) after the program ran without nantrace, its
    updates of its failing steps skipped (what ``on_anomaly="skip"`` promises) or the run ended there."""
    model, opt = program.model, program.optimizer
    for step, batch in enumerate(program.batches):
        if program.before_step is not None:
            with torch.no_grad():
                program.before_step(model, step)
        opt.zero_grad()
        try:
            loss = run_step(program, program.loss, batch, step)
        except Exception:
            break
        if bool(torch.isfinite(loss).all()) and _finite(p.grad for p in model.parameters()):
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name,mode", [pytest.param(n, m, id=f"{n}-{m}", marks=[pytest.mark.xfail(
    strict=True, reason=STATE_XFAIL[n])] if n in STATE_XFAIL and (n, m) not in STATE_OK else [])
    for n in CASES for m in MODES])
def test_replay_leaves_training_state_alone(name: str, mode: str) -> None:
    """Diagnosing the failure (replays of the forwards, the prelude, the loss code) changes nothing
    of the model: parameters (trained or not) and buffers end as in a plain run that skipped the
    failing step's update."""
    build, _ = CASES[name]
    reference = _plain_state(build())
    program = build()
    train(program, replayable=mode == "replayable")
    state = program.model.state_dict()
    differ = [k for k in reference if not torch.equal(torch.nan_to_num(reference[k].float(), 1.0, 2.0, 3.0),
                                                       torch.nan_to_num(state[k].float(), 1.0, 2.0, 3.0))]
    assert not differ, differ


def _finite(ts: Any) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in ts)


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction itself: without nantrace, the program fails at FAIL_STEP and not before,
    in the way the expectation says (raises / non-finite loss / finite loss and non-finite
    gradient)."""
    build, want = CASES[name]
    program = build()
    model, opt = program.model, program.optimizer
    for step, batch in enumerate(program.batches):
        if program.before_step is not None:
            with torch.no_grad():
                program.before_step(model, step)
        opt.zero_grad()
        try:
            loss = run_step(program, program.loss, batch, step)
        except Exception:
            assert want.kind == "exception" and step == want.step, (name, step)
            return
        loss_ok = bool(torch.isfinite(loss).all())
        grads_ok = _finite(p.grad for p in model.parameters())
        opt.step()
        params_ok = _finite(model.parameters())
        if step != want.step:
            assert loss_ok and grads_ok and params_ok, (name, step)
            continue
        if want.kind in ("nonfinite_loss", "nonfinite_input"):
            assert not loss_ok, name
        elif want.kind == "nonfinite_grad":
            assert loss_ok and not grads_ok, name
        else:
            raise AssertionError(f"{name} did not raise at step {step}")
        return
    raise AssertionError(f"{name} never failed")
