"""`amp-postmortem record -- python train.py ARGS`: record a training script
without editing it.

`record` checks the command, then runs the script in a child process of
this same interpreter, `python -m recorders.attach CONFIG train.py ARGS`,
which attaches an `AmpRecorder` to the model, optimizer and GradScaler the
script builds and closes it when the script ends (`recorders/attach.py`; the
rule that picks them: `recorders/attach_choice.py`). The child's stdout and
stderr are the terminal's; its exit code is returned (128+N when a signal N
ended it). Ctrl-C reaches the script (its process group is ours) and this
process waits for it; SIGTERM and SIGHUP are passed on.

The only code run is the script (or module) named on the command line.
"""
from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from .errors import PostmortemError

USAGE = "amp-postmortem record [OPTIONS] -- python train.py [ARGS]"
# `python`, `python3`, `python3.11`, a path to one: the interpreter word of the command.
PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")
# Interpreter switches passed on to the child (the others change what runs or how modules are found).
FLAGS = {"-u", "-B", "-O", "-OO", "-E", "-s", "-q"}
FLAGS_WITH_VALUE = {"-W", "-X"}


class RecordError(PostmortemError):
    """A command `record` cannot run, or an option it cannot pass on."""


def record(command, *, run=None, mode: str | None = None, include=(), exclude=(), options=None,
           loss: str | None = None) -> int:
    """Run `command` (`["python", "train.py", ...]`, `["python", "-m",
    "pkg.train", ...]` or `["train.py", ...]`) with an `AmpRecorder`
    attached to what it builds, recording into `run` (default
    `runs/<script>-<YYYYmmdd-HHMMSS>`); its exit code. `mode`, `include`,
    `exclude` and `options` (`{keyword: value}`, Python literals) are
    `AmpRecorder`'s keywords; `mode` None leaves `$AMP_POSTMORTEM_MODE`,
    else "sentinel". `loss`: the loss the loop computes outside the model,
    `AmpRecorder`'s `loss_fn` (`loss_spec`), found when the recorder
    attaches (`recorders/attach.py`). A bad option is refused before the
    script runs (exit code 2, one `Error:` line from the child)."""
    flags, target = script_target(list(command))
    if loss is not None:
        loss_spec(loss)
    recorder_options = dict(options or {})
    for name, value in (("mode", mode), ("include", tuple(include)), ("exclude", tuple(exclude))):
        if value:
            recorder_options[name] = value
    config = json.dumps({"run": str(run if run is not None else default_run(target)),
                         "options": {k: literal(k, v) for k, v in recorder_options.items()},
                         **({"loss": loss} if loss is not None else {})})
    return run_child([sys.executable, *flags, "-m", "recorders.attach", config, *target])


_NAME = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*"
LOSS_SPEC = re.compile(rf"({_NAME}:)?{_NAME}$")


def loss_spec(text: str) -> tuple[str | None, str]:
    """`--loss`: (module or None, attribute path). `criterion` (or
    `losses.criterion`) names an object at the script's top level, looked up
    when the recorder attaches; `package.module:function` one of an
    importable module. The script's own names only: no file path (the
    script is already running, and importing it again would run it twice)."""
    if not LOSS_SPEC.match(text) or text.partition(":")[0].endswith(".py") and ":" in text:
        raise RecordError(f"--loss {text!r}: a name at the script's top level (criterion) or "
                          f"package.module:function")
    module, _, attr = text.rpartition(":")
    return module or None, attr


def script_target(command: list[str]) -> tuple[list[str], list[str]]:
    """(interpreter switches, `[script, *args]` or `["-m", module, *args]`)
    of a command, or a RecordError naming what is wrong."""
    if not command:
        raise RecordError(f"no command to record: {USAGE}")
    words = list(command)
    flags = []
    if PYTHON.match(os.path.basename(words[0])):
        words.pop(0)
        while words and words[0].startswith("-") and words[0] != "-m":
            flag = words.pop(0)
            if flag in FLAGS:
                flags.append(flag)
            elif flag[:2] in FLAGS_WITH_VALUE:
                flags.append(flag)
                if flag in FLAGS_WITH_VALUE:
                    if not words:
                        raise RecordError(f"python {flag} needs a value: {USAGE}")
                    flags.append(words.pop(0))
            else:
                raise RecordError(f"python {flag} is not supported: record runs a script or `-m module` "
                                  f"(switches {', '.join(sorted(FLAGS | FLAGS_WITH_VALUE))})")
        if not words:
            raise RecordError(f"no script after {command[0]}: {USAGE}")
    elif not words[0].endswith(".py"):
        raise RecordError(f"{words[0]!r} is not a Python script or interpreter: record runs Python "
                          f"training scripts: {USAGE}")
    if words[0] == "-m":
        if len(words) < 2:
            raise RecordError(f"python -m needs a module name: {USAGE}")
        return flags, words
    if not Path(words[0]).is_file():
        raise RecordError(f"script not found: {words[0]}")
    return flags, words


def default_run(target: list[str]) -> str:
    name = target[1].rsplit(".", 1)[-1] if target[0] == "-m" else Path(target[0]).stem
    return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def literal(key: str, value) -> str:
    """`value` as Python source the child reads back (`ast.literal_eval`)."""
    text = repr(value)
    try:
        if ast.literal_eval(text) == value:
            return text
    except (ValueError, SyntaxError):
        pass
    raise RecordError(f"recorder option {key}={value!r} is not a Python literal (a number, string, bool, None, "
                      f"or a list/tuple/dict of them): it cannot reach the script's process")


def parse_option(text: str) -> tuple[str, object]:
    """`KEY=VALUE` of `--option`: VALUE a Python literal (`16`, `False`,
    `['blocks.*']`), else the string itself."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise RecordError(f"--option {text!r} is not KEY=VALUE (e.g. --option window_steps=16)")
    try:
        return key.strip(), ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key.strip(), value


def run_child(argv: list[str]) -> int:
    """Runs `argv` to its end; its exit code (128+N for a signal N)."""
    in_main = _main_thread()
    if in_main:
        # A handler, not SIG_IGN: exec resets handlers, so the child gets
        # Ctrl-C as usual while this process only waits for it.
        previous_int = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        child = subprocess.Popen(argv)
    except BaseException:
        if in_main:
            signal.signal(signal.SIGINT, previous_int)
        raise
    forwarded = {}
    if in_main:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            forwarded[sig] = signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    try:
        code = child.wait()
    finally:
        if in_main:
            signal.signal(signal.SIGINT, previous_int)
            for sig, handler in forwarded.items():
                signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()
