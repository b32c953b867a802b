"""What the prelude (the step's code before the model's forward, taped) keeps alive is bounded in bytes, not
only in calls: an evaluation between two steps whose outputs the program drops must not stay in memory
because the prelude holds them as arguments of its calls (it starts over once the tensors only it keeps alive
pass ``PRELUDE_ALONE_BYTES``), while a long prelude whose values the step still uses is kept whole (a GAE loop
of a few hundred calls between a no-grad pass and the forward)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
import nantrace.loss_tape as loss_tape

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]


def test_held_alone_bytes_counts_only_what_the_program_dropped() -> None:
    tape = loss_tape.LossTape(64, prelude=True)
    kept = torch.ones(1000)  # made outside the tape: held by the program
    dropped = torch.ones(5000)  # made outside the tape: dropped by the program after the call below
    tape.resume()
    try:
        a = kept * 2.0
        b = dropped + 1.0
        c = torch.ones(3000) * 3.0  # made by a taped call: named by position, never held
    finally:
        tape.pause()
    del dropped
    assert tape.held_alone_bytes() == 5000 * 4
    del a, b, c, kept
    tape.detach()


def test_an_evaluation_between_steps_does_not_stay_alive_through_the_prelude(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss_tape, "PRELUDE_ALONE_BYTES", 2 << 20)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    prelude = guard.recorder.prelude
    peaks = []
    try:
        for step in range(3):
            x, y = torch.randn(8, 16), torch.randint(0, 512, (8,))
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            for _ in range(200):  # an evaluation pass between steps: the model's outputs, dropped each time
                with torch.no_grad():
                    out = model(torch.randn(256, 16))
                hits = out.argmax(-1)  # a taped call holding the (untaped) forward's output
                del out, hits
                peaks.append(prelude.held_alone_bytes())
    finally:
        guard.close()
    budget = loss_tape.PRELUDE_ALONE_BYTES
    per_check = loss_tape.PRELUDE_CHECK_EVERY * 256 * 512 * 4  # what one check interval can add at most
    assert max(peaks) <= budget + per_check
    assert max(peaks) > 0  # it did keep some: the bound, not an empty tape, is what is tested
