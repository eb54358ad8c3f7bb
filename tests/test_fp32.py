import torch
import torch.nn as nn

from recorders.fp32 import is_kept_fp32, keep_fp32, release_fp32


class Softmaxer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x).softmax(-1), x.sum()


def test_kept_module_runs_every_op_in_float32_under_cpu_fp16_autocast():
    m = Softmaxer()
    x = torch.randn(2, 8).half()
    with torch.autocast("cpu", dtype=torch.float16):
        plain = m(x)
    assert plain[0].dtype == torch.float16
    keep_fp32(m)
    with torch.autocast("cpu", dtype=torch.float16):
        kept = m(x)
    assert kept[0].dtype == torch.float32 and kept[1].dtype == torch.float32
    assert is_kept_fp32(m)


def test_keep_fp32_leaves_state_dict_and_gradients_intact_and_can_be_undone():
    m = Softmaxer()
    keys = list(m.state_dict())
    keep_fp32(keep_fp32(m))
    assert list(m.state_dict()) == keys
    with torch.autocast("cpu", dtype=torch.float16):
        out, _ = m(torch.randn(2, 8))
    out.float().sum().backward()
    assert m.proj.weight.grad is not None and m.proj.weight.grad.dtype == torch.float32
    release_fp32(m)
    assert not is_kept_fp32(m)
    with torch.autocast("cpu", dtype=torch.float16):
        assert m(torch.randn(2, 8))[0].dtype == torch.float16
