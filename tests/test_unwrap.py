"""`recorders.unwrap`: the objects inside the wrappers frameworks put around
the user's. Here the scaler: a wrapper that holds a GradScaler (timm's
`NativeScaler` keeps it in `._scaler`, Accelerate and Lightning in
`.scaler`) is unwrapped at construction, anything else refused with a
warning; and a run whose manifest lost the scaler's settings never crashes
a command."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from amp_postmortem.cli import main
from amp_postmortem.reading.loader import load_run
from recorders import AmpRecorder
from recorders.unwrap import unwrap_scaler

from tiny_models import BoomNet

STEPS = 8
INIT_SCALE = 2.0 ** 8
OVERFLOW_STEPS = (3, 4)   # the gradient through `amp` is made Inf: skipped, the scale halves


class NativeScalerLike:
    """timm's `NativeScaler` as it is written (timm is no dependency): the
    GradScaler in `_scaler`, called with the loss and the optimizer."""
    state_dict_key = "amp_scaler"

    def __init__(self):
        self._scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=3)

    def __call__(self, loss, optimizer):
        self._scaler.scale(loss).backward()
        self._scaler.step(optimizer)
        self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()


def train_with(path: Path, pass_scaler) -> list[float]:
    """A tiny float16 job driven by a NativeScalerLike; `pass_scaler(wrapper)`
    is what AmpRecorder is given. Returns the scale after each step (truth
    from the GradScaler itself)."""
    torch.manual_seed(0)
    model = BoomNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    wrapper = NativeScalerLike()
    g = torch.Generator().manual_seed(1)
    scales = []
    # Its own loop: timm's, where the scaler wrapper runs the backward, the step and the update.
    with AmpRecorder(path, model, optimizer=opt, scaler=pass_scaler(wrapper), full_every=1) as rec:
        for step in range(STEPS):
            x, y = torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)
            model.amp.gain = float("inf") if step in OVERFLOW_STEPS else 1.0
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ((model(x).float() - y) ** 2).mean()
            wrapper(loss, opt)
            opt.zero_grad()
            rec.step(loss)
            scales.append(wrapper._scaler.get_scale())
        assert rec.enabled, rec.failure
    return scales


def _cli(*argv):
    return CliRunner().invoke(main, [str(a) for a in argv])


@pytest.fixture(scope="module")
def wrapped_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("scaler_wrappers")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # an understood wrapper warns of nothing
        truth = train_with(root / "wrapper", lambda w: w)
    inner = train_with(root / "inner", lambda w: w._scaler)
    assert truth == inner
    return root / "wrapper", root / "inner", truth


def test_a_native_scaler_wrapper_records_the_real_scale(wrapped_runs):
    wrapper, inner, truth = wrapped_runs
    got = load_run(wrapper).steps.sort_values("step")
    assert got["loss_scale"].tolist() == truth
    assert got["loss_scale"].tolist() == load_run(inner).steps.sort_values("step")["loss_scale"].tolist()
    assert got.loc[got["skipped"], "step"].tolist() == list(OVERFLOW_STEPS)
    manifest = json.loads((wrapper / "manifest.json").read_text())
    assert manifest["scaler"]["class"] == "torch.amp.grad_scaler.GradScaler"
    assert manifest["scaler"]["init_scale"] == INIT_SCALE


def test_scale_and_summary_read_a_wrapped_scaler(wrapped_runs):
    wrapper, _, truth = wrapped_runs
    res = _cli("scale", wrapper, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["status"] != "no_scaler" and doc["final_scale"] == truth[-1]
    assert doc["skipped_steps"] == len(OVERFLOW_STEPS) and doc["backoffs"] == len(OVERFLOW_STEPS)
    res = _cli("summary", wrapper)
    assert res.exit_code == 0, res.output
    assert f"scaler: init {INIT_SCALE:g}, growth x2 every 3 clean steps, backoff x0.5" in res.output


class _Holder:
    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def test_scaler_wrappers_are_unwrapped_or_refused():
    sc = torch.amp.GradScaler("cpu")
    assert unwrap_scaler(sc) == (sc, None)
    assert unwrap_scaler(None) == (None, None)
    assert unwrap_scaler(_Holder(scaler=sc)) == (sc, None)             # Accelerate, Lightning's plugin
    assert unwrap_scaler(_Holder(_scaler=sc)) == (sc, None)            # timm
    assert unwrap_scaler(_Holder(grad_scaler=_Holder(scaler=sc))) == (sc, None)
    assert unwrap_scaler(_Holder(scaler=None)) == (None, None)         # bfloat16: no scaler
    inner, why = unwrap_scaler(_Holder(loss_scale=1024.0))
    assert inner is None and "pass the GradScaler itself" in why and "_Holder" in why
    loop = _Holder()
    loop.scaler = loop
    assert unwrap_scaler(loop)[0] is None


def test_an_object_without_a_scaler_is_refused_with_a_warning(tmp_path):
    torch.manual_seed(0)
    model = BoomNet()
    with pytest.warns(RuntimeWarning, match=r"not a torch.amp.GradScaler .* pass the GradScaler itself"):
        rec = AmpRecorder(tmp_path / "run", model, scaler=_Holder(loss_scale=1024.0))
    try:
        assert rec.enabled and rec.scaler is None
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(2, 4)).float().mean()
        loss.backward()
        rec.step(loss)
    finally:
        rec.close()
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["scaler"] is None
    res = _cli("scale", tmp_path / "run")
    assert res.exit_code == 0 and "NO_SCALER" in res.output


# A scaler entry with fields missing or null (written by a recorder that
# took a scaler-like object at its word) is read as far as it goes.
DAMAGED = {
    "null_fields": lambda s: s.update(init_scale=None, growth_factor=None, backoff_factor=None,
                                      growth_interval=None),
    "missing_fields": lambda s: [s.pop(k) for k in ("init_scale", "growth_factor", "backoff_factor",
                                                    "growth_interval")],
    "some_null": lambda s: s.update(init_scale=None, growth_interval=None),
    "wrapper_class": lambda s: s.update({"class": "timm.utils.cuda.NativeScaler", "init_scale": None,
                                         "growth_factor": None, "backoff_factor": None,
                                         "growth_interval": None}),
}
COMMANDS = [["summary"], ["scale"], ["nans"], ["ranges"], ["scale-window"], ["recommend"], ["summary", "--json"],
            ["scale", "--json"], ["recommend", "--json"], ["scale-window", "--json"]]


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_scaler_entry_with_missing_fields_never_crashes_a_command(wrapped_runs, tmp_path, damage):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(wrapped_runs[0], run)
    for manifest in (run / "manifest.json", run / "rank=0" / "manifest.json"):
        doc = json.loads(manifest.read_text())
        DAMAGED[damage](doc["scaler"])
        manifest.write_text(json.dumps(doc))
    for argv in COMMANDS + [["report", "-o", tmp_path / "r.html"]]:
        res = _cli(argv[0], run, *argv[1:])
        assert "Traceback" not in res.output and "internal error" not in res.output, (argv, res.output)
        assert res.exit_code in (0, 2), (argv, res.output)
        if res.exit_code == 2:
            assert len(res.output.strip().splitlines()) == 1, (argv, res.output)
    res = _cli("summary", run)
    assert res.exit_code == 0 and "scaler: " in res.output and "None" not in res.output


def test_a_scaler_entry_of_the_wrong_type_is_one_line(wrapped_runs, tmp_path):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(wrapped_runs[0], run)
    doc = json.loads((run / "manifest.json").read_text())
    doc["scaler"]["init_scale"] = "big"
    (run / "manifest.json").write_text(json.dumps(doc))
    res = _cli("summary", run)
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    assert "manifest.json" in res.output and "scaler.init_scale" in res.output
