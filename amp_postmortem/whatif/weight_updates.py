"""What an optimizer step does to weights held in low precision, watched
during a re-run of a saved window (`rerun.py`).

Each watcher here has two calls around the optimizer's step,
`before(params)` and `after(params, skipped)`, `params` the (name,
parameter) pairs the run held in bfloat16/float16 (whatever dtype the
re-run holds them in). The re-run calls every `before` in order and every
`after` in reverse order, so a watcher listed first sees the weights as
the model holds them, around whatever the later ones do to the step.

- `UpdateCount`: per step, the positions the optimizer was asked to move
  (non-zero gradient) and how many of them kept their exact value: the
  recorder's measure (`recorders/collectors/updates.py`), so a re-run says
  what the recorded run said.
- `StochasticRounding`: the update computed in float32 and rounded to the
  parameter's dtype stochastically (up with probability equal to the
  fraction of the ulp it covers): an update below half an ulp is then
  kept in expectation instead of always lost. The optimizer's state is
  held in float32 for the trial (its update is computed there).
- `UpdateReach`: how far each position's update falls short of half an
  ulp of the weight in the dtype the run held it in (`half_ulp / |update|`),
  from a re-run whose parameters are float32: the factor by which the
  learning rate must grow for that update to land (a torch optimizer's
  update scales with its learning rate).
"""
from __future__ import annotations

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
MAX_REACH_SAMPLES = 1 << 20   # positions kept for the quantile (torch.quantile takes at most 2^24)


def half_ulp(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of `dtype`'s values at |w| (float32): an update of
    that size or less leaves a `dtype` weight w unchanged when rounded to
    nearest. Subnormal weights have their dtype's subnormal spacing."""
    info = torch.finfo(dtype)
    # frexp: |w| = m * 2^e with m in [0.5, 1), so the binade's ulp is eps * 2^(e - 1).
    _, e = torch.frexp(w.float().abs().clamp_min(info.tiny))
    return torch.ldexp(torch.full_like(w, info.eps / 2, dtype=torch.float32), (e - 1).float())


class UpdateCount:
    """Counts, over the steps the optimizer took, the asked and the kept-
    unchanged positions of `params` (positions with a zero gradient are not
    asked)."""

    def __init__(self):
        self.moved: list[int] = []
        self.unchanged: list[int] = []
        self._before = None

    def before(self, params) -> None:
        with torch.no_grad():
            self._before = [p.detach().clone() if p.grad is not None else None for _, p in params]

    def after(self, params, skipped: bool) -> None:
        before, self._before = self._before, None
        if skipped or before is None:  # a skipped step asked for nothing
            self.moved.append(0)
            self.unchanged.append(0)
            return
        moved = kept = 0
        with torch.no_grad():
            for (_, p), b in zip(params, before):
                if b is None or p.grad is None:
                    continue
                asked = p.grad.detach() != 0
                moved += int(asked.sum())
                kept += int((asked & (p.detach() == b.to(p.dtype))).sum())
        self.moved.append(moved)
        self.unchanged.append(kept)

    def share(self, index: int = -1) -> float | None:
        return self.unchanged[index] / self.moved[index] if self.moved and self.moved[index] else None

    @property
    def total_share(self) -> float | None:
        asked = sum(self.moved)
        return sum(self.unchanged) / asked if asked else None


class StochasticRounding:
    """Low-precision parameters updated in float32 and rounded back to
    their dtype stochastically (`seed`: the trial's own generator, so the
    steps' recorded RNG states are left alone)."""

    def __init__(self, seed: int = 0):
        self.seed = int(seed)
        self._gen: torch.Generator | None = None
        self._dtypes: list = []

    def before(self, params) -> None:
        self._dtypes = [p.dtype for _, p in params]
        with torch.no_grad():
            for _, p in params:
                if p.dtype in LOW_PRECISION:
                    p.data = p.data.float()
                    if p.grad is not None:
                        p.grad = p.grad.float()

    def after(self, params, skipped: bool) -> None:
        with torch.no_grad():
            for (_, p), dtype in zip(params, self._dtypes):
                if dtype in LOW_PRECISION:
                    p.data = self.round(p.data, dtype)
                    if p.grad is not None:  # back to the parameter's dtype: autograd accumulates into it
                        p.grad = p.grad.to(dtype)

    def round(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self._gen is None or self._gen.device != x.device:
            self._gen = torch.Generator(device=x.device).manual_seed(self.seed)
        if dtype is torch.bfloat16:
            # bfloat16 is float32's upper 16 bits: add uniform noise below them, then truncate.
            bits = x.contiguous().view(torch.int32)
            noise = torch.randint(0, 1 << 16, x.shape, generator=self._gen, device=x.device, dtype=torch.int32)
            return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)
        # float16: round down and up to the grid, pick up with the probability of the remainder.
        down = x.to(dtype)
        down = torch.where(down.float() > x, torch.nextafter(down, torch.full_like(down, -float("inf"))), down)
        up = torch.nextafter(down, torch.full_like(down, float("inf")))
        gap = (up.float() - down.float())
        p = torch.where(gap > 0, (x - down.float()) / gap, torch.zeros_like(x))
        draw = torch.rand(x.shape, generator=self._gen, device=x.device)
        return torch.where(draw < p, up, down)


class UpdateReach:
    """Per asked position of every step taken: half an ulp of the weight
    in its recorded dtype over the float32 update's size (`dtypes`: name ->
    the recorded dtype). Every step, not the first alone: Adam's first
    update is lr x sign(g), its later ones shrink where the gradient's
    sign wavers."""

    def __init__(self, dtypes: dict):
        self.dtypes = dtypes
        self._parts: list = []
        self._before = None

    def before(self, params) -> None:
        self._before = [p.detach().clone() if p.grad is not None else None for _, p in params]

    def after(self, params, skipped: bool) -> None:
        before, self._before = self._before, None
        if skipped or before is None:
            return
        parts = []
        with torch.no_grad():
            for (name, p), b in zip(params, before):
                if b is None or p.grad is None:
                    continue
                asked = p.grad.detach() != 0
                step = (p.detach().float() - b.float()).abs()[asked]
                need = half_ulp(b.float()[asked], self.dtypes[name])
                parts.append(need / step.clamp_min(torch.finfo(torch.float32).tiny))
        if parts:
            self._parts.append(_sample(torch.cat([t.flatten() for t in parts]).cpu(), MAX_REACH_SAMPLES))

    @property
    def ratios(self) -> torch.Tensor | None:
        return _sample(torch.cat(self._parts), MAX_REACH_SAMPLES) if self._parts else None

    def factor(self, kept: float) -> float | None:
        """The learning-rate factor at which a share `kept` of the steps'
        updates reach half an ulp (None: nothing measured)."""
        r = self.ratios
        if r is None or not r.numel():
            return None
        return float(torch.quantile(r.double(), kept))


def _sample(r: torch.Tensor, most: int) -> torch.Tensor:
    if r.numel() <= most:
        return r
    return r[torch.randperm(r.numel(), generator=torch.Generator().manual_seed(0))[:most]]


def window_param_dtype(w) -> str | None:
    """The dtype the window saved the trainable parameters in: one name,
    `mixed (a, b)`, or None (no parameter)."""
    found = sorted({str(t.dtype).replace("torch.", "") for t in w.params.values() if t.is_floating_point()})
    if not found:
        return None
    return found[0] if len(found) == 1 else "mixed (" + ", ".join(found) + ")"


def hold_params(net, w, held: str) -> list:
    """Put `net`'s parameters (and buffers) in the dtypes of `held`:
    "recorded" (the window's), "float32" (every floating one). Returns the
    (name, parameter) pairs the window held in bfloat16/float16."""
    saved = {**w.params, **w.buffers}
    low = []
    with torch.no_grad():
        for name, t in list(net.named_parameters()) + list(net.named_buffers()):
            rec = saved.get(name)
            if not t.is_floating_point():
                continue
            target = torch.float32 if held == "float32" else (rec.dtype if rec is not None else t.dtype)
            if t.dtype != target:
                t.data = t.data.to(target)
            if rec is not None and rec.dtype in LOW_PRECISION and isinstance(t, torch.nn.Parameter) and t.requires_grad:
                low.append((name, t))
    return low


def state_in_float32(opt, params) -> None:
    """The optimizer's floating state of `params` in float32 (its step count as it is)."""
    for p in params:
        state = opt.state.get(p) or {}
        for k, v in list(state.items()):
            if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step":
                state[k] = v.float()
