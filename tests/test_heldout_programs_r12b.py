"""Held-out failures, round 12b: program families from domains the earlier rounds left out, each a small
stand-alone training script (a model class, its loss, a loop over synthetic batches).

1. Point clouds: a PCN-style autoencoder whose partial scans are zero-padded to a fixed size and whose
   predictions are masked by multiplication, trained with the L1 Chamfer distance ``sqrt`` of squared
   distances (a padded predicted point meets a padded ground-truth point at distance exactly 0).
2. Audio: a keyword spotter with a learnable STFT front end (two bias-free Conv1d filterbanks,
   magnitude ``sqrt(re^2 + im^2)``) on Speech Commands' generated ``_silence_`` clip (all zeros); a
   vocoder trained with the multi-resolution STFT loss whose spectral-convergence term is divided per
   utterance by the norm of the target's magnitude, on a target segment of digital silence; a singing-voice
   F0 model trained with a loss in cents, ``log2(f0_pred / f0_target)``, whose unvoiced frames (0 Hz from the
   pitch tracker) are masked by multiplying with the voicing flag after the ratio.
3. Detection: a hand port of YOLO's CIoU loss without its ``eps`` on the box heights, on a point
   annotation (a head point converted to a box of size 0).
4. Segmentation: the Focal Tversky loss ``(1 - TI) ** (1 / gamma)`` with smoothing, the prediction masked
   by a brain ROI, on a background patch sampled entirely outside the ROI (TI is exactly 1).
5. Recommendation: a two-tower retrieval model with in-batch softmax and the logQ correction of the item
   sampling frequency read from a frequency snapshot, on a batch with an item newer than the snapshot
   (frequency 0); a CTR model trained by a hand-written frequency-adaptive SGD (per-row step
   ``grad / sqrt(count)``) whose item counts are reset at the epoch boundary.
6. VQ: a soft vector quantiser with a codebook-usage entropy bonus computed from the batch-mean of the soft
   assignments, a dead code far from every encoding, and a temperature dropped 10x at a milestone.
7. Time series: DeepAR with a negative-binomial head whose per-series dispersion embedding is
   zero-initialised for cold-start series and kept >= 0 by a ReLU: once with the log-likelihood written
   out with ``lgamma``, once with ``torch.distributions.NegativeBinomial`` in the loss code and once built
   by the model's forward (GluonTS style), where its argument validation raises.
8. Graphs: a molecule MPNN whose global mean pool divides by ``bincount`` of the graph index, on a
   molecule without heavy atoms; a GraphSAGE model on neighbour-sampled subgraphs, one of whose edges points
   at a node the sampler did not keep (the gather raises).
9. QUIET programs (the same code with its guard done right): the Chamfer distance with ``sqrt`` of
   ``clamp_min(1e-12)``, the learnable STFT with ``eps`` inside the root, a smoothed soft Dice on the same
   background patch, the logQ correction with the frequency clamped, the cents loss over voiced frames only.

How expectations were derived (before nantrace ran): from /work/shared/API.md and docs/diagnosis.md. The
origin is the first op that made a non-finite value from finite inputs; for a gradient, the forward op
whose derivative made the first non-finite gradient; module = the innermost module running the op (None
in the loss code); source = the marked line (the optimizer's own line for a Python optimizer). A divisor
that is a norm of an all-zero slice is ``zero_variance_norm`` (as round 4's SI-SNR of a silent reference);
a divisor that is a count or a difference (a box's height) is ``div_by_zero``; a zero divisor in the
optimizer read from a module's buffer is ``div_by_zero``. A value rejected by torch.distributions'
validation names the op that made it, ``domain_error``; an advanced index outside its dimension is
``label_out_of_range``.
Every construction is checked with plain torch (``test_cases_fail_without_nantrace``): the step and stage
of the first non-finite value (or the step that raised and its message), the first op that made a
non-finite value (round 8b's ``Made``) and nothing made non-finite before; for backward cases the first
autograd node whose output gradient is non-finite from finite incoming gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from heldout_harness import Judge, Program, assert_diagnosis, case_params, describe, run_step, train
from test_heldout_programs_r8b import Made, _finite
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread", "distributions_validate")]  # an earlier torch.compile turns validation off

JUDGE = Judge(__file__)
FAIL_STEP, STEPS = 3, 5

CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
NODE: dict[str, str] = {}
"""Backward cases -> the autograd node that first turns finite incoming gradients non-finite."""
RAISES: dict[str, tuple[type, str]] = {}
"""Raising cases -> the exception type and a piece of its message."""
QUIET: dict[str, Callable[[], Program]] = {}
_CLONE_IDENTITY = (
    "nantrace: kind nonfinite_param, op None, source None, cause optimizer_state ('a replay of the update from the "
    "same values stayed finite'); right: op aten.div.Tensor at the optimizer's marked line, cause div_by_zero (a zero "
    "divisor read from a module buffer, docs/diagnosis.md). Mechanism: diagnosis/update_replay.py _replica() copies "
    "the optimizer's __dict__ shallowly but steps a *clone* of the parameter (_clone_param), so the optimizer's own "
    "identity test `p is self.row_param` is False in the replay, it takes the plain-SGD branch, the update stays "
    "finite (replay.reproduced False), and the incident builder in update_replay.py (`cause = replay.cause if "
    "replay.reproduced else 'optimizer_state'`) falls back to optimizer_state.")
XFAIL: dict[str, str] = {}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""


CHAIN: dict[str, tuple[str, str]] = {}
"""Cases whose NaN is created by one op from an infinity another op made -> (the NaN-creating op, the op that made
its infinite input); the origin rule names the latter."""


def case(name: str, want: Want, node: str | None = None, raises: tuple[type, str] | None = None,
         chain: tuple[str, str] | None = None) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in CASES, name
        CASES[name] = (build, want)
        if chain:
            CHAIN[name] = chain
        if node:
            NODE[name] = node
        if raises:
            RAISES[name] = raises
        return build

    return register


def quiet_case(name: str) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in QUIET, name
        QUIET[name] = build
        return build

    return register


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _steps(batch: Callable[[int], Any], n: int = STEPS) -> list[Any]:
    return [batch(s) for s in range(n)]


# ================================================================= 1. point clouds
class PointAutoencoder(nn.Module):
    """PCN-style: a shared point MLP, a masked max pool, an MLP decoder to a fixed number of points; the
    predictions of padded slots are zeroed by multiplying with the validity mask."""

    def __init__(self, n: int = 24) -> None:
        super().__init__()
        self.n = n
        self.encoder = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 64))
        self.decoder = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, n * 3))

    def forward(self, pts: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        feat = self.encoder(pts).masked_fill(~valid[..., None], -1e4).amax(1)
        return self.decoder(feat).view(-1, self.n, 3) * valid[..., None]


def chamfer_l1(pred: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
    d2 = ((pred[:, :, None] - gt[:, None]) ** 2).sum(-1)
    d = torch.sqrt(d2)  # <origin:chamfer_sqrt>
    return d.min(2).values.mean() + d.min(1).values.mean()


def chamfer_l1_clamped(pred: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
    d2 = ((pred[:, :, None] - gt[:, None]) ** 2).sum(-1)
    d = torch.sqrt(d2.clamp_min(1e-12))
    return d.min(2).values.mean() + d.min(1).values.mean()


def _scans(seed: int) -> list[Any]:
    g = _gen(seed)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        pts = torch.randn(4, 24, 3, generator=g)
        pts = pts / pts.norm(dim=-1, keepdim=True)  # points on the unit sphere
        valid = torch.ones(4, 24, dtype=torch.bool)
        if step == FAIL_STEP:  # a partial scan with 16 returns, zero-padded by the collate function
            valid[1, 16:] = False
            pts[1, 16:] = 0.0
        return pts, valid

    return _steps(batch)


def _pcn_program(loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Program:
    torch.manual_seed(0)
    model = PointAutoencoder()
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), _scans(1201),
                   lambda m, b, s: loss(m(b[0], b[1]), b[0]))


@case("pcn_autoencoder_chamfer_l1_sqrt_zero_padded_partial_scan",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", None, "chamfer_sqrt", "grad_singularity"),
      node="SqrtBackward0")
def _chamfer() -> Program:
    return _pcn_program(chamfer_l1)


@quiet_case("pcn_autoencoder_chamfer_l1_clamped_sqrt_zero_padded_partial_scan")
def _q_chamfer() -> Program:
    return _pcn_program(chamfer_l1_clamped)


# ================================================================= 2. audio
class LearnableSTFT(nn.Module):
    """A trainable STFT: bias-free Conv1d filterbanks initialised to the windowed DFT."""

    def __init__(self, n_fft: int = 32, hop: int = 16, eps: float = 0.0) -> None:
        super().__init__()
        bins = n_fft // 2 + 1
        n, k = torch.arange(n_fft).float(), torch.arange(bins).float()[:, None]
        window = torch.hann_window(n_fft, periodic=True)
        self.real = nn.Conv1d(1, bins, n_fft, stride=hop, bias=False)
        self.imag = nn.Conv1d(1, bins, n_fft, stride=hop, bias=False)
        with torch.no_grad():
            self.real.weight.copy_((torch.cos(2 * math.pi * k * n / n_fft) * window)[:, None])
            self.imag.weight.copy_((-torch.sin(2 * math.pi * k * n / n_fft) * window)[:, None])
        self.eps = eps

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        re, im = self.real(wav[:, None]), self.imag(wav[:, None])
        if self.eps:
            return torch.sqrt(re ** 2 + im ** 2 + self.eps)
        return torch.sqrt(re ** 2 + im ** 2)  # <origin:stft_sqrt>


class KeywordSpotter(nn.Module):
    def __init__(self, eps: float = 0.0, classes: int = 6) -> None:
        super().__init__()
        self.frontend = LearnableSTFT(eps=eps)
        self.body = nn.Sequential(nn.Conv1d(17, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(),
                                  nn.Linear(32, classes))

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.body(torch.log1p(self.frontend(wav)))


def _speech_commands(seed: int) -> list[Any]:
    g = _gen(seed)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        wav = 0.1 * torch.randn(8, 256, generator=g)
        y = torch.randint(0, 5, (8,), generator=g)
        if step == FAIL_STEP:  # Speech Commands' "_silence_" class: generated clips of zeros
            wav[3] = 0.0
            y[3] = 5
        return wav, y

    return _steps(batch)


@case("speech_commands_learnable_stft_frontend_sqrt_magnitude_generated_silence",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", "frontend", "stft_sqrt", "grad_singularity"),
      node="SqrtBackward0")
def _stft() -> Program:
    torch.manual_seed(0)
    model = KeywordSpotter()
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), _speech_commands(1202),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


@quiet_case("speech_commands_learnable_stft_frontend_eps_inside_sqrt_generated_silence")
def _q_stft() -> Program:
    torch.manual_seed(0)
    model = KeywordSpotter(eps=1e-9)
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), _speech_commands(1202),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


class TinyVocoder(nn.Module):
    """Mel frames (8 bands, hop 8) to a waveform: conv, transposed-conv upsampling, conv, tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Conv1d(8, 16, 3, padding=1)
        self.up = nn.ConvTranspose1d(16, 8, 8, stride=8)
        self.post = nn.Conv1d(8, 1, 7, padding=3)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = F.leaky_relu(self.pre(mel), 0.1)
        x = F.leaky_relu(self.up(x), 0.1)
        return torch.tanh(self.post(x)).squeeze(1)


def stft_mag(x: torch.Tensor, n_fft: int, hop: int) -> torch.Tensor:
    return torch.stft(x, n_fft, hop, window=torch.hann_window(n_fft), return_complex=True).abs()


def multires_stft_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = pred.new_zeros(())
    for n_fft, hop in ((32, 8), (64, 16)):
        pm, tm = stft_mag(pred, n_fft, hop), stft_mag(target, n_fft, hop)
        sc = torch.norm(tm - pm, p="fro", dim=(1, 2)) / torch.norm(tm, p="fro", dim=(1, 2))  # <origin:spectral_conv>
        mag = F.l1_loss(torch.log(pm + 1e-7), torch.log(tm + 1e-7))
        loss = loss + sc.mean() + mag
    return loss / 2


@case("vocoder_multires_stft_spectral_convergence_silent_target_segment",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "spectral_conv", "zero_variance_norm"))
def _vocoder() -> Program:
    torch.manual_seed(0)
    model = TinyVocoder()
    g = _gen(1203)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        mel, wav = torch.randn(4, 8, 16, generator=g), 0.3 * torch.randn(4, 128, generator=g)
        if step == FAIL_STEP:  # a segment cropped from a pause of digital silence
            mel[2], wav[2] = -11.5, 0.0  # log(1e-5), the mel floor
        return mel, wav

    return Program(model, torch.optim.Adam(model.parameters(), lr=2e-4), _steps(batch),
                   lambda m, b, s: multires_stft_loss(m(b[0]), b[1]))


# ================================================================= 3. detection
class BoxHead(nn.Module):
    """One box per image from a pooled feature: (cx, cy, w, h) with softplus sizes, decoded to xyxy."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        out = self.net(feat)
        c, wh = torch.sigmoid(out[:, :2]), F.softplus(out[:, 2:]) * 0.2
        return torch.cat([c - wh / 2, c + wh / 2], -1)


def ciou_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """YOLO's CIoU, hand-ported without the ``eps`` on the heights."""
    px1, py1, px2, py2 = pred.unbind(-1)
    tx1, ty1, tx2, ty2 = target.unbind(-1)
    w1, h1, w2, h2 = px2 - px1, py2 - py1, tx2 - tx1, ty2 - ty1
    inter = (torch.min(px2, tx2) - torch.max(px1, tx1)).clamp(0) * (torch.min(py2, ty2) - torch.max(py1, ty1)).clamp(0)
    union = w1 * h1 + w2 * h2 - inter
    iou = inter / union
    cw, ch = torch.max(px2, tx2) - torch.min(px1, tx1), torch.max(py2, ty2) - torch.min(py1, ty1)
    c2 = cw ** 2 + ch ** 2
    rho2 = ((tx1 + tx2 - px1 - px2) ** 2 + (ty1 + ty2 - py1 - py2) ** 2) / 4
    v = (4 / math.pi ** 2) * (torch.atan(w2 / h2) - torch.atan(w1 / h1)) ** 2  # <origin:ciou_aspect>
    with torch.no_grad():
        alpha = v / (v - iou + 1)
    return (1 - iou + rho2 / c2 + v * alpha).mean()


@case("yolo_ciou_hand_port_without_eps_point_annotation",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "ciou_aspect", "div_by_zero"))
def _ciou() -> Program:
    torch.manual_seed(0)
    model = BoxHead()
    g = _gen(1204)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = 0.2 + 0.6 * torch.rand(8, 2, generator=g)
        wh = 0.05 + 0.2 * torch.rand(8, 2, generator=g)
        if step == FAIL_STEP:  # a head point from a crowd dataset converted to a box of size 0
            wh[5] = 0.0
        return torch.randn(8, 16, generator=g), torch.cat([c - wh / 2, c + wh / 2], -1)

    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), _steps(batch),
                   lambda m, b, s: ciou_loss(m(b[0]), b[1]))


# ================================================================= 4. segmentation
class TinySegNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(8, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def focal_tversky(logits: torch.Tensor, target: torch.Tensor, roi: torch.Tensor, alpha: float = 0.7,
                  beta: float = 0.3, gamma: float = 4 / 3, smooth: float = 1.0) -> torch.Tensor:
    p = torch.sigmoid(logits) * roi  # only the brain counts
    tp = (p * target).sum((1, 2, 3))
    fn = ((1 - p) * target).sum((1, 2, 3))
    fp = (p * (1 - target)).sum((1, 2, 3))
    ti = (tp + smooth) / (tp + alpha * fn + beta * fp + smooth)
    return ((1 - ti) ** (1 / gamma)).mean()  # <origin:focal_tversky>


def soft_dice(logits: torch.Tensor, target: torch.Tensor, roi: torch.Tensor, smooth: float = 1.0) -> torch.Tensor:
    p = torch.sigmoid(logits) * roi
    inter = (p * target).sum((1, 2, 3))
    dice = (2 * inter + smooth) / (p.sum((1, 2, 3)) + target.sum((1, 2, 3)) + smooth)
    return (1 - dice).mean()


def _mri_patches(seed: int) -> list[Any]:
    g = _gen(seed)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        img = torch.randn(4, 1, 12, 12, generator=g)
        target = (torch.rand(4, 1, 12, 12, generator=g) > 0.8).float()
        roi = torch.ones(4, 1, 12, 12)
        if step == FAIL_STEP:  # the patch sampler's random location fell entirely outside the brain mask
            roi[2], target[2] = 0.0, 0.0
        return img, target, roi

    return _steps(batch)


@case("brain_mri_focal_tversky_smoothed_background_patch_outside_roi",
      Want("nonfinite_grad", "backward", "aten.pow.Tensor_Scalar", None, "focal_tversky", "grad_singularity"),
      node="PowBackward0")
def _tversky() -> Program:
    torch.manual_seed(0)
    model = TinySegNet()
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), _mri_patches(1205),
                   lambda m, b, s: focal_tversky(m(b[0]), b[1], b[2]))


@quiet_case("brain_mri_soft_dice_smoothed_background_patch_outside_roi")
def _q_dice() -> Program:
    torch.manual_seed(0)
    model = TinySegNet()
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), _mri_patches(1205),
                   lambda m, b, s: soft_dice(m(b[0]), b[1], b[2]))


# ================================================================= 5. recommendation
class TwoTower(nn.Module):
    def __init__(self, users: int = 30, items: int = 50) -> None:
        super().__init__()
        self.user_tower = nn.Sequential(nn.Embedding(users, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
        self.item_tower = nn.Sequential(nn.Embedding(items, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.normalize(self.user_tower(users), dim=-1), F.normalize(self.item_tower(items), dim=-1)


def in_batch_softmax_logq(u: torch.Tensor, v: torch.Tensor, items: torch.Tensor, item_freq: torch.Tensor,
                          temperature: float = 0.05) -> torch.Tensor:
    logits = u @ v.T / temperature
    logits = logits - torch.log(item_freq[items])[None, :]  # <origin:logq>
    return F.cross_entropy(logits, torch.arange(len(items)))


def in_batch_softmax_logq_clamped(u: torch.Tensor, v: torch.Tensor, items: torch.Tensor, item_freq: torch.Tensor,
                                  temperature: float = 0.05) -> torch.Tensor:
    logits = u @ v.T / temperature
    logits = logits - torch.log(item_freq[items].clamp_min(1e-6))[None, :]
    return F.cross_entropy(logits, torch.arange(len(items)))


def _retrieval(loss: Callable[..., torch.Tensor]) -> Program:
    torch.manual_seed(0)
    model = TwoTower()
    g = _gen(1206)
    counts = torch.randint(1, 100, (50,), generator=g).float()
    counts[45:] = 0.0  # items added to the catalogue after the frequency snapshot
    item_freq = counts / counts.sum()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        items = torch.randperm(45, generator=g)[:12]
        if step == FAIL_STEP:
            items[7] = 47
        return torch.randint(0, 30, (12,), generator=g), items

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), _steps(batch),
                   lambda m, b, s: loss(*m(b[0], b[1]), b[1], item_freq))


@case("two_tower_in_batch_softmax_logq_correction_item_newer_than_frequency_snapshot",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "logq", "log_nonpositive"))
def _logq() -> Program:
    return _retrieval(in_batch_softmax_logq)


@quiet_case("two_tower_in_batch_softmax_logq_correction_frequency_clamped")
def _q_logq() -> Program:
    return _retrieval(in_batch_softmax_logq_clamped)


class CTRModel(nn.Module):
    """User and item embeddings and an MLP; counts the items it sees in training (per epoch)."""

    def __init__(self, users: int = 20, items: int = 30) -> None:
        super().__init__()
        self.user_emb = nn.Embedding(users, 8)
        self.item_emb = nn.Embedding(items, 8)
        self.mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
        self.register_buffer("item_counts", torch.ones(items))

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.item_counts.index_add_(0, items, torch.ones(len(items)))
        return self.mlp(torch.cat([self.user_emb(users), self.item_emb(items)], -1)).squeeze(-1)


class FrequencyAdaptiveSGD(torch.optim.Optimizer):
    """SGD whose embedding rows step by ``lr / sqrt(count)`` (frequent items take smaller steps)."""

    def __init__(self, params: Any, row_param: torch.Tensor, counts: torch.Tensor, lr: float = 0.05) -> None:
        super().__init__(params, dict(lr=lr))
        self.row_param, self.counts = row_param, counts

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p is self.row_param:
                    p.add_(p.grad / self.counts.sqrt()[:, None], alpha=-group["lr"])  # <origin:freq_sgd>
                else:
                    p.add_(p.grad, alpha=-group["lr"])


@case("ctr_frequency_adaptive_sgd_item_counts_reset_at_epoch_boundary",
      Want("nonfinite_param", "optimizer", "aten.div.Tensor", "item_emb", "freq_sgd", "div_by_zero"))
def _freq_sgd() -> Program:
    torch.manual_seed(0)
    model = CTRModel()
    opt = FrequencyAdaptiveSGD(model.parameters(), model.item_emb.weight, model.item_counts)
    g = _gen(1207)

    def before(m: nn.Module, step: int) -> None:
        if step == FAIL_STEP:  # a new epoch: the counts are per epoch
            m.item_counts.zero_()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.randint(0, 20, (16,), generator=g), torch.randint(0, 30, (16,), generator=g),
                torch.randint(0, 2, (16,), generator=g).float())

    return Program(model, opt, _steps(batch), lambda m, b, s: F.binary_cross_entropy_with_logits(m(b[0], b[1]), b[2]),
                   before_step=before)


# ================================================================= 6. vector quantisation
class SoftVQ(nn.Module):
    """Soft assignments to a codebook at a temperature; returns the quantised vectors and the entropy of the
    batch's codebook usage (a bonus that keeps codes alive)."""

    def __init__(self, codes: int = 8, dim: int = 4) -> None:
        super().__init__()
        self.codebook = nn.Parameter(torch.randn(codes, dim) * 0.5)
        with torch.no_grad():
            self.codebook[-1] = 4.0  # k-means++ init picked an outlier of the init batch
        self.tau = 1.0

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = ((z[:, None] - self.codebook[None]) ** 2).sum(-1)
        probs = torch.softmax(-d / self.tau, -1)
        usage = probs.mean(0)
        entropy = -(usage * torch.log(usage)).sum()  # <origin:vq_usage_log>
        return probs @ self.codebook, entropy


class SoftVQAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
        self.quantizer = SoftVQ()
        self.decoder = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 12))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, entropy = self.quantizer(self.encoder(x))
        return self.decoder(q), entropy


@case("soft_vq_codebook_usage_entropy_dead_code_temperature_milestone",
      Want("nonfinite_loss", "forward", "aten.log.default", "quantizer", "vq_usage_log", "log_nonpositive"))
def _soft_vq() -> Program:
    torch.manual_seed(0)
    model = SoftVQAE()
    g = _gen(1208)

    def before(m: nn.Module, step: int) -> None:
        m.quantizer.tau = 1.0 if step < FAIL_STEP else 0.1  # MultiStep: x0.1 at the milestone

    def loss(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        recon, entropy = m(x)
        return F.mse_loss(recon, x) - 0.1 * entropy

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                   _steps(lambda s: torch.randn(32, 12, generator=g)), loss, before_step=before)


# ================================================================= 7. time series
class DeepARNB(nn.Module):
    """DeepAR with a negative-binomial head: mean from the GRU, dispersion per series (cold-start series
    zero-initialised; a ReLU keeps it >= 0)."""

    def __init__(self, series: int = 24, known: int = 20) -> None:
        super().__init__()
        self.series_emb = nn.Embedding(series, 4)
        self.rnn = nn.GRU(5, 16, batch_first=True)
        self.mu_head = nn.Linear(16, 1)
        self.dispersion = nn.Embedding(series, 1)
        with torch.no_grad():
            self.dispersion.weight[:known].uniform_(0.5, 1.5)
            self.dispersion.weight[known:] = 0.0

    def forward(self, series: torch.Tensor, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.series_emb(series)[:, None].expand(-1, history.shape[1], -1)
        h, _ = self.rnn(torch.cat([torch.log1p(history)[..., None], e], -1))
        mu = F.softplus(self.mu_head(h)).squeeze(-1) + 1e-3
        return mu, F.relu(self.dispersion(series))


def nb_nll(mu: torch.Tensor, theta: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    ll = (torch.lgamma(y + theta) - torch.lgamma(theta) - torch.lgamma(y + 1)
          + theta * torch.log(theta / (theta + mu)) + y * torch.log(mu / (theta + mu)))  # <origin:nb_log>
    return -ll.mean()


def nb_nll_distribution(mu: torch.Tensor, theta: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    probs = mu / (mu + theta)  # <origin:nb_probs>
    return -torch.distributions.NegativeBinomial(total_count=theta, probs=probs).log_prob(y).mean()


def _sales(seed: int) -> list[Any]:
    g = _gen(seed)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        series = torch.randint(0, 20, (8,), generator=g)
        if step == FAIL_STEP:  # a store that opened after the model was set up
            series[4] = 22
        counts = torch.poisson(5 * torch.rand(8, 1, generator=g).expand(8, 13) + 1, generator=g)
        return series, counts[:, :-1], counts[:, 1:] + 1  # sales are >= 1 on open days

    return _steps(batch)


# With theta = 0, lgamma(theta) = inf is the first non-finite value in execution order (the expectation first
# written: lgamma, on the line above), but it only makes the sum -inf; the NaN of the loss is created by
# ``theta * log(theta / (theta + mu))`` = 0 * log(0) = 0 * -inf, and the infinity it received was made by that
# log. PRODUCT.md's origin rule follows the failing value's dataflow, so the origin is the log (corrected after
# nantrace answered so; the construction test checks the chain: CHAIN below).
@case("deepar_negative_binomial_lgamma_cold_start_series_zero_dispersion",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "nb_log", "log_nonpositive"),
      chain=("aten.mul.Tensor", "aten.log.default"))
def _nb() -> Program:
    torch.manual_seed(0)
    model = DeepARNB()
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), _sales(1209),
                   lambda m, b, s: nb_nll(*m(b[0], b[1]), b[2]))


@case("deepar_negative_binomial_distribution_cold_start_series_probs_one_raises",
      Want("exception", "forward", "aten.div.Tensor", None, "nb_probs", "domain_error", action="raised"),
      raises=(ValueError, "HalfOpenInterval"))
def _nb_dist() -> Program:
    torch.manual_seed(0)
    model = DeepARNB()
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), _sales(1209),
                   lambda m, b, s: nb_nll_distribution(*m(b[0], b[1]), b[2]))


class F0Predictor(nn.Module):
    """Singing-voice F0 from frame features: a GRU and a softplus head, in Hz."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(10, 16, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return 100.0 + 50.0 * F.softplus(self.head(self.rnn(feats)[0])).squeeze(-1)


def cents_loss(f0_pred: torch.Tensor, f0_target: torch.Tensor, voiced: torch.Tensor) -> torch.Tensor:
    cents = 1200 * torch.log2(f0_pred / f0_target)  # <origin:f0_ratio>
    return (cents.abs() * voiced).sum() / voiced.sum()


def cents_loss_voiced_only(f0_pred: torch.Tensor, f0_target: torch.Tensor, voiced: torch.Tensor) -> torch.Tensor:
    keep = voiced.bool()
    return (1200 * torch.log2(f0_pred[keep] / f0_target[keep])).abs().mean()


def _phrases(seed: int) -> list[Any]:
    g = _gen(seed)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        f0 = 110.0 * 2 ** (2 * torch.rand(4, 12, generator=g))
        voiced = torch.ones(4, 12)
        if step == FAIL_STEP:  # a breath between two phrases: the pitch tracker writes 0 Hz for unvoiced frames
            f0[1, 5:8], voiced[1, 5:8] = 0.0, 0.0
        return torch.randn(4, 12, 10, generator=g), f0, voiced

    return _steps(batch)


# The log2 only passes on the infinity of f0_pred / 0; the NaN is created by ``inf * 0`` (the voiced mask), so by
# the origin rule the origin is the division (CHAIN below checks the chain).
@case("singing_f0_cents_loss_unvoiced_frames_zero_hz_masked_by_multiplication",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "f0_ratio", "div_by_zero"),
      chain=("aten.mul.Tensor", "aten.div.Tensor"))
def _f0() -> Program:
    torch.manual_seed(0)
    model = F0Predictor()
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), _phrases(1212),
                   lambda m, b, s: cents_loss(m(b[0]), b[1], b[2]))


@quiet_case("singing_f0_cents_loss_over_voiced_frames_only")
def _q_f0() -> Program:
    torch.manual_seed(0)
    model = F0Predictor()
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), _phrases(1212),
                   lambda m, b, s: cents_loss_voiced_only(m(b[0]), b[1], b[2]))


class DeepARNBOutput(DeepARNB):
    """GluonTS style: the model returns the predictive distribution itself."""

    def forward(self, series: torch.Tensor,  # type: ignore[override]
                history: torch.Tensor) -> torch.distributions.Distribution:
        mu, theta = super().forward(series, history)
        probs = mu / (mu + theta)  # <origin:nb_probs_in_model>
        return torch.distributions.NegativeBinomial(total_count=theta, probs=probs)


@case("deepar_model_returns_negative_binomial_cold_start_series_probs_one_raises",
      Want("exception", "forward", "aten.div.Tensor", "", "nb_probs_in_model", "domain_error", action="raised"),
      raises=(ValueError, "HalfOpenInterval"))
def _nb_out() -> Program:
    torch.manual_seed(0)
    model = DeepARNBOutput()
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), _sales(1209),
                   lambda m, b, s: -m(b[0], b[1]).log_prob(b[2]).mean())


# ================================================================= 8. graphs
class MPNNLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.message = nn.Linear(d, d)
        self.update = nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        agg = torch.zeros_like(h).index_add_(0, dst, self.message(h)[src])
        return F.relu(self.update(torch.cat([h, agg], -1)))


class GlobalMeanPool(nn.Module):
    def forward(self, h: torch.Tensor, batch: torch.Tensor, graphs: int) -> torch.Tensor:
        total = h.new_zeros(graphs, h.shape[1]).index_add_(0, batch, h)
        count = torch.bincount(batch, minlength=graphs)
        return total / count[:, None]  # <origin:mean_pool>


class MoleculeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.atom_emb = nn.Embedding(10, 16)
        self.layers = nn.ModuleList([MPNNLayer(16), MPNNLayer(16)])
        self.readout = GlobalMeanPool()
        self.head = nn.Linear(16, 1)

    def forward(self, atoms: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor, graphs: int) -> torch.Tensor:
        h = self.atom_emb(atoms)
        for layer in self.layers:
            h = layer(h, edge_index)
        return self.head(self.readout(h, batch, graphs)).squeeze(-1)


def _molecules(seed: int) -> list[Any]:
    g = _gen(seed)

    def batch(step: int) -> tuple[Any, ...]:
        sizes = torch.randint(3, 7, (6,), generator=g)
        if step == FAIL_STEP:  # "[H][H]": no heavy atom left once hydrogens are removed
            sizes[2] = 0
        atoms, edges, graph, start = [], [], [], 0
        for i, n in enumerate(sizes.tolist()):
            atoms.append(torch.randint(0, 10, (n,), generator=g))
            graph.append(torch.full((n,), i))
            for a in range(n - 1):  # a chain, both directions
                edges += [(start + a, start + a + 1), (start + a + 1, start + a)]
            start += n
        edge_index = torch.tensor(edges).T
        return torch.cat(atoms), edge_index, torch.cat(graph), 6, torch.randn(6, generator=g)

    return _steps(batch)


@case("molecule_mpnn_global_mean_pool_bincount_molecule_without_heavy_atoms",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "readout", "mean_pool", "div_by_zero"))
def _mol() -> Program:
    torch.manual_seed(0)
    model = MoleculeNet()
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), _molecules(1210),
                   lambda m, b, s: F.mse_loss(m(*b[:4]), b[4]))


class SAGEConv(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin_self, self.lin_neigh = nn.Linear(d_in, d_out), nn.Linear(d_in, d_out)

    def forward(self, h: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        msg = h[src]  # <origin:sage_gather>
        total = torch.zeros_like(h).index_add_(0, dst, msg)
        deg = torch.bincount(dst, minlength=h.shape[0]).clamp(min=1)
        return self.lin_self(h) + self.lin_neigh(total / deg[:, None])


class GraphSAGE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList([SAGEConv(8, 16), SAGEConv(16, 16)])
        self.classifier = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = F.relu(conv(x, edge_index))
        return self.classifier(x)


@case("graphsage_neighbour_sampler_edge_to_node_outside_sampled_subgraph",
      Want("exception", "forward", "aten.index.Tensor", "convs.0", "sage_gather", "label_out_of_range",
           action="raised"),
      raises=(IndexError, "out of bounds"))
def _sage() -> Program:
    torch.manual_seed(0)
    model = GraphSAGE()
    g = _gen(1211)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = 40
        edge_index = torch.randint(0, n, (2, 120), generator=g)
        if step == FAIL_STEP:  # an edge to a neighbour beyond the fan-out, which the sampler did not keep
            edge_index[0, 17] = n
        return torch.randn(n, 8, generator=g), edge_index, torch.randint(0, 4, (n,), generator=g)

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), _steps(batch),
                   lambda m, b, s: F.cross_entropy(m(b[0], b[1]), b[2]))


# ======================================================================= the plain runs
def _state_finite(opt: torch.optim.Optimizer) -> bool:
    return all(_finite(v for v in st.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
               for st in opt.state.values())


def plain_run(program: Program) -> dict[str, Any]:
    """Without nantrace, under the op recorder: the first step whose loss, gradients or (after the update)
    parameters / optimizer state are non-finite, or that raised."""
    model, opt = program.model, program.optimizer
    rec = Made()
    out: dict[str, Any] = dict(step=None, what=None, error=None, rec=rec)
    with rec:
        for step, batch in enumerate(program.batches):
            rec.step = step
            if program.before_step is not None:
                with torch.no_grad():
                    program.before_step(model, step)
            opt.zero_grad()
            try:
                loss = run_step(program, program.loss, batch, step)
            except Exception as exc:  # noqa: BLE001
                out.update(step=step, what="raised", error=exc)
                return out
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if not bool(torch.isfinite(loss.detach()).all()):
                out.update(step=step, what="loss")
                return out
            if not _finite(grads):
                out.update(step=step, what="grads")
                return out
            opt.step()
            if not _finite(model.parameters()):
                out.update(step=step, what="params")
                return out
            if not _state_finite(opt):
                out.update(step=step, what="state")
                return out
    return out


class NaNBirth(TorchDispatchMode):
    """Per tensor: the op that made its non-finite values from finite inputs (passed on by the ops that only carry
    them); and every op that made a NaN from inputs without NaN: (step, op, the makers of its non-finite inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.makers: dict[int, str] = {}
        self.keep: list[torch.Tensor] = []
        self.births: list[tuple[int, str, list[str | None]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        out = func(*args, **kwargs)
        name = f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}"
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.is_floating_point()]
        carried = [self.makers.get(id(a)) for a in ins if not bool(torch.isfinite(a).all())]
        for o in outs:  # an infinity passed on keeps the op that made it
            if not bool(torch.isfinite(o).all()):
                self.makers[id(o)] = name if not carried else carried[0]
                self.keep.append(o)
        if not any(bool(torch.isnan(a).any()) for a in ins) and any(bool(torch.isnan(o).any()) for o in outs):
            self.births.append((self.step, name, carried))
        return out


def _nan_birth(program: Program, step: int) -> tuple[str, list[str | None]] | None:
    """The failing step's first op that created a NaN, and the makers of its infinite inputs (fresh build)."""
    rec = NaNBirth()
    with rec:
        for s, batch in enumerate(program.batches[: step + 1]):
            rec.step = s
            program.optimizer.zero_grad()
            loss = program.loss(program.model, batch, s)
            if s < step:
                loss.backward()
                program.optimizer.step()
    births = [(op, makers) for s, op, makers in rec.births if s == step]
    return births[0] if births else None


def _first_bad_node(program: Program, step: int) -> str | None:
    """The failing step's first autograd node (in execution order) whose incoming gradients are finite and whose
    outgoing ones are not, on a fresh build trained up to that step."""
    model, opt = program.model, program.optimizer
    for s, batch in enumerate(program.batches[:step]):
        if program.before_step is not None:
            with torch.no_grad():
                program.before_step(model, s)
        opt.zero_grad()
        run_step(program, program.loss, batch, s)
        opt.step()
    if program.before_step is not None:
        with torch.no_grad():
            program.before_step(model, step)
    opt.zero_grad()
    loss = program.loss(model, program.batches[step], step)
    bad: list[str] = []

    def ok(ts: Any) -> bool:
        return all(t is None or bool(torch.isfinite(t).all()) for t in ts)

    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        node.register_hook(lambda gin, gout, n=node: bad.append(n.name()) if ok(gout) and not ok(gin) else None)
        stack.extend(nxt for nxt, _ in node.next_functions)
    loss.backward()
    return bad[0] if bad else None


WHAT = {"nonfinite_param": "params", "optimizer_state": "state", "nonfinite_grad": "grads", "nonfinite_loss": "loss",
        "exception": "raised"}


# ======================================================================= the tests
@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction: without nantrace the program fails at the expected step, in the expected stage, and
    nothing was made non-finite before; the first op that made a non-finite value is the expected one (forward
    and optimizer origins); for backward origins, the first autograd node that turned finite gradients
    non-finite is the expected op's; a raising step raised the expected error with no non-finite value made."""
    build, want = CASES[name]
    run = plain_run(build())
    rec = run["rec"]
    assert (run["step"], run["what"]) == (want.step, WHAT[want.kind]), (run["step"], run["what"], run["error"])
    assert not [m for m in rec.made if m[0] < want.step], rec.made[:4]
    if name in RAISES:
        kind, message = RAISES[name]
        assert isinstance(run["error"], kind) and message in str(run["error"]), repr(run["error"])
        assert not rec.made, rec.made[:4]
    elif name in NODE:
        assert _first_bad_node(build(), want.step) == NODE[name]
    elif name in CHAIN:
        creator, maker = CHAIN[name]
        assert _nan_birth(build(), want.step) == (creator, [maker]), _nan_birth(build(), want.step)
    else:
        assert rec.first(want.step, want.phase == "optimizer") == want.op, rec.made[:6]


@pytest.mark.parametrize("name,mode", case_params(CASES, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    assert_diagnosis(train(build(), replayable=mode == "replayable"), want, JUDGE)


@pytest.mark.parametrize("name", list(QUIET))
def test_quiet_programs_without_nantrace(name: str) -> None:
    run = plain_run(QUIET[name]())
    assert run["step"] is None and not run["rec"].made, (run["step"], run["what"], run["error"], run["rec"].made[:4])


@pytest.mark.parametrize("name,mode", case_params(QUIET, {}))
def test_quiet_programs(name: str, mode: str) -> None:
    """No incident that blocks an update, and the program trains to its end."""
    run = train(QUIET[name](), replayable=mode == "replayable")
    blocking = [describe(i) + " | " + i.summary for i in run.incidents if i.action != "logged"]
    assert not blocking, blocking
    assert run.error is None, repr(run.error)
