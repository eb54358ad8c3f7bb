"""Source lines of the model run in float32 during a replay: how a replay
runs the op-level patch `fix` prints, before anyone edits the file.

    with float32_lines([("/abs/models.py", 77)], ("cpu",)) as seen:   # inside the run's autocast
        output = model(*args)
    seen[("/abs/models.py", 77)].variables   # {"q", "k"}: the line's float16 inputs, by name

While one of the lines runs (it is on the Python stack: its own torch calls
and whatever it calls), every torch function runs with native autocast and
its emulation off (`run_config.float32_region`), and the float16/bfloat16
tensors handed to it from outside the line are cast to float32 first: what
`with torch.autocast(device_type, enabled=False):` around the line does with
`.float()` on its float16 inputs. A `Float32Lines` TorchFunctionMode does it
(above autograd, as autocast, so the backward of those ops runs in float32
too); it must be the innermost mode, entered inside the run's autocast
context, so it sees each call before the emulation's casts.

Per line it records which of the line's own variables held the inputs it
cast (`LineInputs.variables`) and how many inputs came from elsewhere (an
attribute, a list: `others`): the patch is an exact rewrite only when every
cast input is one of the line's variables (`whatif/line_patch.py`).

Lines are matched by the absolute path of the code object's file and the
frame's current line, as the op trace names them (`op_trace.SourceLine`);
nothing is imported, and the mode holds no reference to the model.
"""
from __future__ import annotations

import ast
import contextlib
import linecache
import os
import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .run_config import float32_region

__all__ = ["Float32Lines", "LineInputs", "float32_lines", "line_key"]

_REDUCED = (torch.float16, torch.bfloat16)
# Calls that read a tensor's metadata: run as they are (no cast, no input counted).
_METADATA = frozenset({"size", "dim", "numel", "stride", "element_size", "is_floating_point", "is_contiguous",
                       "data_ptr", "__get__", "__len__", "ndimension", "nelement", "storage_offset"})


def line_key(file: str, line: int) -> tuple:
    """(absolute path, line): how a line is named to the mode."""
    return (os.path.abspath(file), int(line))


@dataclass
class LineInputs:
    """What a line's calls were handed in float16/bfloat16 from outside it."""
    variables: set = field(default_factory=set)   # names of the line's variables that held them
    others: int = 0                               # inputs that were none of its variables
    calls: int = 0                                # torch calls run in float32 for the line


def _names_of(path: str, line: int) -> frozenset:
    """The variable names the line reads (empty when it does not parse alone)."""
    code = linecache.getline(path, line).strip()
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return frozenset()
    return frozenset(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))


class Float32Lines(TorchFunctionMode):
    """See the module's doc. `lines`: (file, line) pairs; `device_types`:
    the native autocast switches to turn off (the run's and the policy's)."""

    def __init__(self, lines, device_types):
        super().__init__()
        self.targets = {line_key(f, n) for f, n in lines}
        self.files = {f for f, _ in self.targets}
        self.device_types = tuple(device_types)
        self.seen: dict = {}
        self._paths: dict = {}
        self._names: dict = {}
        self._made: dict = {}   # id -> weakref of tensors the lines' calls returned

    def _line_frame(self):
        frame = sys._getframe(2)
        while frame is not None:
            raw = frame.f_code.co_filename
            path = self._paths.get(raw)
            if path is None:
                path = self._paths[raw] = os.path.abspath(raw)
            if path in self.files and (path, frame.f_lineno) in self.targets:
                return (path, frame.f_lineno), frame
            frame = frame.f_back
        return None, None

    def _made_here(self, t) -> bool:
        ref = self._made.get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _METADATA:
            return func(*args, **kwargs)
        key, frame = self._line_frame()
        if key is None:
            return func(*args, **kwargs)
        names = self._names.get(key)
        if names is None:
            names = self._names[key] = _names_of(*key)
        values = frame.f_locals
        by_id = {id(v): n for n in names if isinstance(v := values.get(n), torch.Tensor)}
        record = self.seen.setdefault(key, LineInputs())
        record.calls += 1

        def up(v):
            if not (isinstance(v, torch.Tensor) and v.dtype in _REDUCED) or self._made_here(v):
                return v
            name = by_id.get(id(v))
            if name is not None and values.get(name) is v:
                record.variables.add(name)
            else:
                record.others += 1
            return v.float()
        with float32_region(*self.device_types):
            args, kwargs = pytree.tree_map(up, (tuple(args), dict(kwargs)))
            out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._made[id(t)] = weakref.ref(t)
        if len(self._made) > 4096:
            self._made = {k: r for k, r in self._made.items() if r() is not None}
        return out


@contextlib.contextmanager
def float32_lines(lines, device_types):
    """The lines run in float32 while the block runs (nothing when `lines`
    is empty); yields {line_key: LineInputs} of the lines that ran."""
    if not lines:
        yield {}
        return
    mode = Float32Lines(lines, device_types)
    with mode:
        yield mode.seen
