"""Issue 38, item 1: a loop that computes its loss outside the model
(`loss = criterion(model(x), y)`) gets its float32 re-run. A real script
(`outside_loss_train.py`: a harmless scaler skip at step 15, the real
float16 failure at step 30) is recorded with one argument,
`AmpRecorder(..., loss_fn=criterion)`, then analysed through the CLI as a
user would. The story is pinned, not values that move with CPU kernels."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from amp_postmortem.cli import main

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "outside_loss_train.py"
sys.path.insert(0, str(HERE))
import outside_loss_train as job  # noqa: E402

MODEL = f"{SCRIPT}:make_model"
LOSS = f"{SCRIPT}:criterion"


def _record(path: Path, *extra) -> Path:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(SCRIPT), str(path), *extra], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return path


@functools.lru_cache(maxsize=None)
def _run(variant: str = "module") -> Path:
    import tempfile
    root = Path(tempfile.mkdtemp(prefix="outside-loss-"))
    return _record(root / "run", *(["--function"] if variant == "function" else []))


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_the_window_opens_on_the_failure_not_on_the_harmless_skip():
    run = _run()
    windows = sorted((run / "windows").glob("step=*/rank=0/window.json"))
    assert len(windows) == 1
    meta = json.loads(windows[0].read_text())
    assert meta["trigger_step"] == job.FAULT_STEP                     # the skip at 15 opened none
    assert meta["first_step"] <= job.FAULT_STEP <= meta["last_step"]
    assert set(meta["reasons"]) <= {"nonfinite_loss", "nonfinite_tensor"}
    assert meta["loss"]["name"] == "torch.nn.modules.loss.MSELoss" and meta["loss"]["kept"] > 0
    # the skip was there, settled, a bundle trigger: it could have spent the window
    from amp_postmortem.reading.loader import load_run
    steps = load_run(run).steps.set_index("step")
    assert bool(steps.loc[job.SKIP_STEP, "skipped"]) and not bool(steps.loc[job.SKIP_STEP - 1, "skipped"])


def test_summary_says_the_exact_rerun_command_with_loss_never_record_again():
    out = cli("summary", _run())
    assert out.exit_code == 0, out.output
    assert "no window of steps was saved" not in out.output
    assert "recording again" not in out.output
    assert "amp-postmortem rerun" in out.output and "--loss FILE.py:NAME" in out.output and "MSELoss" in out.output


def test_rerun_without_loss_says_to_name_it_and_with_it_float32_carries_the_window():
    run = _run()
    missing = cli("rerun", run, "--precision", "fp32", "--model", MODEL)
    assert missing.exit_code == 2 and "--loss" in missing.output and "MSELoss" in missing.output
    fp32 = json.loads(cli("rerun", run, "--precision", "fp32", "--model", MODEL, "--loss", LOSS, "--json").output)
    assert fp32["stays_finite"] and fp32["first_nonfinite_step"] is None
    as_recorded = json.loads(cli("rerun", run, "--model", MODEL, "--loss", LOSS, "--json").output)
    assert as_recorded["precision"] == "fp16" and as_recorded["first_nonfinite_step"] == job.FAULT_STEP
    # Before the failure the re-run with the user's loss is the recorded run.
    for s in as_recorded["steps"]:
        if s["step"] < job.FAULT_STEP:
            assert s["finite"] and s["loss"] == pytest.approx(s["recorded_loss"], rel=1e-3)


def test_summary_with_model_and_loss_decides_precision():
    out = cli("summary", _run(), "--model", MODEL, "--loss", LOSS, "--json")
    assert out.exit_code == 0, out.output
    verdict = json.loads(out.output)["precision_verdict"]
    assert verdict["verdict"] == "precision" and verdict["basis"] == "fp32_rerun_finite"
    assert verdict["failure_step"] == job.FAULT_STEP


def test_a_top_level_loss_function_is_seen_too():
    run = _run("function")
    meta = json.loads(next((run / "windows").glob("step=*/rank=0/window.json")).read_text())
    assert meta["loss"]["name"].endswith(".loss_fn") and meta["loss"]["seen_as"] == "function"
    r = cli("rerun", run, "--precision", "fp32", "--model", MODEL, "--loss", f"{SCRIPT}:loss_fn", "--json")
    assert json.loads(r.output)["stays_finite"]


def test_loss_fn_alone_turns_the_window_on_and_a_hidden_callable_is_refused():
    from recorders import BundlePolicy
    from recorders.errors import OptionError
    from recorders.options import parts_from_flat
    parts = parts_from_flat({"loss_fn": job.criterion})
    assert parts.bundle_policy.window_steps == 16 and parts.bundle_policy.loss_fn is job.criterion
    assert BundlePolicy(loss_fn=job.criterion, window_steps=4).window_steps == 4
    assert BundlePolicy().window_steps == 0
    assert parts.bundle_policy.config(enabled=True, snapshot_params=False)["loss_fn"] == \
        "torch.nn.modules.loss.MSELoss"
    with pytest.raises(OptionError, match="cannot be seen"):
        BundlePolicy(loss_fn=lambda p, t: (p - t).pow(2).mean())


def test_window_events_a_skip_alone_opens_none_a_collapse_and_the_first_failure_do():
    from recorders.bundles.triggers import COLLAPSE_SKIPS, BundleTriggers
    t = BundleTriggers(has_scaler=True, settle_steps=2)
    t.watch_window = True
    step = 0

    def feed(**summary):
        nonlocal step
        t.decide(dict({"step": step, "loss": 1.0, "loss_scale": 1024.0, "loss_scale_before": 1024.0,
                       "skipped": False}, **summary))
        step += 1

    for _ in range(3):
        feed()
    feed(skipped=True)                      # one isolated skip, settled: a bundle trigger, no window
    feed()
    assert t.take_window_events() == {}
    for _ in range(COLLAPSE_SKIPS):
        feed(skipped=True)
    assert list(t.take_window_events().values()) == [["scale_collapse"]]
    feed(loss=float("nan"))
    assert list(t.take_window_events().values()) == [["nonfinite_loss"]]
    feed(loss=float("nan"))                 # its consequences open no more
    for _ in range(COLLAPSE_SKIPS):
        feed(skipped=True)
    assert t.take_window_events() == {}
    t.decide({"step": step, "loss": 1.0, "skipped": False}, ["request"])
    assert t.take_window_events() == {step: ["request"]}


def _requested_windows(path, *, requests, max_window_bytes=1 << 30):
    """The job in process, `save_bundle()` at the steps `requests`; the
    writer kept up (flush) so that windows restart on time."""
    import torch

    from recorders import AmpRecorder
    from tiny_models import train
    model = job.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = AmpRecorder(path, model, optimizer=opt, loss_fn=job.criterion, window_steps=3,
                      max_window_bytes=max_window_bytes)

    def loss(model, x, y, step, accumulate):
        return job.criterion(model(x if step != job.FAULT_STEP else x / 1e6), y)

    train(model, [job.batch(step) for step in range(24)], recorder=lambda m, o, s: rec, optimizer=opt, dtype=None,
          scaler=None, on_step=lambda step, model, x: rec.save_bundle() if step in requests else None, loss_fn=loss,
          after_step=lambda step, rec: rec.flush())
    return sorted(json.loads(p.read_text())["trigger_step"] for p in (path / "windows").glob("*/*/window.json"))


def test_more_than_one_window_within_the_byte_budget(tmp_path):
    assert _requested_windows(tmp_path / "a", requests=(5, 16)) == [5, 16]
    # A budget that one window fills (its weights and about six steps of
    # inputs and targets): the second is not kept.
    state = sum(p.numel() * p.element_size() for p in job.make_model().parameters())
    x, y = job.batch(0)
    per_step = (x.numel() + y.numel()) * 4
    assert _requested_windows(tmp_path / "b", requests=(5, 16), max_window_bytes=state + 7 * per_step) == [5]


def test_targets_that_are_model_inputs_are_saved_once_and_kwargs_are_kept(tmp_path):
    """`criterion(model(x, y), y, reduction=...)`-like calls: a target that
    is also a model input is the input's row; keywords come back."""
    import torch
    from torch import nn

    from amp_postmortem.reading.window import PREDICTION_KEY, find_window
    from recorders import AmpRecorder
    from tiny_models import train

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x, y):
            return self.fc(x)

    def weighted(pred, target, *, weight):
        return ((pred - target) ** 2 * weight).mean()

    model = TwoInputs()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = nn.Module()
    crit.forward = lambda pred, target, weight: weighted(pred, target, weight=weight)
    rec = AmpRecorder(tmp_path / "r", model, optimizer=opt, loss_fn=crit, window_steps=2)
    train(model, [job.batch(step) for step in range(4)], recorder=lambda m, o, s: rec, optimizer=opt, dtype=None,
          scaler=None, on_step=lambda step, model, x: rec.save_bundle() if step == 2 else None,
          loss_fn=lambda model, x, y, step, accumulate: crit(model(x, y), y, weight=torch.full((8, 1), 2.0)),
          after_step=lambda step, rec: rec.flush())
    w = find_window(tmp_path / "r")
    (args, _), = w.steps[-1].inputs
    call = w.steps[-1].losses[0]
    pred, target = call["args"][:2]
    assert pred[PREDICTION_KEY] == 0 and pred["shape"] == [8, 1]
    assert torch.equal(target, args[1]) and torch.equal(call["kwargs"]["weight"], torch.full((8, 1), 2.0))
    names = json.loads((Path(w.path) / "window.json").read_text())["steps"][-1]["micro_batches"][0]["loss"]
    assert names["args"]["items"][1] == {"kind": "tensor", "name": "args.1"}  # the model input's row


# ---- fix, scale-window and recommend check their remedy over the window with --loss
# (issue 38, item 1: summary's advice never sends the user in a circle: the
# commands that re-run the window to verify an answer take --loss, and say
# how to add it when it is missing).
FAIL = ["--step", job.FAULT_STEP, "--model", MODEL]


def _window_check(out) -> dict:
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


def _says_how_to_add_loss(text: str, command: str) -> None:
    assert "MSELoss" in text
    assert f"add --loss FILE.py:NAME to `amp-postmortem {command}`" in text


@pytest.mark.parametrize("command, extra", [("fix", []), ("scale-window", ["--keep-fp32", "fc1"])])
def test_fix_and_scale_window_verify_over_the_window_with_loss_and_say_how_to_add_it_without(command, extra):
    run = _run()
    without = _window_check(cli(command, run, *FAIL, *extra, "--json"))
    check = (without if command == "fix" else without["replay"])["window_check"]
    assert check["status"] == "not_run" and check["window"][0] <= job.FAULT_STEP <= check["window"][1]
    _says_how_to_add_loss(check["why"], command)
    text = cli(command, run, *FAIL, *extra).output
    assert "verified on the saved step only" in text and "could not be re-run" in text
    _says_how_to_add_loss(text, command)          # the words the user reads, naming this very command
    with_loss = _window_check(cli(command, run, *FAIL, *extra, "--loss", LOSS, "--json"))
    check = (with_loss if command == "fix" else with_loss["replay"])["window_check"]
    assert check["status"] == "verified" and check["verified"] and check["why"] is None
    assert "verified over the saved window" in cli(command, run, *FAIL, *extra, "--loss", LOSS).output


def test_scale_window_verifies_the_init_scale_it_prints():
    out = _window_check(cli("scale-window", _run(), *FAIL, "--keep-fp32", "fc1", "--loss", LOSS, "--json"))
    replay = out["replay"]
    assert replay["window_check"]["remedy"] == f"init_scale={replay['settings']['init_scale']:g}"


def _recommend_checks(doc) -> list:
    """The window checks `recommend` made (its remedies' `data.window_check`)."""
    return [r["data"]["window_check"] for r in doc["recommendations"] if (r.get("data") or {}).get("window_check")]


def test_recommend_with_loss_verifies_its_remedies_and_decides_precision_and_says_how_without():
    run = _run()
    without = _window_check(cli("recommend", run, "--model", MODEL, "--json"))
    checks = _recommend_checks(without)
    assert checks and all(c["status"] == "not_run" for c in checks)
    for c in checks:
        _says_how_to_add_loss(c["why"], "recommend")
    text = cli("recommend", run, "--model", MODEL).output
    assert "add --loss FILE.py:NAME to `amp-postmortem recommend`" in text
    assert "--loss FILE.py:NAME to `amp-postmortem rerun`" not in text  # never a command it did not run

    with_loss = _window_check(cli("recommend", run, "--model", MODEL, "--loss", LOSS, "--json"))
    recs = {r["kind"]: r for r in with_loss["recommendations"]}
    assert "training_instability" not in recs          # the float32 re-run with the loss says precision
    assert recs["keep_fp32"]["verified"] and recs["keep_fp32"]["data"]["window_check"]["status"] == "verified"
    checks = _recommend_checks(with_loss)
    assert checks and all(c["status"] == "verified" for c in checks)
    assert "could not be re-run" not in cli("recommend", run, "--model", MODEL, "--loss", LOSS).output


def test_a_wrong_loss_spec_is_said_at_once_as_for_rerun(tmp_path):
    for command in (["fix", _run(), *FAIL], ["scale-window", _run(), *FAIL], ["recommend", _run(), "--model", MODEL],
                    ["rerun", _run(), "--model", MODEL]):
        out = cli(*command, "--loss", tmp_path / "absent.py:criterion")
        assert out.exit_code == 2 and "does not exist" in out.output, (command, out.output)


def test_the_loss_option_is_one_option_on_every_command_that_re_runs_the_window():
    from amp_postmortem.cli.whatif import LOSS_HELP
    for name in ("fix", "scale-window", "recommend", "rerun"):
        option = next(p for p in main.commands[name].params if p.name == "loss")
        assert option.help == LOSS_HELP and option.metavar == "FILE.py:NAME"
