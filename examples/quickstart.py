"""Quick start: a plain PyTorch loop with one added line. The model computes log(softmax(x))
by hand; on an extreme batch the softmax underflows to 0 and the loss turns -inf/NaN."""

import torch
import torch.nn.functional as F
from torch import nn

import nantrace


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.head(self.body(x)), dim=-1)
        return torch.log(probs)  # log-probabilities, the naive way


def main() -> None:
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = nantrace.watch(model, optimizer, run_dir="runs/quickstart")  # the one added line

    for step in range(50):
        x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        if step == 30:
            x = x * 1e4  # an unnormalised batch slips through
        optimizer.zero_grad()
        loss = F.nll_loss(model(x), y)
        loss.backward()
        optimizer.step()  # nantrace skips this update at step 30 and explains why

    guard.close()
    print(f"{len(guard.incidents)} incident(s); training went on to step {guard.step}")


if __name__ == "__main__":
    main()
