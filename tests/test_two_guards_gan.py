"""A GAN with one guard per model (generator and discriminator, each with its own optimizer).

At step 3 the noise is scaled by 1e4, the discriminator's sigmoid saturates to exactly 1 on the
fakes and ``log(1 - D(G(z)))`` is log 0 in D's loss code: D's guard must name it and skip D's
update. G's own loss and gradients that step are finite, so G's update must go through: D's ``backward()`` (whose graph reads ``G(z).detach()``, so G's forward
ran) is not G's loss (``StepRecorder._reaches_model``, used while two or more guards are alive).
"""

from __future__ import annotations

import torch
from torch import nn

import nantrace

BAD_STEP = 3
CONFIG = nantrace.Config(outputs={"print_incidents": False})


def _run() -> tuple[list[nantrace.Incident], list[nantrace.Incident], list[bool]]:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 8))
    D = nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1), nn.Sigmoid())
    opt_g, opt_d = torch.optim.Adam(G.parameters(), lr=1e-4), torch.optim.Adam(D.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(15)
    g_updated = []
    with nantrace.watch(D, opt_d, config=CONFIG) as guard_d, nantrace.watch(G, opt_g, config=CONFIG) as guard_g:
        for step in range(5):
            real = torch.randn(16, 8, generator=gen) * 0.5 + 1.0
            z = torch.randn(16, 4, generator=gen) * (1e4 if step == BAD_STEP else 1)
            opt_d.zero_grad()
            loss_d = -(torch.log(D(real)) + torch.log(1 - D(G(z).detach()))).mean()  # origin: d_loss
            loss_d.backward()
            opt_d.step()
            before = [p.detach().clone() for p in G.parameters()]
            opt_g.zero_grad()
            loss_g = -torch.log(D(G(torch.randn(16, 4, generator=gen))) + 1e-6).mean()
            loss_g.backward()
            opt_g.step()
            g_updated.append(any(not torch.equal(a, p) for a, p in zip(before, G.parameters())))
        return list(guard_d.incidents), list(guard_g.incidents), g_updated


def test_the_discriminator_guard_names_its_own_loss_code(one_thread):
    d_incidents, _, _ = _run()
    assert [(i.step, i.kind, i.op, i.module, i.cause, i.action) for i in d_incidents] == [
        (BAD_STEP, "nonfinite_loss", "aten.log.default", None, "log_nonpositive", "skipped")]


def test_the_generator_guard_does_not_take_the_discriminator_loss_for_its_own(one_thread):
    _, g_incidents, g_updated = _run()
    assert g_incidents == [] and all(g_updated)
