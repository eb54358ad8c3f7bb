"""A user's training script: the loss is computed outside the model
(`loss = criterion(model(x), y)`), float16 autocast on the CPU with a
GradScaler. Two planted events:
- step SKIP_STEP: targets 1000x larger: the scaled gradient overflows float16
  in the backward only (a harmless scaler skip; the forward stays finite);
- step FAULT_STEP: inputs 1e6x larger: float16 cannot hold them, the
  forward turns NaN (the real failure); float32 holds them, and the
  model's normalisation keeps the step tame there.

    python tests/outside_loss_train.py RUN_DIR  (tests/test_outside_loss.py)
"""
import sys

import torch
from torch import nn

SKIP_STEP, FAULT_STEP, STEPS = 15, 30, 40

criterion = nn.MSELoss()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        z = self.fc1(x)
        z = z / torch.sqrt((z.float() * z.float()).mean(-1, keepdim=True) + 1e-6).to(z.dtype)
        return self.fc2(z)


def make_model():
    torch.manual_seed(0)
    return Net()


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 4, generator=g)
    y = torch.randn(8, 1, generator=g)
    if step == SKIP_STEP:
        y = y * 1000.0
    if step == FAULT_STEP:
        x = x * 1e6
    return x, y


def loss_fn(pred, target):
    """The same loss as a top-level function (the `--function` variant)."""
    return nn.functional.mse_loss(pred, target)


def main(run_dir, use_function=False):
    from recorders import AmpRecorder
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    rec = AmpRecorder(run_dir, model, optimizer=opt, scaler=scaler, loss_fn=loss_fn if use_function else criterion)
    # Its own loop: a user's script, run by subprocess, trains as users write it (not through tests/tiny_models.py).
    for step in range(STEPS):
        x, y = batch(step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x), y) if use_function else criterion(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        rec.step(loss)
    rec.close()


if __name__ == "__main__":
    main(sys.argv[1], use_function="--function" in sys.argv[2:])
