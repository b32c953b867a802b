"""Held-out failures, round 16a: ZERO-CODE MODE on scripts shaped like pytorch/examples.

Every case is a stand-alone training script (module-level code, as users write it: the model class, the
optimizer, a for loop printing ``step N loss X``, a checkpoint saved at the end), written to
``tmp_path/<case>/train.py`` and run the way ``nantrace run`` runs it: in-process through
``nantrace.autowatch.run_script`` (an ``AutoWatch`` around ``runpy.run_path``: the model and optimizer are
created inside it, the guard opens at the model's first training forward or at the first step, an uncaught
exception is diagnosed while the step is in memory). The incidents are read from the AutoWatch after it
closed, and the first blocking one (action other than ``logged``) is compared with the expectation on
(step, kind, phase, op, module, cause, action, source line of the script). Three scripts (the LSTM language
model, the L-BFGS sequence model and the DCGAN) are also run as real subprocesses,
``python -m nantrace run --run-dir runs train.py``, to check that the CLI path agrees (read from the run store).

What the round covers (the programs of pytorch/examples and other well-known public training scripts):

1. word_language_model (LSTM, batchify, truncated BPTT, clip_grad_norm_): an ``<eos>`` id one past the
   dictionary reaches ``nn.Embedding`` at step 2 and raises (in the model: ``encoder``).
2. mnist (Net, nll_loss, Adadelta + StepLR, a test pass per epoch) with Adadelta ``eps=0``: digits drawn in the
   centre of a blank canvas give fc1 all-zero gradient columns, so Adadelta's ``delta.div_(std)`` is 0/0 at
   step 0 (optimizer phase, first step).
3. dcgan (two models, two Adam optimizers, BCELoss) with a minibatch-stddev layer written without eps: a real
   batch of copies of one image makes the batch variance 0 and sqrt's derivative infinite (D's step 2).
4. vae (the examples' BCE + KLD): a shard of 16-bit images not divided by 65535 makes ``exp(0.5 * logvar)``
   overflow in ``reparameterize``; the NaN reconstruction makes ``F.binary_cross_entropy`` raise (step 3).
5. reinforce with a Gaussian policy: an unscaled, sign-flipped velocity reading drives ``softplus`` to an exact 0
   and ``Normal``'s argument validation raises (step 2: torch.distributions' check on a finite value).
6. actor_critic with a hand-written entropy bonus: a sensor glitch saturates the softmax to an exact 0 and
   ``probs.log()`` is -inf (0 * -inf = NaN in the loss code, step 2).
7. siamese network with the contrastive loss (distance by hand): an image paired with itself, sqrt(0)'s
   derivative (loss code, NaN gradient, step 2).
8. time_sequence_prediction with LBFGS and a closure: a Gaussian NLL with a raw noise-scale parameter; a later
   L-BFGS evaluation inside ``optimizer.step(closure)`` tries sigma < 0 and ``log(sigma)`` is NaN (step 1).
9. fast_neural_style (TransformerNet, frozen loss network, Gram-matrix style loss) with isotropic TV: a
   solid-colour frame is mapped to a constant image and the TV's sqrt at 0 has an infinite derivative (step 2).
10. super_resolution (ESPCN, pixel_shuffle) with a relative L1 loss: letterbox pixels of 0 in the target (step 3).
11. A pygcn-style GCN (sparse adjacency, torch.spmm) whose bag-of-words features were row-normalised before
    training: an empty document is a NaN row of the data from step 0.
12. Five QUIET scripts: the same programs (1, 2, 3, 4, 8) without the injected fault: no incident, the script's
    own output, exit 0, and a checkpoint identical bit for bit to the one the script writes without nantrace.

How expectations were derived: each expectation was written from the construction before nantrace ran,
following /work/shared/API.md and docs/diagnosis.md (origin rule: the op that made the first non-finite value,
or the overflow that made the infinity it received; for a failure seen in the gradients, the forward op whose
derivative made the first non-finite gradient; module ``None`` outside the watched model, ``""`` for the
model's own forward; an optimizer-phase failure names the update op, the parameter's module and the script's
``optimizer.step()`` line, ``optimizer_state`` for a degenerate hyper-parameter; a raise is kind
``exception``, action ``raised``; a torch.distributions check raising on a finite value names the op that made
the rejected value, a value outside the argument's domain being ``domain_error``). The constructions were
checked WITHOUT nantrace (``test_cases_fail_without_nantrace``: each script run by plain ``runpy`` under global
optimizer step hooks recording whether each step's gradients and updated parameters are finite, its printed
losses, and what it raised), and the origin ops in throwaway scripts with a ``TorchDispatchMode`` recording the
first op whose output was non-finite and the script's line that issued it (mnist: ``aten.div_.Tensor`` at the
``optimizer.step()`` line; vae: ``aten.exp.default`` in ``reparameterize``; actor_critic: ``aten.log.default``
at the entropy line; the backward cases: the ``aten.div.Tensor`` of ``SqrtBackward0`` under ``backward()``;
super_resolution: ``aten.div.Tensor`` at the loss line; gcn: ``aten.div.Tensor`` in ``load_graph``, before any
forward; L-BFGS: sigma printed negative at the second evaluation of step 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import nantrace
from nantrace.autowatch import run_script
from nantrace.storage.runstore import RunStore

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

QUIET = nantrace.Config(outputs={"print_incidents": False})


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
    """What the script does without nantrace: the first step whose printed ``loss``, gradients (``grad``),
    updated parameters (``param``) or a later closure evaluation inside ``optimizer.step(closure)``
    (``closure``) are non-finite, or that raises (``raise``, the exception's type)."""

    what: str
    step: int
    raises: str | None = None


CASES: dict[str, tuple[str, Expect | None, Plain | None]] = {}
"""name -> (script, expectation, plain-run behaviour); expectation None = a quiet script."""
CLI_CASES = ("lstm_lm_eos_id_past_the_dictionary_raises", "lbfgs_sequence_gaussian_nll_negative_sigma",
             "dcgan_minibatch_stddev_duplicated_real_batch")
"""Also run as ``python -m nantrace run --run-dir runs train.py`` subprocesses."""
XFAIL: dict[str, str] = {
}
"""name -> why nantrace is still wrong on it (a strict xfail)."""


def case(name: str, script: str, expect: Expect | None, plain: Plain | None) -> None:
    assert name not in CASES, name
    CASES[name] = (script, expect, plain)


def quiet(script: str, *edits: tuple[str, str]) -> str:
    """The same program without its fault (each edit must apply exactly once)."""
    for old, new in edits:
        assert script.count(old) == 1, old
        script = script.replace(old, new)
    return script


# 1. word_language_model (LSTM): an '<eos>' id past the dictionary reaches nn.Embedding at step 2 (raises, in the model).
LSTM_LM = '''\
"""word_language_model (LSTM): batchify, truncated BPTT, clip_grad_norm_; the corpus was tokenised by a
tokenizer that appends '<eos>' = len(dictionary) after each line, an id the dictionary never had."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.2):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nlayers, self.nhid = nlayers, nhid

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))  # <origin:embed>
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


def tokenize(lines, dictionary_size):
    ids = []
    for line in lines:
        ids += line + [EOS]
    return torch.tensor(ids, dtype=torch.long)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous()


def get_batch(source, i, bptt=8):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


def repackage_hidden(h):
    return tuple(v.detach() for v in h)


torch.manual_seed(1111)
ntokens = 40
EOS = ntokens  # BUG: '<eos>' was never added to the dictionary
g = torch.Generator().manual_seed(0)
lines = [torch.randint(0, ntokens, (n,), generator=g).tolist() for n in (20, 60, 60, 60)]
train_data = batchify(tokenize(lines, ntokens), 4)
model = RNNModel(ntokens, 16, 32, 2)
criterion = nn.NLLLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
model.train()
hidden = model.init_hidden(4)
for step, i in enumerate(range(0, 40, 8)):
    data, targets = get_batch(train_data, i)
    hidden = repackage_hidden(hidden)
    optimizer.zero_grad()
    output, hidden = model(data, hidden)
    loss = criterion(output, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    optimizer.step()
    print(f"step {step} loss {loss.item():.4g}")
torch.save({"model": model.state_dict()}, "ckpt.pt")
print("done")
'''
# 2. mnist with Adadelta(eps=0) and StepLR: digits drawn in the centre of a blank 28x28 canvas; the corner of the pooled
# conv2 map is the same constant for every image, and a channel whose ReLU is 0 there gives fc1 an all-zero gradient
# column: Adadelta's delta = sqrt(acc_delta + 0) / sqrt(square_avg + 0) is 0/0 at step 0 (optimizer phase).
MNIST = '''\
"""pytorch/examples mnist: Net (two convs, max-pool, dropout, two linears, log_softmax), nll_loss,
Adadelta(lr=1.0) with StepLR(step_size=1, gamma=0.7), a test pass after each epoch."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(16 * 12 * 12, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def fake_mnist(n, g):
    images = torch.zeros(n, 1, 28, 28)
    images[:, :, 7:21, 7:21] = torch.rand(n, 1, 14, 14, generator=g)  # strokes in the centre, blank border
    images = (images - 0.1307) / 0.3081
    return images, torch.randint(0, 10, (n,), generator=g)


torch.manual_seed(1)
g = torch.Generator().manual_seed(2)
train = [fake_mnist(16, g) for _ in range(2)]
test_x, test_y = fake_mnist(32, g)
model = Net()
optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0, eps=0.0)
scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
step = 0
for epoch in range(2):
    model.train()
    for data, target in train:
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()  # <origin:opt_step>
        print(f"step {step} loss {loss.item():.4g}")
        step += 1
    model.eval()
    with torch.no_grad():
        test_loss = F.nll_loss(model(test_x), test_y, reduction="sum").item() / len(test_y)
    print(f"epoch {epoch} test loss {test_loss:.4f}")
    scheduler.step()
torch.save({"model": model.state_dict()}, "ckpt.pt")
print("done")
'''

# 3. dcgan with a minibatch-stddev layer written without its eps: the third real batch is one image copied (a
# duplicated folder): the per-feature variance over the batch is exactly 0, sqrt's derivative is infinite there
# (D's step 2: finite loss, NaN gradient).
DCGAN = '''\
"""pytorch/examples dcgan (Generator/Discriminator, BCELoss, two Adam optimizers, real_label=1 / fake_label=0),
with a ProGAN-style minibatch standard-deviation feature in the discriminator."""
import torch
import torch.nn as nn

nz, ngf, ndf, nc = 8, 8, 8, 3


class MinibatchStdDev(nn.Module):
    def forward(self, x):
        std = torch.sqrt(x.var(dim=0, unbiased=False))  # <origin:mbstd>
        return torch.cat([x, std.mean().expand(x.size(0), 1, x.size(2), x.size(3))], 1)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            MinibatchStdDev(),
            nn.Conv2d(ndf * 2 + 1, 1, 4, 1, 0, bias=False), nn.Sigmoid())

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


def real_batches(g, n=4, bsz=8):
    for i in range(n):
        images = torch.rand(bsz, nc, 16, 16, generator=g) * 2 - 1
        if i == DUPLICATED:  # a folder of copies of one image
            images = images[:1].expand(bsz, -1, -1, -1).clone()
        yield images


torch.manual_seed(999)
DUPLICATED = 2
netG = Generator()
netG.apply(weights_init)
netD = Discriminator()
netD.apply(weights_init)
criterion = nn.BCELoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
real_label, fake_label = 1.0, 0.0
g = torch.Generator().manual_seed(0)
for step, real in enumerate(real_batches(g)):
    b_size = real.size(0)
    netD.zero_grad()
    label = torch.full((b_size,), real_label)
    errD_real = criterion(netD(real), label)
    errD_real.backward()
    noise = torch.randn(b_size, nz, 1, 1)
    fake = netG(noise)
    label.fill_(fake_label)
    errD_fake = criterion(netD(fake.detach()), label)
    errD_fake.backward()
    errD = errD_real + errD_fake
    optimizerD.step()
    netG.zero_grad()
    label.fill_(real_label)
    errG = criterion(netD(fake), label)
    errG.backward()
    optimizerG.step()
    print(f"step {step} loss {errD.item():.4g} loss_G {errG.item():.4g}")
torch.save({"netG": netG.state_dict(), "netD": netD.state_dict()}, "ckpt.pt")
print("done")
'''

# 4. VAE (the examples' BCE + KLD): a shard of 16-bit PNGs read without scaling (0..65535) at step 3: logvar is huge,
# reparameterize's exp(0.5 * logvar) overflows in the model (module ""), fc3 sums +-inf into NaN and
# F.binary_cross_entropy raises on the NaN reconstruction.
VAE = '''\
"""pytorch/examples vae: fc1 -> (fc21, fc22), reparameterize, fc3 -> fc4 -> sigmoid; loss = BCE(sum) + KLD."""
import torch
import torch.nn.functional as F
from torch import nn


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc21 = nn.Linear(32, 4)
        self.fc22 = nn.Linear(32, 4)
        self.fc3 = nn.Linear(4, 32)
        self.fc4 = nn.Linear(32, 64)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)  # <origin:reparam>
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 64))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def loss_function(recon_x, x, mu, logvar):
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, 64), reduction="sum")  # <origin:bce>
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE + KLD


def load_shard(i, g):
    raw = torch.randint(0, 65536, (16, 1, 8, 8), generator=g).float()
    return raw if i == 3 else raw / 65535.0  # shard 3: 16-bit PNGs, the / 65535 was forgotten


torch.manual_seed(1)
g = torch.Generator().manual_seed(0)
model = VAE()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
model.train()
for step in range(5):
    data = load_shard(step, g)
    optimizer.zero_grad()
    recon_batch, mu, logvar = model(data)
    loss = loss_function(recon_batch, data, mu, logvar)
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item() / len(data):.4g}")
torch.save({"model": model.state_dict()}, "ckpt.pt")
print("done")
'''
# 5. REINFORCE with a Gaussian policy (pendulum): at episode 2 the environment returns an unscaled angular velocity;
# sigma = softplus(sigma_head(h)) underflows to exactly 0 and Normal(mu, sigma)'s argument validation raises.
REINFORCE_GAUSSIAN = '''\
"""pytorch/examples reinforcement_learning/reinforce.py for a continuous action: Policy saves log-probs and
rewards, finish_episode computes normalised discounted returns and -log_prob * R."""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Normal

gamma = 0.99
eps = np.finfo(np.float32).eps.item()


class Pendulum:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.episode = -1

    def reset(self):
        self.episode += 1
        self.th, self.thdot, self.t = self.rng.uniform(-np.pi, np.pi), self.rng.uniform(-1, 1), 0
        return self._obs()

    def _obs(self):
        thdot = self.thdot * (-1e4 if (self.episode, self.t) == GLITCH else 1.0)  # a raw encoder count, sign flipped
        return np.array([np.cos(self.th), np.sin(self.th), thdot], dtype=np.float32)

    def step(self, u):
        u = float(np.clip(u, -2.0, 2.0))
        self.thdot = float(np.clip(self.thdot + 0.05 * (3 * np.sin(self.th) + 3.0 * u), -8, 8))
        self.th += 0.05 * self.thdot
        self.t += 1
        return self._obs(), -(self.th ** 2 + 0.1 * self.thdot ** 2), self.t >= 10


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(3, 64)
        self.mu_head = nn.Linear(64, 1)
        self.sigma_head = nn.Linear(64, 1)
        self.saved_log_probs, self.rewards = [], []

    def forward(self, x):
        h = F.relu(self.affine1(x))
        return self.mu_head(h), F.softplus(self.sigma_head(h))  # <origin:sigma>


def select_action(state):
    state = torch.from_numpy(state).float().unsqueeze(0)
    mu, sigma = policy(state)
    m = Normal(mu, sigma)
    action = m.sample()
    policy.saved_log_probs.append(m.log_prob(action).sum())
    return action.item()


def finish_episode():
    R, returns = 0, []
    for r in policy.rewards[::-1]:
        R = r + gamma * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + eps)
    policy_loss = torch.stack([-log_prob * R for log_prob, R in zip(policy.saved_log_probs, returns)]).sum()
    optimizer.zero_grad()
    policy_loss.backward()
    optimizer.step()
    del policy.rewards[:], policy.saved_log_probs[:]
    return policy_loss.item()


torch.manual_seed(543)
GLITCH = (2, 4)
env = Pendulum(543)
policy = Policy()
optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
for step in range(4):
    state, ep_reward, done = env.reset(), 0.0, False
    while not done:
        action = select_action(state)
        state, reward, done = env.step(action)
        policy.rewards.append(reward)
        ep_reward += reward
    loss = finish_episode()
    print(f"step {step} loss {loss:.4g} reward {ep_reward:.2f}")
torch.save({"policy": policy.state_dict()}, "ckpt.pt")
print("done")
'''

# 6. actor_critic with a hand-written entropy bonus: a cart-velocity glitch at episode 2 saturates the softmax to an
# exact 0; probs.log() is -inf there and 0 * -inf is NaN in the loss code (module None).
ACTOR_CRITIC = '''\
"""pytorch/examples reinforcement_learning/actor_critic.py (shared affine1, action_head, value_head, SavedAction,
smooth_l1_loss for the critic), plus an entropy bonus written by hand."""
from collections import namedtuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical

SavedAction = namedtuple("SavedAction", ["log_prob", "value", "entropy"])
gamma = 0.99
eps = np.finfo(np.float32).eps.item()


class CartPole:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.episode = -1

    def reset(self):
        self.episode += 1
        self.s, self.t = self.rng.uniform(-0.05, 0.05, 4), 0
        return self._obs()

    def _obs(self):
        s = self.s.copy()
        if (self.episode, self.t) == GLITCH:
            s[1] = 2.0e4  # the cart's velocity sensor glitches
        return s.astype(np.float32)

    def step(self, action):
        force = 10.0 if action == 1 else -10.0
        x, x_dot, th, th_dot = self.s
        th_acc = (9.8 * np.sin(th) - np.cos(th) * force / 1.1) / 0.5
        self.s = np.array([x + 0.02 * x_dot, x_dot + 0.02 * force / 1.1, th + 0.02 * th_dot, th_dot + 0.02 * th_acc])
        self.t += 1
        return self._obs(), 1.0, self.t >= 12 or abs(self.s[2]) > 0.21


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 64)
        self.action_head = nn.Linear(64, 2)
        self.value_head = nn.Linear(64, 1)
        self.saved_actions, self.rewards = [], []

    def forward(self, x):
        x = F.relu(self.affine1(x))
        return F.softmax(self.action_head(x), dim=-1), self.value_head(x)


def select_action(state):
    state = torch.from_numpy(state).float()
    probs, state_value = model(state)
    entropy = -(probs * probs.log()).sum()  # <origin:entropy>
    m = Categorical(probs)
    action = m.sample()
    model.saved_actions.append(SavedAction(m.log_prob(action), state_value, entropy))
    return action.item()


def finish_episode():
    R, returns, policy_losses, value_losses = 0, [], [], []
    for r in model.rewards[::-1]:
        R = r + gamma * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + eps)
    for (log_prob, value, entropy), R in zip(model.saved_actions, returns):
        advantage = R - value.item()
        policy_losses.append(-log_prob * advantage - 0.01 * entropy)
        value_losses.append(F.smooth_l1_loss(value, torch.tensor([R])))
    optimizer.zero_grad()
    loss = torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()
    loss.backward()
    optimizer.step()
    del model.rewards[:], model.saved_actions[:]
    return loss.item()


torch.manual_seed(543)
GLITCH = (2, 3)
env = CartPole(543)
model = Policy()
optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
for step in range(4):
    state, ep_reward, done = env.reset(), 0.0, False
    while not done:
        action = select_action(state)
        state, reward, done = env.step(action)
        model.rewards.append(reward)
        ep_reward += reward
    loss = finish_episode()
    print(f"step {step} loss {loss:.4g} reward {ep_reward:.0f}")
torch.save({"model": model.state_dict()}, "ckpt.pt")
print("done")
'''

# 7. siamese network with the contrastive loss (Hadsell et al.) computing the euclidean distance by hand: at step 2 the
# pair sampler draws the same image twice for a positive pair: d = sqrt(0); d**2's gradient is 0 and sqrt's 1/(2*0).
SIAMESE = '''\
"""A siamese network (one shared CNN called on both images) trained with the contrastive loss."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class SiameseNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.cnn = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.fc = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward_once(self, x):
        return self.fc(self.cnn(x))

    def forward(self, input1, input2):
        return self.forward_once(input1), self.forward_once(input2)


class ContrastiveLoss(nn.Module):
    def __init__(self, margin=2.0):
        super().__init__()
        self.margin = margin

    def forward(self, output1, output2, label):
        distance = torch.sqrt(torch.sum((output1 - output2) ** 2, dim=1))  # <origin:dist>
        return torch.mean(label * distance.pow(2) + (1 - label) * torch.clamp(self.margin - distance, min=0.0).pow(2))


def sample_pairs(images, classes, g, step, n=8):
    i = torch.randint(0, len(images), (n,), generator=g)
    j = torch.randint(0, len(images), (n,), generator=g)
    if step == 2:
        j[0] = i[0]  # sampling with replacement: an image paired with itself
    return images[i], images[j], (classes[i] == classes[j]).float()


torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
images, classes = torch.rand(40, 1, 14, 14, generator=g), torch.randint(0, 3, (40,), generator=g)
net = SiameseNetwork()
criterion = ContrastiveLoss()
optimizer = torch.optim.Adam(net.parameters(), lr=5e-4)
for step in range(4):
    img0, img1, label = sample_pairs(images, classes, g, step)
    optimizer.zero_grad()
    output1, output2 = net(img0, img1)
    loss_contrastive = criterion(output1, output2, label)
    loss_contrastive.backward()
    optimizer.step()
    print(f"step {step} loss {loss_contrastive.item():.4g}")
torch.save({"net": net.state_dict()}, "ckpt.pt")
print("done")
'''
# 8. time_sequence_prediction with LBFGS and a closure, trained with a Gaussian NLL whose noise scale is a raw
# parameter: an L-BFGS evaluation inside the optimizer's step tries sigma < 0 and log(sigma) is NaN in the closure.
LBFGS_SEQUENCE = '''\
"""pytorch/examples time_sequence_prediction: two LSTMCells and a Linear unrolled over a sine wave, LBFGS(lr=0.8)
stepping a closure; the loss is a Gaussian negative log-likelihood with a learned noise scale."""
import math

import torch
import torch.nn as nn


class Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, 16)
        self.lstm2 = nn.LSTMCell(16, 16)
        self.linear = nn.Linear(16, 1)
        self.sigma = nn.Parameter(torch.tensor(0.5))

    def forward(self, input, future=0):
        outputs = []
        h_t = torch.zeros(input.size(0), 16)
        c_t = torch.zeros(input.size(0), 16)
        h_t2 = torch.zeros(input.size(0), 16)
        c_t2 = torch.zeros(input.size(0), 16)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            outputs += [self.linear(h_t2)]
        return torch.cat(outputs, dim=1)


def nll(out, target):
    return 0.5 * ((out - target) ** 2).mean() / seq.sigma ** 2 + torch.log(seq.sigma)  # <origin:log_sigma>


torch.manual_seed(0)
T, L, N = 20, 24, 6
x = torch.arange(L) + torch.randint(-4 * T, 4 * T, (N, 1))
data = torch.sin(x / 1.0 / T).float()
input, target = data[:, :-1], data[:, 1:]
seq = Sequence()
optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8, max_iter=8)
for step in range(4):
    def closure():
        optimizer.zero_grad()
        out = seq(input)
        loss = nll(out, target)
        print("  closure loss", loss.item())
        loss.backward()
        return loss
    loss = optimizer.step(closure)
    print(f"step {step} loss {loss.item():.4g}")
torch.save({"seq": seq.state_dict()}, "ckpt.pt")
print("done")
'''

# 9. fast_neural_style with an isotropic total-variation regulariser: the third batch has a solid-colour image; the
# TransformerNet (reflection padding, instance norm, nearest upsampling) maps it to a constant image, dx = dy = 0 and
# sqrt's derivative is infinite there (loss code, NaN gradient).
FAST_NEURAL_STYLE = '''\
"""pytorch/examples fast_neural_style: TransformerNet trained against a frozen loss network with content loss,
Gram-matrix style loss and a total-variation term."""
import torch
import torch.nn as nn


class ConvLayer(nn.Module):
    def __init__(self, cin, cout, kernel_size, stride):
        super().__init__()
        self.reflection_pad = nn.ReflectionPad2d(kernel_size // 2)
        self.conv2d = nn.Conv2d(cin, cout, kernel_size, stride)

    def forward(self, x):
        return self.conv2d(self.reflection_pad(x))


class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1, self.in1 = ConvLayer(channels, channels, 3, 1), nn.InstanceNorm2d(channels, affine=True)
        self.conv2, self.in2 = ConvLayer(channels, channels, 3, 1), nn.InstanceNorm2d(channels, affine=True)
        self.relu = nn.ReLU()

    def forward(self, x):
        return x + self.in2(self.conv2(self.relu(self.in1(self.conv1(x)))))


class UpsampleConvLayer(nn.Module):
    def __init__(self, cin, cout, kernel_size, stride, upsample=None):
        super().__init__()
        self.upsample = upsample
        self.reflection_pad = nn.ReflectionPad2d(kernel_size // 2)
        self.conv2d = nn.Conv2d(cin, cout, kernel_size, stride)

    def forward(self, x):
        if self.upsample:
            x = nn.functional.interpolate(x, mode="nearest", scale_factor=self.upsample)
        return self.conv2d(self.reflection_pad(x))


class TransformerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.in1 = ConvLayer(3, 8, 5, 1), nn.InstanceNorm2d(8, affine=True)
        self.conv2, self.in2 = ConvLayer(8, 16, 3, 2), nn.InstanceNorm2d(16, affine=True)
        self.res1 = ResidualBlock(16)
        self.deconv1, self.in3 = UpsampleConvLayer(16, 8, 3, 1, upsample=2), nn.InstanceNorm2d(8, affine=True)
        self.deconv2 = UpsampleConvLayer(8, 3, 5, 1)
        self.relu = nn.ReLU()

    def forward(self, X):
        y = self.relu(self.in1(self.conv1(X)))
        y = self.relu(self.in2(self.conv2(y)))
        y = self.res1(y)
        y = self.relu(self.in3(self.deconv1(y)))
        return self.deconv2(y)


class LossNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.slice1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.slice2 = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU())

    def forward(self, x):
        h1 = self.slice1(x)
        return h1, self.slice2(h1)


def gram_matrix(y):
    b, ch, h, w = y.size()
    features = y.view(b, ch, w * h)
    return features.bmm(features.transpose(1, 2)) / (ch * h * w)


def normalize_batch(batch):
    mean = batch.new_tensor([0.485, 0.456, 0.406]).view(-1, 1, 1)
    std = batch.new_tensor([0.229, 0.224, 0.225]).view(-1, 1, 1)
    return (batch.div(255.0) - mean) / std


def total_variation(img):
    dx = img[:, :, 1:, :-1] - img[:, :, :-1, :-1]
    dy = img[:, :, :-1, 1:] - img[:, :, :-1, :-1]
    return torch.sqrt(dx ** 2 + dy ** 2).mean()  # <origin:tv>


torch.manual_seed(42)
SOLID_AT = 2
g = torch.Generator().manual_seed(0)
transformer = TransformerNet()
vgg = LossNet().requires_grad_(False)
optimizer = torch.optim.Adam(transformer.parameters(), lr=1e-3)
mse_loss = nn.MSELoss()
style = normalize_batch(torch.rand(1, 3, 16, 16, generator=g) * 255)
gram_style = [gram_matrix(f) for f in vgg(style)]
for step in range(4):
    x = torch.rand(2, 3, 16, 16, generator=g) * 255
    if step == SOLID_AT:
        x[1] = torch.tensor([30.0, 60.0, 90.0]).view(3, 1, 1)  # a solid-colour frame in the image folder
    optimizer.zero_grad()
    x = normalize_batch(x)
    y = transformer(x)
    features_y, features_x = vgg(y), vgg(x)
    content_loss = mse_loss(features_y[1], features_x[1])
    style_loss = sum(mse_loss(gram_matrix(fy), gs.expand(fy.size(0), -1, -1)) for fy, gs in zip(features_y, gram_style))
    total_loss = content_loss + 1e3 * style_loss + 1e-2 * total_variation(y)
    total_loss.backward()
    optimizer.step()
    print(f"step {step} loss {total_loss.item():.4g}")
torch.save({"transformer": transformer.state_dict()}, "ckpt.pt")
print("done")
'''

# 10. super_resolution (ESPCN with pixel_shuffle) trained with a relative L1 loss: the crop of step 3 comes from a
# letterboxed frame (target pixels exactly 0): |out - target| / target is x/0 = inf in the loss code.
SUPER_RESOLUTION = '''\
"""pytorch/examples super_resolution: Net (conv 5x5, 3x3, 3x3, conv to upscale**2 channels, pixel_shuffle) on the
Y channel, Adam; the loss is the mean relative error |SR - HR| / HR."""
import torch
import torch.nn as nn
import torch.nn.init as init


class Net(nn.Module):
    def __init__(self, upscale_factor):
        super().__init__()
        self.relu = nn.ReLU()
        self.conv1 = nn.Conv2d(1, 16, (5, 5), (1, 1), (2, 2))
        self.conv2 = nn.Conv2d(16, 16, (3, 3), (1, 1), (1, 1))
        self.conv3 = nn.Conv2d(16, 8, (3, 3), (1, 1), (1, 1))
        self.conv4 = nn.Conv2d(8, upscale_factor ** 2, (3, 3), (1, 1), (1, 1))
        self.pixel_shuffle = nn.PixelShuffle(upscale_factor)
        init.orthogonal_(self.conv1.weight, init.calculate_gain("relu"))
        init.orthogonal_(self.conv2.weight, init.calculate_gain("relu"))
        init.orthogonal_(self.conv3.weight, init.calculate_gain("relu"))
        init.orthogonal_(self.conv4.weight)

    def forward(self, x):
        x = self.relu(self.conv1(x))
        x = self.relu(self.conv2(x))
        x = self.relu(self.conv3(x))
        return self.pixel_shuffle(self.conv4(x))


def crops(g, step, n=4):
    hr = 0.1 + 0.9 * torch.rand(n, 1, 16, 16, generator=g)
    if step == 3:
        hr[2, :, :3, :] = 0.0  # a letterboxed frame: black bars
    lr = nn.functional.avg_pool2d(hr, 2)
    return lr, hr


torch.manual_seed(123)
g = torch.Generator().manual_seed(0)
model = Net(upscale_factor=2)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(5):
    input, target = crops(g, step)
    optimizer.zero_grad()
    out = model(input)
    loss = ((out - target).abs() / target).mean()  # <origin:rel_l1>
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.4g}")
torch.save({"model": model.state_dict()}, "ckpt.pt")
print("done")
'''

# 11. A two-layer GCN (Kipf & Welling) on a tiny random graph, full batch: the bag-of-words features are
# row-normalised once before training (NormalizeFeatures); a document with no words gives a 0/0 row, so the very first
# forward receives NaN (step 0, the data's).
GCN = '''\
"""pygcn-style GCN: sparse normalised adjacency with self-loops, GraphConvolution layers with torch.spmm,
log_softmax + nll_loss on the training nodes, Adam with weight decay."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class GraphConvolution(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features))
        stdv = 1.0 / math.sqrt(out_features)
        self.weight.data.uniform_(-stdv, stdv)
        self.bias.data.uniform_(-stdv, stdv)

    def forward(self, input, adj):
        return torch.spmm(adj, torch.mm(input, self.weight)) + self.bias


class GCN(nn.Module):
    def __init__(self, nfeat, nhid, nclass, dropout=0.5):
        super().__init__()
        self.gc1 = GraphConvolution(nfeat, nhid)
        self.gc2 = GraphConvolution(nhid, nclass)
        self.dropout = dropout

    def forward(self, x, adj):
        x = F.relu(self.gc1(x, adj))
        x = F.dropout(x, self.dropout, training=self.training)
        return F.log_softmax(self.gc2(x, adj), dim=1)


def load_graph(g, n=30, vocab=20):
    counts = (torch.rand(n, vocab, generator=g) < 0.2).float()
    counts[5] = 0.0 if EMPTY_DOC else counts[5]  # a paper whose abstract was empty
    features = counts / counts.sum(1, keepdim=True)  # row-normalise (NormalizeFeatures)
    a = (torch.rand(n, n, generator=g) < 0.1).float()
    a = ((a + a.t()) > 0).float() + torch.eye(n)
    d_inv_sqrt = a.sum(1).pow(-0.5)
    adj = (d_inv_sqrt[:, None] * a * d_inv_sqrt[None, :]).to_sparse()
    return features, adj, torch.randint(0, 3, (n,), generator=g)


torch.manual_seed(42)
EMPTY_DOC = True
g = torch.Generator().manual_seed(0)
features, adj, labels = load_graph(g)
idx_train = torch.arange(0, 20)
model = GCN(nfeat=features.shape[1], nhid=16, nclass=3)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
for step in range(4):
    model.train()
    optimizer.zero_grad()
    output = model(features, adj)
    loss_train = F.nll_loss(output[idx_train], labels[idx_train])
    loss_train.backward()
    optimizer.step()
    print(f"step {step} loss {loss_train.item():.4g}")
torch.save({"model": model.state_dict()}, "ckpt.pt")
print("done")
'''


case("lstm_lm_eos_id_past_the_dictionary_raises", LSTM_LM,
     Expect(2, "exception", "forward", "aten.embedding.default", "encoder", "embed", "label_out_of_range", "raised"),
     Plain("raise", 2, "IndexError"))
case("mnist_adadelta_eps_zero_blank_border_first_step", MNIST,
     Expect(0, "nonfinite_param", "optimizer", "aten.div_.Tensor", "fc1", "opt_step", "optimizer_state"),
     Plain("param", 0))
case("dcgan_minibatch_stddev_duplicated_real_batch", DCGAN,
     Expect(2, "nonfinite_grad", "backward", "aten.sqrt.default", "main.5", "mbstd", "grad_singularity"),
     Plain("grad", 2))
case("vae_unscaled_16bit_shard_reparameterize_overflow_bce_raises", VAE,
     Expect(3, "exception", "forward", "aten.exp.default", "", "reparam", "exp_overflow", "raised"),
     Plain("raise", 3, "RuntimeError"))
case("reinforce_gaussian_policy_softplus_underflow_normal_raises", REINFORCE_GAUSSIAN,
     Expect(2, "exception", "forward", "aten.softplus.default", "", "sigma", "domain_error", "raised"),
     Plain("raise", 2, "ValueError"))
case("actor_critic_handwritten_entropy_saturated_softmax", ACTOR_CRITIC,
     Expect(2, "nonfinite_loss", "forward", "aten.log.default", None, "entropy", "log_nonpositive"),
     Plain("loss", 2))
case("siamese_contrastive_loss_image_paired_with_itself", SIAMESE,
     Expect(2, "nonfinite_grad", "backward", "aten.sqrt.default", None, "dist", "grad_singularity"),
     Plain("grad", 2))
case("lbfgs_sequence_gaussian_nll_negative_sigma", LBFGS_SEQUENCE,
     Expect(1, "nonfinite_loss", "forward", "aten.log.default", None, "log_sigma", "log_nonpositive"),
     Plain("closure", 1))
case("fast_neural_style_isotropic_tv_solid_colour_frame", FAST_NEURAL_STYLE,
     Expect(2, "nonfinite_grad", "backward", "aten.sqrt.default", None, "tv", "grad_singularity"),
     Plain("grad", 2))
case("super_resolution_relative_l1_letterbox_zero_target", SUPER_RESOLUTION,
     Expect(3, "nonfinite_loss", "forward", "aten.div.Tensor", None, "rel_l1", "div_by_zero"),
     Plain("loss", 3))
case("gcn_row_normalised_features_empty_document_first_step", GCN,
     Expect(0, "nonfinite_input", "data", None, None, None, "nonfinite_input"),
     Plain("loss", 0))

# 12. Quiet: the same programs without their fault.
case("quiet_lstm_lm_with_eos_in_the_dictionary",
     quiet(LSTM_LM, ("EOS = ntokens  # BUG: '<eos>' was never added to the dictionary",
                     "EOS = ntokens - 1  # '<eos>' is the dictionary's last id")), None, None)
case("quiet_mnist_adadelta_steplr_default_eps",
     quiet(MNIST, ("Adadelta(model.parameters(), lr=1.0, eps=0.0)", "Adadelta(model.parameters(), lr=1.0)")), None, None)
case("quiet_dcgan_minibatch_stddev_distinct_images", quiet(DCGAN, ("DUPLICATED = 2", "DUPLICATED = -1")), None, None)
case("quiet_vae_every_shard_scaled", quiet(VAE, ("return raw if i == 3 else raw / 65535.0", "return raw / 65535.0")),
     None, None)
case("quiet_lbfgs_sequence_mse_closure",
     quiet(LBFGS_SEQUENCE, ("return 0.5 * ((out - target) ** 2).mean() / seq.sigma ** 2 + torch.log(seq.sigma)  "
                            "# <origin:log_sigma>", "return ((out - target) ** 2).mean()")), None, None)


# ---------------------------------------------------------------------------------------------- running
def origin_line(script: str, tag: str) -> int:
    [line] = [i for i, text in enumerate(script.splitlines(), 1) if text.rstrip().endswith(f"# <origin:{tag}>")]
    return line


def _folder(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "train.py").write_text(CASES[name][0])
    return folder


@contextlib.contextmanager
def _inside(folder: Path):
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(cwd)


def _plain(folder: Path) -> str:
    """The script run by plain runpy (no nantrace) under global optimizer step hooks; what it printed, with
    ``CHECK opt<k> step<n> grads|params <finite>`` lines and ``RAISED <type>: <message>`` or ``EXIT 0``."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    ids: dict[int, int] = {}
    done: dict[int, int] = {}
    out = io.StringIO()

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        k = ids.setdefault(id(opt), len(ids))
        grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
        print(f"CHECK opt{k} step{done.get(k, 0)} grads {all(bool(torch.isfinite(g).all()) for g in grads)}", file=out)

    def post(opt: Any, args: Any, kwargs: Any) -> None:
        k = ids[id(opt)]
        params = [p for group in opt.param_groups for p in group["params"]]
        print(f"CHECK opt{k} step{done.get(k, 0)} params {all(bool(torch.isfinite(p).all()) for p in params)}",
              file=out)
        done[k] = done.get(k, 0) + 1

    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
    try:
        with _inside(folder), contextlib.redirect_stdout(out):
            try:
                runpy.run_path(str(folder / "train.py"), run_name="__main__")
                print("EXIT 0")
            except Exception as exc:
                print(f"RAISED {type(exc).__name__}: {exc}")
    finally:
        for handle in handles:
            handle.remove()
    return out.getvalue()


@pytest.fixture(scope="module", autouse=True)
def _validation_as_in_a_script() -> Any:
    """torch.distributions validates by default in a script (``__debug__``); an earlier test's ``torch.compile``
    turns that default off for the whole process (tests/conftest.py ``distributions_validate``): the scripts of
    this module, run in-process, get it back."""
    before = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(True)
    yield
    torch.distributions.Distribution.set_default_validate_args(before)


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Path]]:
    root = tmp_path_factory.mktemp("plain")
    runs = {}
    for name in CASES:
        folder = _folder(root, name)
        runs[name] = (_plain(folder), folder)
    return runs


@pytest.fixture(scope="module")
def zero_code_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, str, Path]]:
    """name -> (``run_script`` result, the script's stdout, its folder): ``nantrace run`` in-process."""
    root = tmp_path_factory.mktemp("zero_code")
    runs = {}
    for name in CASES:
        folder = _folder(root, name)
        out = io.StringIO()
        with _inside(folder), contextlib.redirect_stdout(out):
            result = run_script(folder / "train.py", config=QUIET)
        runs[name] = (result, out.getvalue(), folder)
    return runs


def _env() -> dict[str, str]:
    return dict(os.environ, COLUMNS="120", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """name -> (``python -m nantrace run --run-dir runs train.py``, its folder); the CLI cases at once."""
    root = tmp_path_factory.mktemp("cli")
    procs = []
    for name in CLI_CASES:
        folder = _folder(root, name)
        procs.append((name, folder, subprocess.Popen([sys.executable, "-m", "nantrace", "run", "--run-dir", "runs",
                                                      "train.py"], cwd=folder, stdout=subprocess.PIPE,
                                                     stderr=subprocess.PIPE, text=True, env=_env())))
    done = {}
    for name, folder, proc in procs:
        out, err = proc.communicate(timeout=300)
        done[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err), folder)
    return done


def _losses(stdout: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^step (\d+) loss (\S+)", stdout, re.M)}


def _checks(stdout: str) -> dict[tuple[int, str], bool]:
    """(step, 'grads'|'params') -> finite, for the first optimizer that stepped."""
    return {(int(m.group(1)), m.group(2)): m.group(3) == "True"
            for m in re.finditer(r"^CHECK opt0 step(\d+) (grads|params) (True|False)", stdout, re.M)}


def _describe(i: Any) -> str:
    return (f"step={i.step} kind={i.kind} phase={i.phase} op={i.op} module={i.module!r} cause={i.cause} "
            f"action={i.action} source={i.source}")


def _got(incidents: list[Any]) -> tuple[Any, ...] | None:
    blocking = [i for i in incidents if i.action != "logged"]
    if not blocking:
        return None
    first = blocking[0]
    source = first.source
    if source is not None:
        where, _, line = source.rpartition(":")
        source = f"{os.path.basename(where)}:{line}"
    return (first.step, first.kind, first.phase, first.op, first.module, first.cause, first.action, source)


def _want(script: str, expect: Expect) -> tuple[Any, ...]:
    source = None if expect.tag is None else f"train.py:{origin_line(script, expect.tag)}"
    return (expect.step, expect.kind, expect.phase, expect.op, expect.module, expect.cause, expect.action, source)


def _xfail_params(names: Any) -> list[Any]:
    return [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=XFAIL[n])) if n in XFAIL else n for n in names]


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str, plain_runs: dict[str, tuple[str, Path]]) -> None:
    script, expect, plain = CASES[name]
    out, _ = plain_runs[name]
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
        assert sorted(losses) == list(range(k)), out
        assert re.search(rf"^RAISED {plain.raises}:", out, re.M) and "EXIT 0" not in out, out
    elif plain.what == "loss":
        assert not math.isfinite(losses[k]), out
    elif plain.what == "grad":
        assert math.isfinite(losses.get(k, 0.0)) and checks[(k, "grads")] is False, out  # dcgan: dies later, in G's step
    elif plain.what == "closure":  # a later evaluation of step k's closure inside optimizer.step(closure)
        segment = re.split(r"^step \d+ loss .*$", out, flags=re.M)[k]
        evaluations = [float(v) for v in re.findall(r"^  closure loss (\S+)", segment, re.M)]
        assert math.isfinite(losses[k]) and math.isfinite(evaluations[0]), out
        assert not all(math.isfinite(v) for v in evaluations), out
    elif plain.what == "param":
        assert math.isfinite(losses[k]) and checks[(k, "grads")] and checks[(k, "params")] is False, out
    if expect is not None and expect.tag is not None:
        origin_line(script, expect.tag)  # the tag is there, once


@pytest.mark.parametrize("name", _xfail_params(CASES))
def test_zero_code_diagnosis(name: str, zero_code_runs: dict[str, tuple[Any, str, Path]],
                             plain_runs: dict[str, tuple[str, Path]]) -> None:
    script, expect, plain = CASES[name]
    result, out, folder = zero_code_runs[name]
    incidents = result.watch.incidents
    if expect is None:  # quiet: the script's own output, exit 0, nothing recorded, the same checkpoint
        assert result.exit_code == 0, result.traceback
        assert out.rstrip().endswith("done"), out
        assert incidents == [], [_describe(i) for i in incidents]
        assert _losses(out) == _losses(plain_runs[name][0]), out
        watched, unwatched = torch.load(folder / "ckpt.pt"), torch.load(plain_runs[name][1] / "ckpt.pt")
        assert watched.keys() == unwatched.keys()
        for key in watched:
            for param, value in watched[key].items():
                assert torch.equal(value, unwatched[key][param]), (key, param)
        return
    got = _got(incidents)
    assert got is not None, ("no incident", result.exit_code, result.traceback)
    assert got == _want(script, expect), [_describe(i) + " | " + i.summary for i in incidents]
    if plain is not None and plain.what == "raise":  # the script died with its own exception
        assert result.exit_code == 1 and type(result.error).__name__ == plain.raises, result.traceback
        assert not isinstance(result.error, nantrace.NonFiniteError)
    else:  # the bad update was skipped: the script ran to its end
        assert result.exit_code == 0, result.traceback
        assert out.rstrip().endswith("done"), out


@pytest.mark.parametrize("name", _xfail_params(CLI_CASES))
def test_nantrace_run_cli_agrees(name: str, cli_runs: dict[str, tuple[subprocess.CompletedProcess, Path]]) -> None:
    script, expect, plain = CASES[name]
    proc, folder = cli_runs[name]
    incidents = sorted((i for db in sorted((folder / "runs").rglob("nantrace.db"))
                        for i in RunStore(db.parent, readonly=True).incidents()), key=lambda i: i.time)
    got = _got(incidents)
    assert got is not None, (proc.returncode, proc.stderr[-3000:])
    assert got == _want(script, expect), ([_describe(i) for i in incidents], proc.stderr[-2000:])
    if plain is not None and plain.what == "raise":
        assert proc.returncode == 1, proc.stderr
        err = proc.stderr
        assert err.index("Traceback (most recent call last):") < err.index(plain.raises + ":") < err.index("nantrace ·"), err
    else:
        assert proc.returncode == 0, proc.stderr
