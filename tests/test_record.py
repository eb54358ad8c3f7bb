"""`amp-postmortem record -- python train.py ARGS` as a user meets it: real
scripts written here, run in real subprocesses through the command (and
through `python -m amp_postmortem`), the runs they leave read back; the
attach rule (`recorders/attach_choice.py`) on live objects."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import amp_postmortem as api
from recorders.attach_choice import AttachRefused, choose_training_objects

REPO = Path(__file__).resolve().parents[1]
PREFIX = "amp-postmortem record: "

# The scripts keep their own loops: `record` runs a user's script as it is written.
FP16_LOOP = """
import sys
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
bad_step = int(sys.argv[1])
for step in range(8):
    x = torch.randn(4, 8)
    if step == bad_step:
        x[0, 0] = float("inf")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = (model(x).float() ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
print("trained", step + 1, "steps")
"""

BF16_LOOP = """
import sys
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(6):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("argv", sys.argv[1:])
"""

EXITS_3 = """
import sys
import torch

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    model(torch.randn(2, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print("to stdout")
print("to stderr", file=sys.stderr)
sys.exit(3)
"""

TWO_OPTIMIZERS = """
import torch

gen, disc = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
opt_g = torch.optim.Adam(gen.parameters())
opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
for step in range(2):
    disc(gen(torch.randn(2, 4))).mean().backward()
    opt_g.step()
    opt_d.step()
print("gan done")
"""

HF_TRAINER = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                   bos_token_id=0, eos_token_id=0))
data = [{"input_ids": torch.randint(0, 32, (8,)), "labels": torch.randint(0, 32, (8,))} for _ in range(8)]
args = TrainingArguments("out", max_steps=3, per_device_train_batch_size=2, bf16=True, use_cpu=True,
                         report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=data).train()
print("trained")
"""

LIGHTNING = """
import torch
import lightning.pytorch as L

torch.manual_seed(0)


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
trainer = L.Trainer(max_steps=3, precision="bf16-mixed", accelerator="cpu", logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=4))
print("fitted")
"""


# The loss outside the model (`loss = criterion(model(x), y)`), a forward
# that float16 cannot hold at step 6 (inputs 1e6x): the failure a window
# re-runs in float32.
OUTSIDE_LOSS = """
import sys
import torch
from torch import nn

criterion = nn.MSELoss()


def mse(pred, target):
    return nn.functional.mse_loss(pred, target)


def main(loss):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for step in range(10):
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        if step == 6:
            x = x * 1e6
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
            value = criterion(out, y) if loss == "criterion" else mse(out, y)
        scaler.scale(value).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    print("trained")


main(sys.argv[1])
"""


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("AMP_POSTMORTEM_MODE", None)
    return env


def record(tmp_path, script: str, *args: str, record_options=(), via_module=False):
    """Writes `script` to tmp_path/train.py and records it: (exit code, stdout, stderr)."""
    (tmp_path / "train.py").write_text(textwrap.dedent(script))
    entry = Path(sys.executable).with_name("amp-postmortem")
    command = ([sys.executable, "-m", "amp_postmortem"] if via_module or not entry.exists() else [str(entry)])
    out = subprocess.run([*command, "record", *record_options, "--", "python", "train.py", *args],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    return out.returncode, out.stdout, out.stderr


def said(stderr: str) -> list[str]:
    return [line[len(PREFIX):] for line in stderr.splitlines() if line.startswith(PREFIX)]


def test_fp16_loop_with_a_planted_inf_names_its_step(tmp_path):
    run = tmp_path / "run"
    code, stdout, stderr = record(tmp_path, FP16_LOOP, "5", record_options=("--run", str(run), "--mode",
                                                                              "every_step"))
    assert (code, stdout) == (0, "trained 8 steps\n"), stderr
    assert said(stderr) == [f"recording {run}: model Sequential, optimizer SGD (4 parameter tensors), scaler "
                            f"GradScaler; a step closes after each scaler.update(); mode every_step"]
    nans = subprocess.run([sys.executable, "-m", "amp_postmortem", "nans", str(run), "--json"],
                          capture_output=True, text=True, env=_env(), check=True)
    doc = json.loads(nans.stdout)
    assert (doc["first_nonfinite_step"], doc["skipped_steps"], doc["origin"]["name"]) == (5, 1, "<input>")
    facts = api.summary(run).to_dict()["run"]
    assert (facts["status"], facts["steps"], facts["first_step"], facts["last_step"]) == ("closed", 8, 0, 7)
    assert facts["scaler"] is not None and facts["dtype"] == "float16"


def test_bf16_loop_without_scaler_through_python_m_into_the_default_run(tmp_path):
    code, stdout, stderr = record(tmp_path, BF16_LOOP, "--lr", "3", via_module=True)
    assert (code, stdout) == (0, "argv ['--lr', '3']\n"), stderr
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.startswith("train-")
    assert said(stderr) == [f"recording {Path('runs') / run.name}: model Sequential, optimizer AdamW (4 parameter "
                            f"tensors), scaler none; a step closes after each optimizer.step(); mode sentinel"]
    facts = api.summary(run).to_dict()["run"]
    assert (facts["status"], facts["steps"], facts["scale_status"], facts["dtype"]) == \
        ("closed", 6, "no_scaler", "bfloat16")


def test_the_scripts_exit_code_and_output_are_kept_and_the_run_closed(tmp_path):
    code, stdout, stderr = record(tmp_path, EXITS_3, record_options=("--run", "r"))
    assert (code, stdout) == (3, "to stdout\n")
    assert "to stderr\n" in stderr and len(said(stderr)) == 1
    facts = api.summary(tmp_path / "r").to_dict()["run"]
    assert (facts["status"], facts["steps"]) == ("closed", 3)


def test_two_optimizers_are_refused_and_the_script_runs_unrecorded(tmp_path):
    code, stdout, stderr = record(tmp_path, TWO_OPTIMIZERS, record_options=("--run", "r"))
    assert (code, stdout) == (0, "gan done\n")
    assert said(stderr) == ["not recording: 2 optimizers (Adam, SGD): cannot tell which one trains; the script "
                            "runs unrecorded (attach AmpRecorder in the script: docs/RECORDER.md \"Attach the "
                            "recorder to your training loop\")"]
    assert not (tmp_path / "r").exists()


def test_hugging_face_trainer(tmp_path):
    code, stdout, stderr = record(tmp_path, HF_TRAINER, record_options=("--run", "r"))
    assert code == 0 and stdout.endswith("trained\n"), stderr
    assert said(stderr) == ["recording r: model GPT2LMHeadModel, optimizer AdamW (16 parameter tensors), scaler "
                            "none; a step closes at the Trainer's on_optimizer_step; mode sentinel"]
    facts = api.summary(tmp_path / "r").to_dict()["run"]
    assert (facts["status"], facts["steps"], facts["last_step"], facts["dtype"]) == ("closed", 3, 2, "bfloat16")


def test_lightning_trainer(tmp_path):
    code, stdout, stderr = record(tmp_path, LIGHTNING, record_options=("--run", "r", "--option", "full_every=1"))
    assert code == 0 and stdout.endswith("fitted\n"), stderr
    assert said(stderr) == ["recording r: model Regression, optimizer SGD (4 parameter tensors), scaler none; a "
                            "step closes at on_train_batch_end once the global step moved; mode sentinel"]
    facts = api.summary(tmp_path / "r").to_dict()["run"]
    assert (facts["status"], facts["steps"], facts["model_class"]) == ("closed", 3, "__main__.Regression")


@pytest.mark.parametrize("spec, loop, name, seen", [
    ("criterion", "criterion", "torch.nn.modules.loss.MSELoss", "the module MSELoss"),
    ("mse", "function", "__main__.mse", "the function mse"),
])
def test_a_loss_outside_the_model_is_named_on_the_command_line(tmp_path, spec, loop, name, seen):
    """`record --loss NAME`: the script's own loss, found at its top level
    when the recorder attaches, is the recorder's `loss_fn` (no edit to the
    script): the failure's window keeps the loss calls, so the float32
    re-run has its loss."""
    code, stdout, stderr = record(tmp_path, OUTSIDE_LOSS, loop,
                                  record_options=("--run", "r", "--loss", spec, "--mode", "every_step"))
    assert (code, stdout) == (0, "trained\n"), stderr
    lines = said(stderr)
    assert lines[0] == f"loss {spec}: {seen}, kept in a window of steps (loss_fn)", lines
    assert lines[1].startswith("recording r: model Sequential")
    (window,) = (tmp_path / "r" / "windows").glob("step=*/rank=0/window.json")
    meta = json.loads(window.read_text())
    assert meta["trigger_step"] == 6 and meta["loss"]["name"] == name and meta["loss"]["kept"] > 0


def test_a_loss_it_cannot_find_is_one_line_and_the_script_is_recorded_without_it(tmp_path):
    code, stdout, stderr = record(tmp_path, OUTSIDE_LOSS, "criterion", record_options=("--run", "r", "--loss",
                                                                                       "criterion.typo"))
    assert (code, stdout) == (0, "trained\n"), stderr
    lines = said(stderr)
    assert lines[0] == ("--loss criterion.typo: no criterion.typo in the script's top level when the recorder "
                        "attached (a function's local cannot be named); recording without the loss window (name "
                        "the loss at the script's top level, or pass loss_fn to AmpRecorder in the script)")
    assert lines[1].startswith("recording r: ") and not (tmp_path / "r" / "windows").exists()


@pytest.mark.parametrize("record_options, command, error", [
    ((), ("python", "missing.py"), "Error: script not found: missing.py"),
    ((), ("torchrun", "train.py"), "Error: 'torchrun' is not a Python script or interpreter: record runs Python "
                                   "training scripts: amp-postmortem record [OPTIONS] -- python train.py [ARGS]"),
    ((), ("python", "-c", "print(1)"), "Error: python -c is not supported: record runs a script or `-m module` "
                                       "(switches -B, -E, -O, -OO, -W, -X, -q, -s, -u)"),
    (("--option", "window_steps"), ("python", "train.py"),
     "Error: --option 'window_steps' is not KEY=VALUE (e.g. --option window_steps=16)"),
    (("--loss", "train.py:criterion"), ("python", "train.py"),
     "Error: --loss 'train.py:criterion': a name at the script's top level (criterion) or "
     "package.module:function"),
])
def test_a_command_it_cannot_run_is_one_error_line_and_exit_2(tmp_path, record_options, command, error):
    (tmp_path / "train.py").write_text("print('ran')\n")
    out = subprocess.run([sys.executable, "-m", "amp_postmortem", "record", *record_options, "--", *command],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", error + "\n")


@pytest.mark.parametrize("record_options, mode_env, error", [
    (("--option", "colour=1"), None, "bad recorder option: AmpRecorder() got an unexpected keyword argument 'colour'"),
    ((), "fast", "bad recorder option: mode='fast': give one of 'sentinel', 'every_step'"),
])
def test_a_bad_recorder_option_stops_before_the_script_runs(tmp_path, record_options, mode_env, error):
    (tmp_path / "train.py").write_text("print('ran')\n")
    env = dict(_env(), **({"AMP_POSTMORTEM_MODE": mode_env} if mode_env else {}))
    out = subprocess.run([sys.executable, "-m", "amp_postmortem", "record", *record_options, "--", "python",
                          "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", f"Error: {error}\n")


# ----------------------------------------------------------- the rule
def test_the_model_is_the_outermost_module_holding_the_optimizers_parameters():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    wrapper = torch.nn.ModuleDict({"net": net})
    other = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler_off = torch.amp.GradScaler("cpu", enabled=False)
    chosen = choose_training_objects([opt], [scaler_off], [net[0], net, wrapper, other])
    assert (chosen.model, chosen.optimizer, chosen.scaler) == (wrapper, opt, None)
    assert chosen.describe() == "model ModuleDict, optimizer SGD (4 parameter tensors), scaler none"


@pytest.mark.parametrize("case, reason", [
    ("two_models", "no one module holds all 4 parameter tensors the optimizer SGD updates (parameters of several "
                   "models)"),
    ("two_wrappers", "2 separate modules (ModuleDict, ModuleList) each hold all the optimizer's parameters: cannot "
                     "tell which one is the model"),
    ("two_scalers", "2 enabled GradScalers: cannot tell which one scales the loss"),
    ("no_optimizer", "0 optimizers (): cannot tell which one trains"),
])
def test_what_cannot_be_told_apart_is_refused(case, reason):
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    modules, scalers = [a, b], []
    optimizers = [torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)]
    if case == "two_wrappers":
        optimizers = [torch.optim.SGD(a.parameters(), lr=0.1)]
        modules += [torch.nn.ModuleDict({"a": a}), torch.nn.ModuleList([a])]
    if case == "two_scalers":
        optimizers = [torch.optim.SGD(a.parameters(), lr=0.1)]
        scalers = [torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")]
    if case == "no_optimizer":
        optimizers = []
    with pytest.raises(AttachRefused) as refused:
        choose_training_objects(optimizers, scalers, modules)
    assert str(refused.value) == reason
