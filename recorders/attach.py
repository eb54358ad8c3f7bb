"""Record a training script that was not edited for it: the process side of
`amp-postmortem record -- python train.py ARGS` (`amp_postmortem/record_script.py`
starts `python -m recorders.attach CONFIG train.py ARGS`).

`main` checks the recorder options (a bad one: one `Error:` line, exit 2,
before the script runs), installs a `ScriptRecording`, runs the script as
`__main__` (`sys.argv` and `sys.path[0]` as `python train.py ARGS` sets
them; `-m module` as `python -m module` does) and closes every recorder it
started when the script ends, however it ends (return, exception,
`sys.exit`, SIGTERM); the script's exit code, stdout and stderr are its own.

How the objects are found:
- a plain loop: `torch.optim.Optimizer.__init__` notes every optimizer; at
  the first module call after one was built, `attach_choice` picks the
  model, optimizer and scaler from the live objects, and the recorder is
  attached before that call runs. A step is closed (`rec.step()`) after
  each `scaler.update()` with a scaler (a skipped step never reaches
  `optimizer.step()`), else after each `optimizer.step()`.
- a Hugging Face or Lightning `Trainer` (`integrations/script_trainers.py`):
  the Trainer's constructor adds the framework's callback; the plain-loop
  search is then off.
One line on stderr says what was attached, or why nothing was.

`record --loss NAME` (a loop whose loss is computed outside the model):
the object NAME at the script's top level (or `package.module:function`)
when the recorder is built is its `loss_fn` (`recorder_options`); one more
line says what was found, or why the run has no loss window.
"""
from __future__ import annotations

import ast
import functools
import gc
import importlib.abc
import importlib.util
import json
import os
import runpy
import signal
import sys
import tempfile
import warnings
import weakref

import torch

from .attach_choice import AttachRefused, choose_training_objects
from .recorder import MODE_ENV, AmpRecorder

PREFIX = "amp-postmortem record: "
# AmpRecorder's arguments that `record` fills itself: not options.
ATTACHED = ("run_dir", "model", "optimizer", "scaler")
HOW_TO_ATTACH = 'attach AmpRecorder in the script: docs/RECORDER.md "Attach the recorder to your training loop"'


def say(text: str) -> None:
    print(PREFIX + text, file=sys.stderr, flush=True)


class ScriptRecording:
    """What `record` installs in the script's process (constructor and
    import patches, the step wrapper) and the recorders it starts; `close()`
    closes the recorders and undoes the rest."""

    def __init__(self, run_dir, options: dict, *, report=say, loss: str | None = None):
        self.run_dir = str(run_dir)
        self.options = dict(options)
        self.report = report
        self.loss = loss  # `record --loss`: found when the recorder attaches (`recorder_options`)
        self.recorders: list[AmpRecorder] = []
        self.framework: str | None = None  # the Trainer that owns the loop, once one is built
        self.outcome: str | None = None    # "recording" or "refused", once decided
        self._optimizers = weakref.WeakSet()
        self._built_optimizer = False
        self._closed = False
        self._armed = False
        self._undo: list = []

    # ------------------------------------------------------------ install
    def install(self) -> None:
        from .integrations.script_trainers import trainer_patches
        self._patch(torch.optim.Optimizer, "__init__", self._noting_optimizers)
        patches = trainer_patches(self)
        for name in [n for n in patches if n in sys.modules]:  # already imported: patch it now
            patches.pop(name)(sys.modules[name])
        finder = PatchOnImport(patches)
        sys.meta_path.insert(0, finder)
        self._undo.append(lambda: sys.meta_path.remove(finder))

    def _patch(self, owner, name: str, wrap) -> None:
        original = owner.__dict__[name]
        setattr(owner, name, wrap(original))
        self._undo.append(lambda: setattr(owner, name, original))

    def _noting_optimizers(self, original):
        @functools.wraps(original)
        def init(optimizer, *args, **kwargs):
            original(optimizer, *args, **kwargs)
            if self.framework is None and self.outcome is None:
                self._built_optimizer = True
                self._optimizers.add(optimizer)
                self._arm()
        return init

    def _arm(self) -> None:
        """The next module call, whichever, decides and attaches before it
        runs: the recorder's hooks then see the model's first forward whole
        (a forward pre-hook registered inside a call is not called for it)."""
        if self._armed:
            return
        module = torch.nn.Module
        original = module.__dict__["__call__"]

        def call(mod, *args, **kwargs):
            self._disarm()
            self._attach_plain_loop()
            return original(mod, *args, **kwargs)

        module.__call__ = call
        self._armed = True
        self._disarm = functools.partial(self._restore_call, original)
        self._undo.append(self._disarm)

    def _restore_call(self, original) -> None:
        if self._armed:
            torch.nn.Module.__call__ = original
            self._armed = False

    # ------------------------------------------------------- plain loops
    def _attach_plain_loop(self) -> None:
        if self.framework is not None or self.outcome is not None:
            return
        try:
            objects = self._choose()
            recorder = AmpRecorder(self.run_dir, objects.model, optimizer=objects.optimizer,
                                   scaler=objects.scaler, **self.recorder_options())
        except AttachRefused as exc:
            self.refuse(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - the script must run on
            self.refuse(f"attaching failed: {type(exc).__name__}: {exc}")
            return
        where = self._close_steps(recorder, objects)
        self.started(recorder, objects.describe(), where)

    def recorder_options(self) -> dict:
        """The recorder's keywords: the options, and `loss_fn` when `--loss`
        names an object that exists now (one line says what was found, or
        why the run records no loss window)."""
        if self.loss is None or "loss_fn" in self.options:
            return self.options
        fn, why = find_loss(self.loss)
        if fn is None:
            self.report(f"--loss {self.loss}: {why}; recording without the loss window (name the loss at "
                        f"the script's top level, or pass loss_fn to AmpRecorder in the script)")
            return self.options
        self.report(f"loss {self.loss}: {describe_loss(fn)}, kept in a window of steps (loss_fn)")
        return dict(self.options, loss_fn=fn)

    def _choose(self):
        # Collected first: a model or optimizer that is garbage in a
        # reference cycle must not count as a second one.
        gc.collect()
        modules, scalers = [], []
        for obj in gc.get_objects():
            kind = type(obj)  # not isinstance: it reads `__class__`, which a lazy proxy may compute
            if issubclass(kind, torch.nn.Module):
                modules.append(obj)
            elif issubclass(kind, torch.amp.GradScaler):
                scalers.append(obj)
        return choose_training_objects(list(self._optimizers), scalers, modules)

    def _close_steps(self, recorder, objects) -> str:
        """Calls `recorder.step()` once per optimizer step; says where."""
        if objects.scaler is not None:
            scaler = objects.scaler
            own = scaler.__dict__.get("update")
            update = scaler.update

            @functools.wraps(update)
            def update_then_step(*args, **kwargs):
                result = update(*args, **kwargs)
                recorder.step()
                return result

            scaler.update = update_then_step
            self._undo.append(lambda: setattr(scaler, "update", own) if own is not None
                              else scaler.__dict__.pop("update", None))
            return "after each scaler.update()"
        handle = objects.optimizer.register_step_post_hook(lambda *_: recorder.step())
        self._undo.append(handle.remove)
        return "after each optimizer.step()"

    # ---------------------------------------------------------- outcomes
    def claim_framework(self, name: str) -> bool:
        """A framework's Trainer was built: it owns the loop (the plain-loop
        search is off). False when a plain loop is already recorded."""
        if self.outcome == "recording" and self.framework is None:
            return False
        self.framework = name
        if self._armed:
            self._disarm()
        return True

    def started(self, recorder, description: str, where: str) -> None:
        self.recorders.append(recorder)
        self.outcome = "recording"
        if not recorder.enabled:
            self.report("not recording: the recorder could not start (its warning says why); "
                        "the script runs unrecorded")
            return
        mode = self.options.get("mode") or os.environ.get(MODE_ENV) or "sentinel"
        self.report(f"recording {self.run_dir}: {description}; a step closes {where}; mode {mode}")

    def refuse(self, reason: str) -> None:
        self.outcome = "refused"
        self.report(f"not recording: {reason}; the script runs unrecorded ({HOW_TO_ATTACH})")

    def close(self) -> None:
        """Idempotent."""
        if self._closed:
            return
        self._closed = True
        for recorder in self.recorders:
            try:
                recorder.close()
            except Exception as exc:  # noqa: BLE001 - the others still close
                self.report(f"closing the recorder failed: {type(exc).__name__}: {exc}")
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        if self.outcome is None:
            self.report(f"nothing recorded: {self.framework} never started training" if self.framework
                        else "nothing recorded: the script called no module after building a torch optimizer"
                        if self._built_optimizer else "nothing recorded: the script built no torch optimizer")


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Calls `patches[name](module)` right after module `name` is first
    imported (its loader's `exec_module`), so a class is patched before the
    script can use it; the module itself is loaded as usual."""

    def __init__(self, patches: dict):
        self.patches = dict(patches)

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = PatchingLoader(spec.loader, self.patches.pop(name))
                return spec
        return None


class PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self.loader = loader
        self.patch = patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: the real loader's
        return getattr(self.loader, name)


# ------------------------------------------------------------------ --loss
def find_loss(spec: str):
    """(the object `record --loss` names, None) or (None, why not).
    `criterion` or `a.b`: the running script's top level (`__main__`, what
    it has defined when the recorder attaches); `package.module:function`:
    that module, imported as the script would import it. Both are the
    user's own command line, never a run's data."""
    module_name, _, path = spec.rpartition(":")
    if module_name:
        try:
            obj = importlib.import_module(module_name)
        except ImportError as exc:
            return None, f"cannot import {module_name} ({exc})"
    else:
        obj = sys.modules.get("__main__")
    for i, part in enumerate(path.split(".")):
        if not hasattr(obj, part):
            where = f"module {module_name}" if module_name else "the script's top level"
            return None, (f"no {'.'.join(path.split('.')[:i + 1])} in {where} when the recorder attached"
                          + ("" if module_name else " (a function's local cannot be named)"))
        obj = getattr(obj, part)
    if not callable(obj):
        return None, f"{path} is a {type(obj).__name__}, not a loss function or module"
    return obj, None


def describe_loss(fn) -> str:
    if isinstance(fn, torch.nn.Module):
        return f"the module {type(fn).__name__}"
    return f"the function {getattr(fn, '__qualname__', getattr(fn, '__name__', repr(fn)))}"


# --------------------------------------------------------------- the process
def option_problem(options: dict) -> str | None:
    """Why `options` are no `AmpRecorder` keywords with valid values (one
    line), or None; checked by building a recorder on a one-layer model in
    a temporary directory, as the script's would be built."""
    attached = sorted(set(options) & set(ATTACHED))
    if attached:
        return f"{attached[0]} is no recorder option: record finds the script's own"
    with tempfile.TemporaryDirectory(prefix="amp-postmortem-check-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            AmpRecorder(os.path.join(tmp, "run"), torch.nn.Linear(1, 1), **options).close()
        except (TypeError, ValueError) as exc:
            return f"bad recorder option: {exc}"
    return None


def run_script(target: list[str]) -> None:
    """Runs `script ARGS` or `-m module ARGS` as `__main__`, as python would."""
    if target[0] == "-m":
        sys.argv = ["-m", *target[2:]]  # run_module puts the module's file first
        sys.path[0] = os.getcwd()
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(target)
        sys.path[0] = os.path.dirname(os.path.abspath(target[0]))
        runpy.run_path(target[0], run_name="__main__")


def _exit_on_sigterm() -> None:
    """SIGTERM (a scheduler's stop, `record` passing one on) ends the script
    with SystemExit(143), so the recorders close; a script's own handler,
    installed later, wins."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main(argv: list[str] | None = None) -> int:
    """`python -m recorders.attach CONFIG TARGET...`: CONFIG is JSON
    `{"run": DIR, "options": {KEY: repr(VALUE)}, "loss": SPEC (optional)}`,
    TARGET `script ARGS` or `-m module ARGS`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config, target = json.loads(argv[0]), argv[1:]
    options = {key: ast.literal_eval(text) for key, text in config["options"].items()}
    problem = option_problem(options)
    if problem is None and target[0] == "-m" and importlib.util.find_spec(target[1]) is None:
        problem = f"no module named {target[1]!r}"
    elif problem is None and target[0] != "-m" and not os.path.isfile(target[0]):
        problem = f"script not found: {target[0]}"
    if problem is not None:
        print(f"Error: {problem}", file=sys.stderr, flush=True)
        return 2
    session = ScriptRecording(config["run"], options, loss=config.get("loss"))
    session.install()
    _exit_on_sigterm()
    try:
        run_script(target)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - shown as python shows it, then exit code 1
        session.close()
        trimmed = script_frames(exc.__traceback__)
        sys.excepthook(type(exc), exc.with_traceback(trimmed), trimmed)
        return 1
    finally:
        session.close()
    return 0


def script_frames(tb):
    """The traceback from the script's first frame on: this module's and
    runpy's frames are `record`'s, not the user's."""
    ours = {__file__, runpy.__file__, "<frozen runpy>"}
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    from recorders.attach import main as attach_main  # the module by its own name, not as __main__
    sys.exit(attach_main())
