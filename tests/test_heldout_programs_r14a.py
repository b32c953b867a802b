"""Held-out failures, round 14a: ZERO-CODE MODE (``nantrace run train.py`` on unmodified scripts).

Every case is a stand-alone training script, written to ``tmp_path/train.py`` and run the way a
user runs it: ``python -m nantrace run --run-dir runs train.py`` in a subprocess (docs/integrations.md
"nantrace run"; src/nantrace/autowatch.py's docstring) for the scripts that raise, the quiet ones and
``SUBPROCESS``'s others; the rest in-process through ``nantrace.autowatch.run_script``, the function that
command runs (each subprocess pays for importing torch, about 5 s of this suite's time). The incidents are read back from the run
store(s) (``runs``, and ``runs/<n>-<Model>`` for a second optimizer) and the first blocking one
(action other than ``logged``) is compared with the expectation on (step, kind, phase, op, module,
cause, action, source file:line); quiet scripts must print their normal output, exit 0 and record
no incident at all.

What the round covers:

1. Failures at the VERY FIRST step, which zero-code mode now promises to localise when the script
   creates its optimizer and it steps only the model's parameters (``AutoWatch._attach_at_forward``):
   a NaN cell in the first CSV batch, an anchor head whose first image has no positive anchor (a
   mean over nothing), a flow whose log-determinant forgot ``abs`` (NaN loss, finite gradients), a
   CLIP temperature initialised to 0, 1-based labels (raises at step 0), Adam ``eps=0`` on a dead
   one-hot feature, and a LambdaLR fed a numpy warm-up table with zero warm-up steps (NaN lr at 0).
2. Loss code spread the way scripts spread it: a hand-written BCE in a module-level function, a
   sigmoid focal loss ``nn.Module`` called at top level (gamma < 1: infinite derivative at p_t = 1),
   and a criterion with learnable log-variances in the same optimizer (the documented fallback:
   the guard opens at the first step; a failure at a later step is localised as usual).
3. Failures that RAISE: the script dies, nantrace prints its diagnosis after the traceback, the
   exit code is 1 and the store holds an ``exception`` incident.
4. Optimizer-step failures (1's Adam eps=0 and LambdaLR).
5. A GradScaler script on the CPU (fp16 autocast, ``torch.amp.GradScaler("cpu")``: the guard opens at
   the first ``scaler.step``) and a Hugging-Face-style ``model(**batch)`` whose loss is inside forward.
6. A baseline evaluation (``model.eval()`` + ``torch.no_grad()``) before training starts, and a
   conditional GAN with two models and two optimizers (the discriminator's guard must report it).
7. Three quiet scripts: NaN validation metrics from an all-padding validation row (eval only), a
   GradScaler calibrating from ``init_scale=2**24`` (skipped steps that are the scaler's normal
   behaviour), and a keyword-called model with a learnable criterion on its own optimizer plus
   periodic no_grad evaluation.

How expectations were derived: each expectation was written from the construction before nantrace
ran, following docs/api.md (/work/shared/API.md) and docs/diagnosis.md (origin rule: the op that
made the first non-finite value, or the overflow that made the infinity it received; module
``None`` for ops outside the watched model; optimizer-phase failures name the update op, the
parameter's module and the user's ``optimizer.step()`` line, cause ``optimizer_state`` for a
degenerate hyper-parameter; an empty mean is ``div_by_zero``; a raise is kind ``exception``,
action ``raised`` as in earlier rounds). The constructions were checked WITHOUT nantrace
(``test_cases_fail_without_nantrace``: the script run by plain ``python`` under global optimizer
step hooks that print gradient/parameter finiteness, so the first step whose loss, gradients or
parameters go non-finite, or that raises, is the expected one); the origin ops were checked in
throwaway scripts with a ``TorchDispatchMode`` that records the first op producing a non-finite
value (and ``torch.autograd.detect_anomaly`` for the backward case: ``PowBackward0``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nantrace.storage.runstore import RunStore

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]


@dataclasses.dataclass(frozen=True)
class Expect:
    """The first blocking incident a script must get; ``tag`` marks the origin line in the script."""

    step: int
    kind: str
    phase: str | None
    op: str | None
    module: str | None
    tag: str | None
    cause: str
    action: str = "skipped"


@dataclasses.dataclass(frozen=True)
class Plain:
    """What the script does without nantrace: the first step whose ``loss`` (printed by the script),
    gradients (``grad``) or updated parameters (``param``) are non-finite, or that raises ``raises``."""

    what: str
    step: int
    raises: str | None = None


CASES: dict[str, tuple[str, Expect | None, Plain | None]] = {}
"""name -> (script, expectation, plain-run behaviour); expectation None = a quiet script."""
XFAIL: dict[str, str] = {
}
"""name -> why nantrace is still wrong on it (a strict xfail)."""


def case(name: str, script: str, expect: Expect | None, plain: Plain | None) -> None:
    assert name not in CASES, name
    CASES[name] = (script, expect, plain)


# 1. A NaN cell in the first DataLoader batch (nn.MSELoss module called at top level): step 0 is localised to the batch.
CSV_MISSING_VALUE_IN_FIRST_BATCH = '''\
"""Tabular regression from a CSV whose third row has an empty cell (read as NaN)."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def load_table(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    y = x @ torch.linspace(-1.0, 1.0, 6) + 0.1 * torch.randn(n, generator=g)
    x[3, 2] = float("nan")  # an empty cell
    return x, y


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.body(x).squeeze(-1)


def main():
    torch.manual_seed(0)
    x, y = load_table()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)
    model = Regressor()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    step = 0
    for epoch in range(2):
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            print(f"step {step} loss {loss.item():.4g}")
            loss.backward()
            optimizer.step()
            step += 1
    print("training done")


if __name__ == "__main__":
    main()
'''
case('csv_missing_value_in_first_batch', CSV_MISSING_VALUE_IN_FIRST_BATCH,
     Expect(0, "nonfinite_input", "data", None, None, None, "nonfinite_input"),
     Plain("loss", 0))

# 2. The first image has no positive anchor: smooth_l1_loss's mean over an empty selection is 0/0 (gradients stay finite:
# the empty selection gets none), at step 0.
ANCHOR_REGRESSION_NO_POSITIVE_IN_FIRST_BATCH = '''\
"""A one-stage detector's head: classification on every anchor, box regression on positives only."""
import torch
import torch.nn.functional as F
from torch import nn


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.cls = nn.Linear(32, 1)
        self.box = nn.Linear(32, 4)

    def forward(self, feats):
        h = self.trunk(feats)
        return self.cls(h).squeeze(-1), self.box(h)


def get_batch(step, g):
    feats = torch.randn(32, 10, generator=g)
    iou = torch.rand(32, generator=g) * (0.4 if step == 0 else 1.0)  # first image: no anchor overlaps a box
    boxes = torch.randn(32, 4, generator=g)
    return feats, iou, boxes


torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
model = Head()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for step in range(4):
    feats, iou, boxes = get_batch(step, g)
    logits, deltas = model(feats)
    positive = iou > 0.5
    cls_loss = F.binary_cross_entropy_with_logits(logits, positive.float())
    box_loss = F.smooth_l1_loss(deltas[positive], boxes[positive])  # <origin:box_loss>
    loss = cls_loss + box_loss
    print(f"step {step} loss {loss.item():.4g}")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''
case('anchor_regression_no_positive_in_first_batch', ANCHOR_REGRESSION_NO_POSITIVE_IN_FIRST_BATCH,
     Expect(0, "nonfinite_loss", "forward", "aten.smooth_l1_loss.default", None, "box_loss", "div_by_zero"),
     Plain("loss", 0))

# 3. log(det W) without abs on a reflection: NaN loss with finite gradients (d log det W / dW = W^-T), from step 0 on.
INVERTIBLE_LINEAR_FLOW_LOGDET_WITHOUT_ABS = '''\
"""A small normalising flow (invertible linear + affine coupling) trained by maximum likelihood."""
import math
import torch
from torch import nn


class InvLinear(nn.Module):
    def __init__(self, dim):
        super().__init__()
        w = torch.linalg.qr(torch.randn(dim, dim))[0]  # a random rotation... or a reflection
        w[:, 0] = -w[:, 0] if torch.det(w) > 0 else w[:, 0]
        self.weight = nn.Parameter(w)

    def forward(self, x):
        return x @ self.weight.t(), torch.log(torch.det(self.weight))  # <origin:logdet>


class Coupling(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim // 2, 16), nn.Tanh(), nn.Linear(16, dim))

    def forward(self, x):
        a, b = x.chunk(2, -1)
        log_s, t = self.net(a).chunk(2, -1)
        log_s = torch.tanh(log_s)
        return torch.cat([a, b * torch.exp(log_s) + t], -1), log_s.sum(-1)


class Flow(nn.Module):
    def __init__(self, dim=4):
        super().__init__()
        self.perm = InvLinear(dim)
        self.coupling = Coupling(dim)

    def forward(self, x):
        z, ld1 = self.perm(x)
        z, ld2 = self.coupling(z)
        return z, ld1 + ld2


torch.manual_seed(0)
flow = Flow()
optimizer = torch.optim.Adam(flow.parameters(), lr=1e-3)
for step in range(4):
    x = torch.randn(64, 4) * torch.tensor([1.0, 0.5, 2.0, 1.0])
    z, logdet = flow(x)
    nll = 0.5 * (z ** 2).sum(-1) + 2 * math.log(2 * math.pi) - logdet
    loss = nll.mean()
    print(f"step {step} loss {loss.item():.4g}")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''
case('invertible_linear_flow_logdet_without_abs', INVERTIBLE_LINEAR_FLOW_LOGDET_WITHOUT_ABS,
     Expect(0, "nonfinite_loss", "forward", "aten.log.default", "perm", "logdet", "log_nonpositive"),
     Plain("loss", 0))

# 4. A learnable temperature initialised to 0 divides the similarity logits at step 0 (+-inf, then NaN in the
# cross-entropy: the division made the infinity).
CLIP_TEMPERATURE_INITIALISED_TO_ZERO = '''\
"""CLIP-style contrastive training of two small encoders; the temperature is a learnable scalar."""
import torch
import torch.nn.functional as F
from torch import nn


class DualEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
        self.text = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 8))
        self.temperature = nn.Parameter(torch.zeros(()))  # meant as log(1/T) = 0, used as T

    def forward(self, images, texts):
        a = F.normalize(self.image(images), dim=-1)
        b = F.normalize(self.text(texts), dim=-1)
        return a @ b.t() / self.temperature  # <origin:clip_div>


torch.manual_seed(0)
model = DualEncoder()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
for step in range(3):
    images, texts = torch.randn(16, 16), torch.randn(16, 12)
    logits = model(images, texts)
    labels = torch.arange(16)
    loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
    print(f"step {step} loss {loss.item():.4g}")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''
case('clip_temperature_initialised_to_zero', CLIP_TEMPERATURE_INITIALISED_TO_ZERO,
     Expect(0, "nonfinite_loss", "forward", "aten.div.Tensor", "", "clip_div", "div_by_zero"),
     Plain("loss", 0))

# 5. An unnormalised batch saturates the sigmoid to exactly 0/1: log(0) in a module-level loss function at step 3.
HANDWRITTEN_BCE_IN_A_LOSS_FUNCTION_UNNORMALISED_BATCH = '''\
"""Binary classifier with a hand-written BCE; the fourth batch was not normalised (raw pixel scale)."""
import torch
from torch import nn


def bce_loss(logits, targets):
    p = torch.sigmoid(logits)
    return -(targets * torch.log(p) + (1 - targets) * torch.log(1 - p)).mean()  # <origin:bce_log>


def get_batch(step, g):
    x = torch.randn(16, 8, generator=g)
    y = (x[:, 0] > 0).float()
    if step == 3:
        x = x * 1e4  # this shard was saved before normalisation
    return x, y


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


torch.manual_seed(0)
g = torch.Generator().manual_seed(2)
model = Classifier()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    x, y = get_batch(step, g)
    loss = bce_loss(model(x), y)
    print(f"step {step} loss {loss.item():.4g}")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''
case('handwritten_bce_in_a_loss_function_unnormalised_batch', HANDWRITTEN_BCE_IN_A_LOSS_FUNCTION_UNNORMALISED_BATCH,
     Expect(3, "nonfinite_loss", "forward", "aten.log.default", None, "bce_log", "log_nonpositive"),
     Plain("loss", 3))

# 6. A confident sample makes p_t == 1 exactly: (1 - p_t) ** 0.5 is 0 (finite loss) and its derivative infinite
# (detect_anomaly: PowBackward0), in a FocalLoss module outside the model, at step 2.
SIGMOID_FOCAL_LOSS_MODULE_GAMMA_BELOW_ONE = '''\
"""Multi-label tagging with a RetinaNet-style sigmoid focal loss module (gamma tuned down to 0.5)."""
import torch
import torch.nn.functional as F
from torch import nn


class FocalLoss(nn.Module):
    def __init__(self, alpha=0.25, gamma=0.5):
        super().__init__()
        self.alpha, self.gamma = alpha, gamma

    def forward(self, logits, targets):
        p = torch.sigmoid(logits)
        ce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
        p_t = p * targets + (1 - p) * (1 - targets)
        loss = ce * (1 - p_t) ** self.gamma  # <origin:focal_pow>
        alpha_t = self.alpha * targets + (1 - self.alpha) * (1 - targets)
        return (alpha_t * loss).mean()


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, x):
        return self.net(x)


torch.manual_seed(0)
g = torch.Generator().manual_seed(3)
model = Tagger()
criterion = FocalLoss()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(5):
    x = torch.randn(16, 12, generator=g)
    y = (torch.rand(16, 8, generator=g) < 0.3).float()
    if step == 2:
        x[5] = x[5] * 1e3  # one over-exposed sample: very confident logits
    loss = criterion(model(x), y)
    print(f"step {step} loss {loss.item():.4g}")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''
case('sigmoid_focal_loss_module_gamma_below_one', SIGMOID_FOCAL_LOSS_MODULE_GAMMA_BELOW_ONE,
     Expect(2, "nonfinite_grad", "backward", "aten.pow.Tensor_Scalar", None, "focal_pow", "grad_singularity"),
     Plain("grad", 2))

# 7. The optimizer also steps the criterion's log-variances: the guard opens at step 0's optimizer step (documented
# fallback); at step 3 targets in cents make cosh overflow in the criterion's log-cosh.
LEARNABLE_UNCERTAINTY_CRITERION_LOGCOSH_OVERFLOW = '''\
"""Multi-task regression, tasks weighted by learned uncertainties (Kendall et al.); the criterion's
log-variances are trained by the same optimizer; one task uses a log-cosh loss."""
import torch
import torch.nn.functional as F
from torch import nn


class MultiTaskNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Sequential(nn.Linear(6, 32), nn.ReLU())
        self.price = nn.Linear(32, 1)
        self.demand = nn.Linear(32, 1)

    def forward(self, x):
        h = self.shared(x)
        return self.price(h).squeeze(-1), self.demand(h).squeeze(-1)


class UncertaintyWeightedLoss(nn.Module):
    def __init__(self, n_tasks=2):
        super().__init__()
        self.log_vars = nn.Parameter(torch.zeros(n_tasks))

    def forward(self, price, demand, price_t, demand_t):
        l_price = torch.log(torch.cosh(price - price_t)).mean()  # <origin:logcosh>
        l_demand = F.mse_loss(demand, demand_t)
        losses = torch.stack([l_price, l_demand])
        return (torch.exp(-self.log_vars) * losses + self.log_vars).sum()


torch.manual_seed(0)
g = torch.Generator().manual_seed(4)
model = MultiTaskNet()
criterion = UncertaintyWeightedLoss()
optimizer = torch.optim.Adam(list(model.parameters()) + list(criterion.parameters()), lr=1e-3)
for step in range(5):
    x = torch.randn(16, 6, generator=g)
    price_t, demand_t = x[:, 0] * 2, x[:, 1] - x[:, 2]
    if step == 3:
        price_t = price_t * 1000  # this shard's prices are in cents, not euros
    price, demand = model(x)
    loss = criterion(price, demand, price_t, demand_t)
    print(f"step {step} loss {loss.item():.4g}")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''
case('learnable_uncertainty_criterion_logcosh_overflow', LEARNABLE_UNCERTAINTY_CRITERION_LOGCOSH_OVERFLOW,
     Expect(3, "nonfinite_loss", "forward", "aten.cosh.default", None, "logcosh", "exp_overflow"),
     Plain("loss", 3))

# 8. 1-based labels: cross_entropy raises IndexError at step 0; the script dies.
ONE_BASED_LABELS_RAISE_AT_FIRST_STEP = '''\
"""Text classification on bag-of-words features; the label column is 1-based (1..5) in the file."""
import torch
import torch.nn.functional as F
from torch import nn


class BowClassifier(nn.Module):
    def __init__(self, vocab=50, classes=5):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, 16, mode="mean")
        self.out = nn.Linear(16, classes)

    def forward(self, tokens):
        return self.out(self.emb(tokens))


torch.manual_seed(0)
g = torch.Generator().manual_seed(5)
tokens = torch.randint(0, 50, (64, 12), generator=g)
labels = torch.randint(1, 6, (64,), generator=g)  # as stored: 1..5
model = BowClassifier()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(4):
    tb, yb = tokens[step * 16:(step + 1) * 16], labels[step * 16:(step + 1) * 16]
    logits = model(tb)
    loss = F.cross_entropy(logits, yb)  # <origin:ce_labels>
    print(f"step {step} loss {loss.item():.4g}")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''
case('one_based_labels_raise_at_first_step', ONE_BASED_LABELS_RAISE_AT_FIRST_STEP,
     Expect(0, "exception", "forward", "aten.nll_loss_forward.default", None, "ce_labels", "label_out_of_range", action="raised"),
     Plain("raise", 0, "IndexError"))

# 9. Temperature annealed to 0 at step 3: logits / 0 -> softmax NaN -> torch.multinomial raises; the script dies.
REINFORCE_TEMPERATURE_ANNEALED_TO_ZERO_MULTINOMIAL_RAISES = '''\
"""REINFORCE on a toy contextual bandit; exploration temperature annealed linearly to 0."""
import torch
import torch.nn.functional as F
from torch import nn


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 6))

    def forward(self, obs):
        return self.net(obs)


def select_actions(policy, obs, temperature):
    logits = policy(obs)
    probs = F.softmax(logits / temperature, dim=-1)  # <origin:temp_div>
    actions = torch.multinomial(probs, 1).squeeze(-1)
    return actions, torch.log(probs.gather(1, actions[:, None]).squeeze(-1))


def reward_of(obs, actions):
    return (actions == obs.argmax(-1)).float()


torch.manual_seed(0)
policy = Policy()
optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
n_steps = 5
for step in range(n_steps):
    temperature = max(0.0, 1.0 - step / 3)  # annealed to 0 at step 3 (meant: to 0 at the end)
    obs = torch.randn(32, 4)
    actions, log_probs = select_actions(policy, obs, temperature)
    reward = reward_of(obs, actions)
    loss = -((reward - reward.mean()) * log_probs).mean()
    print(f"step {step} loss {loss.item():.4g}")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''
case('reinforce_temperature_annealed_to_zero_multinomial_raises', REINFORCE_TEMPERATURE_ANNEALED_TO_ZERO_MULTINOMIAL_RAISES,
     Expect(3, "exception", "forward", "aten.div.Tensor", None, "temp_div", "div_by_zero", action="raised"),
     Plain("raise", 3, "RuntimeError"))

# 10. Adam eps=0 (single-tensor path on the CPU): the never-seen one-hot column's weights get 0 / (sqrt(0) + 0) at step 0.
ADAM_EPS_ZERO_DEAD_ONE_HOT_FEATURE = '''\
"""Churn prediction; the one-hot 'region' block has a category no customer in the data has."""
import torch
import torch.nn.functional as F
from torch import nn


def make_features(n, g):
    numeric = torch.randn(n, 4, generator=g)
    region = F.one_hot(torch.randint(0, 4, (n,), generator=g), 5).float()  # category 4 never occurs
    return torch.cat([numeric, region], 1), (numeric[:, 0] > 0).float()


class ChurnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(9, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.encoder(x)).squeeze(-1)


torch.manual_seed(0)
g = torch.Generator().manual_seed(6)
model = ChurnNet()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)  # "eps only biases the update"
for step in range(3):
    x, y = make_features(32, g)
    loss = F.binary_cross_entropy_with_logits(model(x), y)
    print(f"step {step} loss {loss.item():.4g}")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()  # <origin:opt_step>
'''
case('adam_eps_zero_dead_one_hot_feature', ADAM_EPS_ZERO_DEAD_ONE_HOT_FEATURE,
     Expect(0, "nonfinite_param", "optimizer", "aten.addcdiv_.default", "encoder.0", "opt_step", "optimizer_state"),
     Plain("param", 0))

# 11. LambdaLR over a numpy table whose warm-up is 0 steps: factor 0/0 = NaN at step 0, SGD's p.add_(buf, alpha=-lr)
# is the first op to meet it, on the first parameter (features.0.weight).
LAMBDA_LR_NUMPY_WARMUP_TABLE_ZERO_WARMUP = '''\
"""An image-classifier recipe: linear warm-up then constant, as a numpy table fed to LambdaLR;
warmup_ratio defaults to 0."""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

total_steps, warmup_ratio = 6, 0.0
warmup_steps = int(warmup_ratio * total_steps)
factors = np.minimum(np.arange(total_steps) / warmup_steps, 1.0)  # 0/0 at step 0 (numpy only warns)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.classifier = nn.Linear(16, 3)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


torch.manual_seed(0)
model = ConvNet()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: float(factors[s]))
for step in range(total_steps - 1):
    images, labels = torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,))
    loss = F.cross_entropy(model(images), labels)
    print(f"step {step} loss {loss.item():.4g}")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()  # <origin:opt_step>
    scheduler.step()
'''
case('lambda_lr_numpy_warmup_table_zero_warmup', LAMBDA_LR_NUMPY_WARMUP_TABLE_ZERO_WARMUP,
     Expect(0, "nonfinite_param", "optimizer", "aten.add_.Tensor", "features.0", "opt_step", "optimizer_state"),
     Plain("param", 0))

# 12. fp16 autocast + GradScaler('cpu'): the guard opens at the first scaler.step; at step 3 a -1 sentinel target
# makes log1p(-1) = -inf (a real incident, not the scaler's overflow calibration).
GRADSCALER_CPU_RMSLE_MISSING_TARGET_SENTINEL = '''\
"""Demand forecasting with fp16 autocast and a GradScaler on the CPU; RMSLE loss; missing targets
are stored as -1 in one shard."""
import torch
from torch import nn


class Forecaster(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1), nn.Softplus())

    def forward(self, x):
        return self.net(x).squeeze(-1)


def rmsle(pred, target):
    return torch.sqrt(((torch.log1p(pred.float()) - torch.log1p(target)) ** 2).mean())  # <origin:log1p>


torch.manual_seed(0)
g = torch.Generator().manual_seed(7)
model = Forecaster()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(5):
    x = torch.randn(32, 8, generator=g)
    y = torch.rand(32, generator=g) * 10
    if step == 3:
        y[::7] = -1.0  # missing values in this shard
    with torch.autocast("cpu", dtype=torch.float16):
        pred = model(x)
    loss = rmsle(pred, y)
    print(f"step {step} loss {loss.item():.4g}")
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
'''
case('gradscaler_cpu_rmsle_missing_target_sentinel', GRADSCALER_CPU_RMSLE_MISSING_TARGET_SENTINEL,
     Expect(3, "nonfinite_loss", "forward", "aten.log1p.default", None, "log1p", "log_nonpositive"),
     Plain("loss", 3))

# 13. model(**batch) computing its loss inside forward; at step 2 every label is -100: the mean over no token is 0/0
# (docs/integrations.md: labels all equal to ignore_index are named as the cause).
HF_STYLE_KEYWORD_MODEL_ALL_LABELS_MASKED = '''\
"""A tiny causal LM called like a Hugging Face model: model(**batch) with labels; prompts are masked
with -100 ("train on completions only") and one batch's completions were truncated away."""
import torch
import torch.nn.functional as F
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab=40, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.GRU(dim, dim, batch_first=True)
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h, _ = self.mix(self.embed(input_ids))
        logits = self.lm_head(h)
        out = {"logits": logits}
        if labels is not None:
            shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
            out["loss"] = F.cross_entropy(  # <origin:lm_ce>
                shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100)
        return out


def collate(step, g, prompt_len=6, seq_len=10):
    input_ids = torch.randint(0, 40, (4, seq_len), generator=g)
    labels = input_ids.clone()
    cut = seq_len if step == 2 else prompt_len  # step 2: prompts fill the whole window
    labels[:, :cut] = -100
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


torch.manual_seed(0)
g = torch.Generator().manual_seed(8)
model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(4):
    batch = collate(step, g)
    outputs = model(**batch)
    loss = outputs["loss"]
    print(f"step {step} loss {loss.item():.4g}")
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
'''
case('hf_style_keyword_model_all_labels_masked', HF_STYLE_KEYWORD_MODEL_ALL_LABELS_MASKED,
     Expect(2, "nonfinite_loss", "forward", "aten.nll_loss_forward.default", "", "lm_ce", "label_out_of_range"),
     Plain("loss", 2))

# 14. A no_grad eval pass before the optimizer exists; at step 2 a -1 'missing' count reaches sqrt in the model.
BASELINE_EVAL_BEFORE_TRAINING_SQRT_OF_MISSING_COUNT = '''\
"""Count-feature regression; the script reports a baseline validation loss (eval mode, no_grad)
before training. Counts are variance-stabilised with a square root inside the model; one training
shard marks missing counts with -1."""
import torch
import torch.nn.functional as F
from torch import nn


class CountFeatures(nn.Module):
    def forward(self, x):
        return torch.cat([torch.sqrt(x[:, :3]), x[:, 3:]], 1)  # <origin:count_sqrt>


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = CountFeatures()
        self.mlp = nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))

    def forward(self, x):
        return self.mlp(self.features(x)).squeeze(-1)


def batch(g, missing=False):
    counts = torch.randint(0, 20, (32, 3), generator=g).float()
    if missing:
        counts[4, 1] = -1.0
    x = torch.cat([counts, torch.randn(32, 3, generator=g)], 1)
    return x, counts.clamp(min=0).sum(1) / 10


def evaluate(model, batches):
    model.eval()
    with torch.no_grad():
        losses = [F.mse_loss(model(x), y).item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


torch.manual_seed(0)
g = torch.Generator().manual_seed(9)
model = Model()
val = [batch(g) for _ in range(2)]
print(f"baseline val loss {evaluate(model, val):.4g}")
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(4):
    x, y = batch(g, missing=(step == 2))
    loss = F.mse_loss(model(x), y)
    print(f"step {step} loss {loss.item():.4g}")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"final val loss {evaluate(model, val):.4g}")
'''
case('baseline_eval_before_training_sqrt_of_missing_count', BASELINE_EVAL_BEFORE_TRAINING_SQRT_OF_MISSING_COUNT,
     Expect(2, "nonfinite_loss", "forward", "aten.sqrt.default", "features", "count_sqrt", "sqrt_negative"),
     Plain("loss", 2))

# 15. Two models, two optimizers: at step 3 corrupt inputs make G's output huge, D(fake) == 1 exactly, log(1 - 1) = -inf in
# the discriminator's loss; the discriminator's guard (opt_d steps first each iteration) reports it.
CONDITIONAL_GAN_TWO_OPTIMIZERS_LOG_OF_SATURATED_DISCRIMINATOR = '''\
"""A conditional GAN (generator maps a sensor reading to a 2-D position, discriminator judges
positions), two Adam optimizers, the original minimax loss written by hand; one batch holds two
corrupt sensor rows."""
import torch
from torch import nn


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, src):
        return self.net(src)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def forward(self, x):
        return torch.sigmoid(self.net(x)).squeeze(-1)


def get_batch(step, g):
    src = torch.randn(32, 4, generator=g)
    target = src[:, :2] * 0.5 + torch.tensor([2.0, -1.0])
    if step == 3:
        src[:2] = 1e4  # two corrupt sensor rows (their targets were cleaned, the inputs were not)
    return src, target


torch.manual_seed(0)
g = torch.Generator().manual_seed(10)
G, D = Generator(), Discriminator()
opt_g = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
for step in range(5):
    src, real = get_batch(step, g)
    fake = G(src)
    d_loss = -(torch.log(D(real)) + torch.log(1 - D(fake.detach()))).mean()  # <origin:d_log>
    opt_d.zero_grad()
    d_loss.backward()
    opt_d.step()
    g_loss = -torch.log(D(fake)).mean()
    opt_g.zero_grad()
    g_loss.backward()
    opt_g.step()
    print(f"step {step} loss {d_loss.item():.4g} g_loss {g_loss.item():.4g}")
'''
case('conditional_gan_two_optimizers_log_of_saturated_discriminator', CONDITIONAL_GAN_TWO_OPTIMIZERS_LOG_OF_SATURATED_DISCRIMINATOR,
     Expect(3, "nonfinite_loss", "forward", "aten.log.default", None, "d_log", "log_nonpositive"),
     Plain("loss", 3))

# 16. Quiet: the NaN is only in the no_grad evaluation (an all-padding validation row); training is clean.
QUIET_EVAL_PASS_WITH_AN_ALL_PADDING_VALIDATION_ROW = '''\
"""Sequence classifier with masked mean pooling; the validation set holds one all-padding row, so the
validation loss printed before and after training is NaN. Training data is clean."""
import torch
import torch.nn.functional as F
from torch import nn


class Pooler(nn.Module):
    def forward(self, h, mask):
        return (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


class SeqClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(30, 16)
        self.pool = Pooler()
        self.out = nn.Linear(16, 3)

    def forward(self, ids, mask):
        return self.out(self.pool(self.embed(ids), mask))


def evaluate(model, ids, mask, y):
    model.eval()
    with torch.no_grad():
        loss = F.cross_entropy(model(ids, mask), y)
    model.train()
    return loss.item()


torch.manual_seed(0)
model = SeqClassifier()
val_ids, val_mask, val_y = torch.randint(0, 30, (8, 6)), torch.ones(8, 6), torch.randint(0, 3, (8,))
val_mask[7] = 0  # an empty validation sequence
print(f"val loss before {evaluate(model, val_ids, val_mask, val_y):.4g}")
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
for step in range(4):
    ids, mask, y = torch.randint(0, 30, (8, 6)), torch.ones(8, 6), torch.randint(0, 3, (8,))
    mask[:, 4:] = torch.randint(0, 2, (8, 2)).float()
    loss = F.cross_entropy(model(ids, mask), y)
    print(f"step {step} loss {loss.item():.4g}")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"val loss after {evaluate(model, val_ids, val_mask, val_y):.4g}")
print("done")
'''
case('quiet_eval_pass_with_an_all_padding_validation_row', QUIET_EVAL_PASS_WITH_AN_ALL_PADDING_VALIDATION_ROW,
     None,
     None)

# 17. Quiet: the first steps overflow the fp16 backward at scale 2**24 and are skipped by the scaler while it calibrates.
QUIET_GRADSCALER_CPU_CALIBRATING_FROM_A_HIGH_INIT_SCALE = '''\
"""fp16 autocast on the CPU with a GradScaler started at 2**24: its first steps overflow and are
skipped while the scale calibrates; that is the scaler's normal behaviour."""
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
for step in range(8):
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(x)
    loss = F.cross_entropy(logits.float(), y)
    print(f"step {step} loss {loss.item():.4g}")
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
print(f"done, scale {scaler.get_scale():.0f}")
'''
case('quiet_gradscaler_cpu_calibrating_from_a_high_init_scale', QUIET_GRADSCALER_CPU_CALIBRATING_FROM_A_HIGH_INIT_SCALE,
     None,
     None)

# 18. Quiet: model(**batch), a learnable criterion on its own optimizer, a no_grad evaluation every two steps.
QUIET_KEYWORD_MODEL_WITH_LEARNABLE_TEMPERATURE_CRITERION = '''\
"""Metric learning called like a Hugging Face model (model(**batch)), a criterion with a learnable
temperature trained by its own optimizer, and a no_grad evaluation every two steps."""
import torch
import torch.nn.functional as F
from torch import nn


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, pixel_values, labels=None):
        return {"embeddings": F.normalize(self.proj(pixel_values), dim=-1)}


class ProxyLoss(nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.proxies = nn.Parameter(torch.randn(classes, 8))
        self.log_t = nn.Parameter(torch.tensor(2.0))

    def forward(self, emb, labels):
        logits = emb @ F.normalize(self.proxies, dim=-1).t() * self.log_t.exp()
        return F.cross_entropy(logits, labels)


torch.manual_seed(0)
model, criterion = Encoder(), ProxyLoss()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
criterion_optimizer = torch.optim.SGD(criterion.parameters(), lr=1e-2)
for step in range(6):
    batch = {"pixel_values": torch.randn(16, 10), "labels": torch.randint(0, 4, (16,))}
    out = model(**batch)
    loss = criterion(out["embeddings"], batch["labels"])
    print(f"step {step} loss {loss.item():.4g}")
    optimizer.zero_grad()
    criterion_optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    criterion_optimizer.step()
    if step % 2 == 1:
        model.eval()
        with torch.no_grad():
            val = model(pixel_values=torch.randn(8, 10))["embeddings"]
        model.train()
        print(f"  eval embedding norm {val.norm(dim=-1).mean():.3f}")
print("done")
'''
case('quiet_keyword_model_with_learnable_temperature_criterion', QUIET_KEYWORD_MODEL_WITH_LEARNABLE_TEMPERATURE_CRITERION,
     None,
     None)


# ---------------------------------------------------------------------------------------------- running
CHECKER = r'''
import os, runpy, sys, warnings
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
warnings.simplefilter("ignore")
ids, done = {}, {}
def pre(opt, args, kwargs):
    k = ids.setdefault(id(opt), len(ids))
    grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
    print(f"CHECK opt{k} step{done.get(k, 0)} grads {all(bool(torch.isfinite(g).all()) for g in grads)}", flush=True)
def post(opt, args, kwargs):
    k = ids[id(opt)]
    params = [p for group in opt.param_groups for p in group["params"]]
    print(f"CHECK opt{k} step{done.get(k, 0)} params {all(bool(torch.isfinite(p).all()) for p in params)}", flush=True)
    done[k] = done.get(k, 0) + 1
register_optimizer_step_pre_hook(pre)
register_optimizer_step_post_hook(post)
for folder in sys.argv[1:]:
    ids.clear()
    done.clear()
    os.chdir(folder)
    sys.argv, sys.path[0] = ["train.py"], folder
    print(f"SCRIPT {os.path.basename(folder)}", flush=True)
    try:
        runpy.run_path("train.py", run_name="__main__")
        print("EXIT 0", flush=True)
    except Exception as exc:
        print(f"RAISED {type(exc).__name__}: {exc}", flush=True)
'''
"""Plain python, no nantrace, every script in turn in one process (one torch import): global optimizer step hooks
print whether each step's gradients and updated parameters are finite (a GradScaler's skipped update is not seen:
the script's loss line tells), and an uncaught exception is printed as ``RAISED <type>: <message>``."""


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """name -> what the script printed when run without nantrace."""
    root = tmp_path_factory.mktemp("plain")
    folders = []
    for name, (script, _, _) in CASES.items():
        (root / name).mkdir()
        (root / name / "train.py").write_text(script)
        folders.append(str(root / name))
    proc = subprocess.run([sys.executable, "-c", CHECKER, *folders], capture_output=True, text=True, env=_env(),
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    parts = re.split(r"^SCRIPT (\S+)\n", proc.stdout, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _env() -> dict[str, str]:
    return dict(os.environ, COLUMNS="120", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def origin_line(script: str, tag: str) -> int:
    [line] = [i for i, text in enumerate(script.splitlines(), 1) if text.rstrip().endswith(f"# <origin:{tag}>")]
    return line


def _losses(stdout: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^step (\d+) loss (\S+)", stdout, re.M)}


def _checks(stdout: str) -> dict[tuple[int, str], bool]:
    """(step, 'grads'|'params') -> finite, for the first optimizer that stepped."""
    return {(int(m.group(1)), m.group(2)): m.group(3) == "True"
            for m in re.finditer(r"^CHECK opt0 step(\d+) (grads|params) (True|False)", stdout, re.M)}


def _incidents(run_dir: Path) -> list[Any]:
    """Every incident of every run store the run wrote (a second optimizer's in RUN_DIR/<n>-<Model>)."""
    found = []
    for db in sorted(run_dir.rglob("nantrace.db")):
        found += RunStore(db.parent, readonly=True).incidents()
    return sorted(found, key=lambda i: i.time)


def _describe(i: Any) -> str:
    return (f"step={i.step} kind={i.kind} phase={i.phase} op={i.op} module={i.module!r} cause={i.cause} "
            f"action={i.action} source={i.source}")


SUBPROCESS = ("csv_missing_value_in_first_batch", "gradscaler_cpu_rmsle_missing_target_sentinel",
              "conditional_gan_two_optimizers_log_of_saturated_discriminator")
"""Failing scripts that do not raise but run as subprocesses all the same (with every raising and quiet one)."""


def _in_process(name: str, folder: Path) -> subprocess.CompletedProcess:
    """``run_script`` on the case's script (what ``nantrace run`` calls), its printed output captured."""
    import contextlib
    import io

    import torch

    from nantrace.autowatch import run_script

    out = io.StringIO()
    cwd, threads = os.getcwd(), torch.get_num_threads()
    os.chdir(folder)
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out):
            result = run_script("train.py", run_dir="runs")
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["run_script", "train.py"], result.exit_code, out.getvalue(),
                                       result.traceback or "")


@pytest.fixture(scope="module")
def nantrace_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """name -> (``nantrace run --run-dir runs train.py`` as a user runs it, its folder); two subprocesses at a
    time, then the in-process runs."""
    assert set(SUBPROCESS) <= set(CASES)
    root = tmp_path_factory.mktemp("zero_code")
    alone = [n for n, (_, expect, plain) in CASES.items()
             if expect is None or (plain is not None and plain.what == "raise") or n in SUBPROCESS]
    pending, running, done = alone, [], {}
    for name in CASES:
        if name not in alone:
            folder = root / name
            folder.mkdir()
            (folder / "train.py").write_text(CASES[name][0])
    while pending or running:
        while pending and len(running) < 2:
            name = pending.pop(0)
            folder = root / name
            folder.mkdir()
            (folder / "train.py").write_text(CASES[name][0])
            proc = subprocess.Popen([sys.executable, "-m", "nantrace", "run", "--run-dir", "runs", "train.py"],
                                    cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
            running.append((name, folder, proc))
        name, folder, proc = running.pop(0)
        out, err = proc.communicate(timeout=300)
        done[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err), folder)
    for name in CASES:
        if name not in done:
            done[name] = (_in_process(name, root / name), root / name)
    return done


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str, plain_runs: dict[str, str]) -> None:
    script, expect, plain = CASES[name]
    out = plain_runs[name]
    losses, checks = _losses(out), _checks(out)
    if plain is None:  # quiet: every loss, gradient and update finite
        assert out.rstrip().endswith("EXIT 0"), out
        assert losses and all(math.isfinite(v) for v in losses.values()), out
        assert checks and all(checks.values()), out
        return
    k = plain.step
    assert all(math.isfinite(losses[s]) for s in range(k)), out
    assert all(checks.get((s, "grads"), True) and checks.get((s, "params"), True) for s in range(k)), out
    if plain.what == "raise":
        assert sorted(losses) == list(range(k)) and out.rstrip().splitlines()[-1].startswith(f"RAISED {plain.raises}:"), out
    else:
        assert out.rstrip().endswith("EXIT 0"), out
    if plain.what == "loss":
        assert not math.isfinite(losses[k]), out
    elif plain.what == "grad":
        assert math.isfinite(losses[k]) and checks[(k, "grads")] is False, out
    elif plain.what == "param":
        assert math.isfinite(losses[k]) and checks[(k, "grads")] and checks[(k, "params")] is False, out
    if expect is not None and expect.tag is not None:
        origin_line(script, expect.tag)  # the tag is there, once


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=XFAIL[n])) if n in XFAIL
                                  else n for n in CASES])
def test_nantrace_run_diagnosis(name: str, nantrace_runs: dict[str, tuple[subprocess.CompletedProcess, Path]]) -> None:
    script, expect, plain = CASES[name]
    proc, folder = nantrace_runs[name]
    incidents = _incidents(folder / "runs")
    script_lines = [ln for ln in proc.stdout.splitlines() if not ln.startswith(("nantrace run:", "Report:"))]
    if expect is None:  # quiet: the script's own output, exit 0, nothing recorded
        assert proc.returncode == 0, proc.stderr
        assert script_lines and script_lines[-1].startswith("done"), proc.stdout
        assert incidents == [], [_describe(i) for i in incidents]
        assert "0 incidents" in proc.stdout, proc.stdout
        return
    blocking = [i for i in incidents if i.action != "logged"]
    assert blocking, (proc.returncode, proc.stderr[-3000:])
    first = blocking[0]
    want_source = None if expect.tag is None else f"train.py:{origin_line(script, expect.tag)}"
    source = first.source
    if source is not None:
        where, _, line = source.rpartition(":")
        source = f"{os.path.basename(where)}:{line}"
    got = (first.step, first.kind, first.phase, first.op, first.module, first.cause, first.action, source)
    want = (expect.step, expect.kind, expect.phase, expect.op, expect.module, expect.cause, expect.action, want_source)
    assert got == want, (_describe(first), first.summary, proc.stderr[-2000:])
    if plain is not None and plain.what == "raise":  # the script died: traceback, then the diagnosis, exit 1
        assert proc.returncode == 1, proc.stderr
        err = proc.stderr
        assert err.index("Traceback (most recent call last):") < err.index(plain.raises + ":") < err.index("nantrace ·"), err
        assert "the script raised " + plain.raises in proc.stdout, proc.stdout
    else:
        assert proc.returncode == 0, proc.stderr
