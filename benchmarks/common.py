"""Shared pieces of the benchmarks: the GPT-style and the launch-bound
models, machine facts, memory probes and small statistics helpers.

Benchmarks print one JSON document on stdout (figures) and a readable table
on stderr; RESULTS.md copies the figures with the date, machine and command.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- machine
def machine_info() -> dict:
    """Date, CPU model and core count, Python and library versions."""
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        # Other processes share the cores: the load says how quiet it was.
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    for mod in ("torch", "numpy", "pyarrow", "pandas"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a fact we could not read
            pass
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ----------------------------------------------------------------- memory
def peak_rss_mib() -> float:
    """Peak resident set size of this process so far: VmHWM, which belongs to
    this program (Linux's ru_maxrss also keeps the peak of the process that
    forked it from before the exec, so a child of a big parent reads big)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def thread_cpu_s(native_id: int) -> float | None:
    """CPU time (user + system) of one thread of this process, from /proc:
    the recorder's writer thread spends it off the training thread."""
    try:
        fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # Fields after the command name start at field 3 (state): utime is 14, stime 15.
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def run_child(args: list[str], timeout: float | None = None) -> dict:
    """Run a Python child (a benchmark in a measuring mode) and parse the one
    JSON document it prints on stdout."""
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


# ------------------------------------------------------------- statistics
def median(values) -> float:
    return statistics.median(values)


def summarize(values) -> dict:
    v = sorted(values)
    n = len(v)
    return {
        "n": n,
        "median": statistics.median(v),
        "p10": v[max(0, int(0.1 * (n - 1)))],
        "p90": v[min(n - 1, int(round(0.9 * (n - 1))))],
        "mean": statistics.fmean(v),
    }


def print_table(rows: list[dict], columns: list[str], file=sys.stderr) -> None:
    """A plain aligned table for people (stderr; stdout carries JSON)."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
              for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)), file=file)
    for row in cells:
        print("  ".join(x.ljust(w) for x, w in zip(row, widths)), file=file)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return "" if v is None else str(v)


# ------------------------------------------------------------------ model
def gpt(vocab: int = 2048, d_model: int = 256, n_layers: int = 4, n_heads: int = 4,
        seq: int = 128):
    """A GPT-style decoder (pre-norm blocks: LayerNorm, causal self-attention
    with separate qkv/proj Linears, LayerNorm, GELU MLP), built lazily so that
    importing this module does not import torch."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(x).split(c, dim=-1)
            q, k, v = (z.view(b, t, n_heads, c // n_heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, c))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(d_model)
            self.attn = CausalSelfAttention()
            self.ln2 = nn.LayerNorm(d_model)
            self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                     nn.Linear(4 * d_model, d_model))

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d_model)
            self.pos = nn.Embedding(seq, d_model)
            self.blocks = nn.Sequential(*[Block() for _ in range(n_layers)])
            self.ln_f = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)

        def forward(self, idx):
            pos = torch.arange(idx.shape[1], device=idx.device)
            h = self.blocks(self.tok(idx) + self.pos(pos))
            return self.head(self.ln_f(h))

    return GPT()


def gpt_of(size: dict):
    """`gpt()` with the model's dimensions taken from a benchmark's size dict
    (which also holds the batch size)."""
    return gpt(**{k: size[k] for k in ("vocab", "d_model", "n_layers", "n_heads", "seq")})


def deep_narrow(n_blocks: int = 48, width: int = 16):
    """A launch-bound model: deep and narrow, so that its arithmetic is
    negligible and a step is the host launching kernels (what a fast GPU
    leaves of a step). Each residual block is LayerNorm, Linear, GELU,
    Linear with the input added back: 5 modules a block, with the stack
    and the root 48 * 5 + 2 = 242 modules. Built lazily (no torch import
    at module import)."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.fc1 = nn.Linear(width, width)
            self.act = nn.GELU()
            self.fc2 = nn.Linear(width, width)

        def forward(self, x):
            return x + self.fc2(self.act(self.fc1(self.norm(x))))

    class DeepNarrow(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*[Block() for _ in range(n_blocks)])

        def forward(self, x):
            return self.blocks(x)

    return DeepNarrow()


def write_json(obj, path: str | os.PathLike | None) -> None:
    text = json.dumps(obj, indent=2, default=str)
    if path:
        Path(path).write_text(text + "\n")
    print(text)
