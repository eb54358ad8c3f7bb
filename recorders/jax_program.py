"""The float16/bfloat16 reductions of a JAX step program, read once from
its jaxpr: the manifest's `jax_reductions` (docs/FORMAT.md).

A softmax, log_softmax, logsumexp or sum written on float16 values inside
a module's `__call__` is no module output: the rows never see it, and one
that loses precision without overflowing leaves no trace in them. The
program does: `trace_reductions(jitted, args, kwargs)` asks the jitted step
for its trace (`.trace(...)`, the jaxpr jax cached when the step was
compiled: the step's Python does not run again, nothing runs on the
device, no number changes) and `reduction_sites(jaxpr)` walks it, into
every sub-jaxpr (jit, custom_jvp/custom_vjp calls, remat, cond, while,
scan). A reduction is kept when

- it accumulates in float16/bfloat16 (`reduce_sum`, `reduce_prod`,
  `cumsum`, `cumprod`, `cumlogsumexp` in that dtype), or
- its values are float16/bfloat16 and jnp's upcast sums them in float32
  but the sum goes straight back to float16/bfloat16 (`x.sum()` of a
  float16 `x`: the sum is held in float16, Inf past 65504; a mean, divided
  before the cast back, stays within the values' range and is not kept), or
- it sums `exp` of float16/bfloat16 values: a softmax (the sum divides),
  log_softmax (its log is subtracted), logsumexp (its log added to the
  max) or a bare sum of exps, with `shifted`: whether the exp's input had
  its maximum subtracted (without, exp overflows float16 past 11.09).

Each site: the pattern, the values' dtype, the dtype it accumulates in,
the values reduced per output, the phase (`backward` under a transpose),
and the innermost frame of the user's code (`file`, `line`, `function`;
frames of jax, flax, optax, jmp, keras, the standard library and this
package skipped; `file` relative to the working directory when under it).
Imports jax only when called."""
from __future__ import annotations

import math
import os
import sys
import sysconfig


LOW = ("float16", "bfloat16")
# Reductions that accumulate in their own dtype (`reduce_max`/`reduce_min`
# and `cummax` are exact in any dtype).
_ACCUMULATING = {"reduce_sum": "sum", "reduce_prod": "prod", "cumsum": "cumsum", "cumprod": "cumprod",
                 "cumlogsumexp": "cumlogsumexp"}
# What changes a value's layout or dtype but not what it is: walked through.
_PASS = {"convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "stop_gradient",
         "copy", "copy_p", "reduce_precision"}
# Frames that are never the user's.
_FOREIGN_PACKAGES = ("jax", "jaxlib", "flax", "optax", "jmp", "chex", "keras", "tensorflow")
# At most this many sites in the manifest (a program repeats a block many times).
MAX_SITES = 64


def trace_reductions(jitted, args, kwargs, *, step: int) -> dict:
    """The manifest's `jax_reductions` entry of the step `jitted` (a
    `jax.jit` or `nnx.jit` function already called with `args`/`kwargs`):
    `{"traced": true, "step", "sites", "sites_dropped"}`, or `{"traced":
    false, "step", "reason"}` when the program could not be read (recording
    goes on without it)."""
    try:
        traced = jitted.trace(*args, **kwargs)
        closed = getattr(traced, "jaxpr", None)
        if closed is None:  # nnx.jit's Traced holds jax's
            closed = traced.traced.jaxpr
        sites = reduction_sites(closed)
    except Exception as exc:  # never the training's failure
        return {"traced": False, "step": int(step), "reason": f"{type(exc).__name__}: {exc}"[:300]}
    return {"traced": True, "step": int(step), "sites": sites[:MAX_SITES],
            "sites_dropped": max(0, len(sites) - MAX_SITES)}


def reduction_sites(closed_jaxpr) -> list[dict]:
    """The float16/bfloat16 reductions of a (closed) jaxpr, one dict per
    site (see the module's doc), forward sites first, in program order;
    the same site seen several times (a block called twice, its backward)
    counted in `count`."""
    graph = _Graph()
    graph.walk(getattr(closed_jaxpr, "jaxpr", closed_jaxpr), graph.new_scope())
    frames = _UserFrames()
    sites: dict = {}
    for node in graph.nodes:
        site = _site(graph, node)
        if site is None:
            continue
        site.update(frames.of(node))
        site["phase"] = "backward" if "transpose" in str(node.eqn.source_info.name_stack) else "forward"
        key = tuple(site.items())
        if key in sites:
            sites[key]["count"] += 1
        else:
            sites[key] = {**site, "count": 1}
    found = list(sites.values())
    found.sort(key=lambda s: s["phase"] != "forward")  # stable: program order within a phase
    return found


# ------------------------------------------------------------ the dataflow
class _Node:
    __slots__ = ("eqn", "ins", "outs", "calls")

    def __init__(self, eqn, ins, outs, calls):
        # calls: the tracebacks of the equations whose sub-jaxpr holds it, innermost first
        self.eqn, self.ins, self.outs, self.calls = eqn, ins, outs, calls

    @property
    def name(self) -> str:
        return self.eqn.primitive.name


class _Graph:
    """The program's equations, sub-jaxprs linked to their call: a value is
    (scope, var), each visit of a sub-jaxpr a scope of its own (jax shares
    one traced jaxpr between the calls of a jitted helper)."""

    def __init__(self):
        self.nodes: list = []
        self.producer: dict = {}
        self.consumers: dict = {}
        self.alias: dict = {}
        self._scopes = 0

    def new_scope(self) -> int:
        self._scopes += 1
        return self._scopes

    def key(self, scope, var):
        if hasattr(var, "val"):  # a literal
            return None
        key = (scope, var)
        while key in self.alias:
            key = self.alias[key]
        return key

    def walk(self, jaxpr, scope, calls=()) -> None:
        for eqn in jaxpr.eqns:
            ins = [self.key(scope, v) for v in eqn.invars]
            outs = [(scope, v) for v in eqn.outvars]
            node = _Node(eqn, ins, outs, calls)
            self.nodes.append(node)
            for k in ins:
                if k is not None:
                    self.consumers.setdefault(k, []).append(node)
            for k in outs:
                self.producer[k] = node
            subs = list(_sub_jaxprs(eqn.params))
            for sub in subs:
                inner = self.new_scope()
                offset = len(eqn.invars) - len(sub.invars)
                if offset in (0, 1):  # a call (0) or a cond's branch (1: the predicate first)
                    for v, k in zip(sub.invars, ins[offset:]):
                        if k is not None:
                            self.alias[(inner, v)] = k
                self.walk(sub, inner, (eqn.source_info.traceback, *calls))
                if len(subs) == 1 and offset == 0 and len(sub.outvars) == len(eqn.outvars):
                    for outer, v in zip(eqn.outvars, sub.outvars):
                        k = self.key(inner, v)
                        if k is not None:
                            self.alias[(scope, outer)] = k

    def source(self, key):
        """(node, dtype): the node that made a value, walked back through
        layout changes and casts, and the value's dtype as it made it
        (node None: an input of the program)."""
        while key is not None:
            node = self.producer.get(key)
            if node is None or node.name not in _PASS:
                return node, _dtype_of(key[1])
            key = node.ins[0]
        return None, None

    def uses(self, key, through=()):
        """The nodes that use a value, through layout changes and casts
        (and the primitives in `through`): (node, the position used)."""
        seen, todo, found = set(), [key], []
        while todo:
            k = todo.pop()
            if k is None or k in seen:
                continue
            seen.add(k)
            for node in self.consumers.get(k, ()):
                if node.name in _PASS or node.name in through:
                    todo.extend(node.outs)
                else:
                    found.append((node, [i for i, x in enumerate(node.ins) if x == k]))
        return found

    def held_as(self, key) -> set:
        """The dtypes a value is cast to before anything else uses it."""
        seen, todo, dtypes = set(), [key], set()
        while todo:
            k = todo.pop()
            if k in seen:
                continue
            seen.add(k)
            for node in self.consumers.get(k, ()):
                if node.name in _PASS:
                    if node.name == "convert_element_type":
                        dtypes.add(_dtype_of(node.outs[0][1]))
                    todo.extend(node.outs)
        return dtypes


def _sub_jaxprs(params):
    for value in params.values():
        for sub in (value if isinstance(value, (list, tuple)) else (value,)):
            if hasattr(sub, "eqns"):
                yield sub
            elif hasattr(sub, "jaxpr") and hasattr(sub, "consts") and hasattr(sub.jaxpr, "eqns"):
                yield sub.jaxpr


def _dtype_of(var) -> str | None:
    aval = getattr(var, "aval", None)
    dtype = getattr(aval, "dtype", None)
    return None if dtype is None else str(dtype)


def _is_float(dtype) -> bool:
    return dtype is not None and ("float" in dtype)


# ------------------------------------------------------------ one site
def _site(graph: _Graph, node: _Node) -> dict | None:
    pattern = _ACCUMULATING.get(node.name)
    if pattern is None or not node.ins or node.ins[0] is None:
        return None
    accumulates = _dtype_of(node.eqn.outvars[0])
    made_by, values = graph.source(node.ins[0])
    if not _is_float(values) or not _is_float(accumulates):
        return None  # a count of booleans or integers
    shape = getattr(getattr(node.eqn.invars[0], "aval", None), "shape", ())
    if node.name in ("reduce_sum", "reduce_prod"):
        per_output = math.prod(int(shape[a]) for a in node.eqn.params.get("axes", ()))
    else:
        per_output = int(shape[node.eqn.params.get("axis", 0)]) if shape else 1
    if per_output < 2:
        return None  # an axis of one value: nothing is reduced
    site = {"pattern": pattern, "dtype": values, "accumulation_dtype": accumulates,
            "values_per_output": int(per_output), "shifted": None}
    if node.name == "reduce_sum" and made_by is not None and made_by.name == "exp" and values in LOW:
        site["pattern"], site["shifted"] = _exp_sum(graph, node, made_by)
        return site
    if accumulates in LOW:
        if node.name == "reduce_sum" and _divided_by_constant(graph, node):
            site["pattern"] = "mean"
        return site
    if values in LOW and node.name == "reduce_sum" and graph.held_as(node.outs[0]) & set(LOW):
        return site  # jnp's upcast, then the sum held in float16 again
    return None


def _exp_sum(graph: _Graph, node: _Node, exp: _Node) -> tuple[str, bool]:
    """(pattern, shifted) of a sum of exps: softmax, log_softmax, logsumexp."""
    shifted = False
    sub, _ = graph.source(exp.ins[0])
    if sub is not None and sub.name == "sub" and len(sub.ins) == 2:
        made, _ = graph.source(sub.ins[1])
        shifted = made is not None and made.name in ("reduce_max", "max", "select_n")
    pattern = "exp_sum"
    for user, at in graph.uses(node.outs[0], through=("abs",)):
        if user.name == "div" and 1 in at:
            return "softmax", shifted
        if user.name == "log":
            for after, at_log in graph.uses(user.outs[0]):
                if after.name == "sub" and 1 in at_log:
                    return "log_softmax", shifted
                if after.name == "add":
                    pattern = "logsumexp"
            pattern = "logsumexp"
    return pattern, shifted


def _divided_by_constant(graph: _Graph, node: _Node) -> bool:
    for user, at in graph.uses(node.outs[0]):
        if user.name == "div" and 0 in at and user.ins[1] is None:
            return True
    return False


# ------------------------------------------------------------ the user's frame
class _UserFrames:
    """The innermost frame of a traceback in the user's code: not in jax,
    flax, optax, jmp, keras, this package or the standard library."""

    def __init__(self):
        from jax._src import source_info_util
        self._frames = source_info_util.user_frames
        roots = [os.path.dirname(os.path.abspath(__file__))]
        for name in _FOREIGN_PACKAGES:
            where = getattr(sys.modules.get(name), "__file__", None)
            if where:
                roots.append(os.path.dirname(os.path.abspath(where)))
        self._foreign = tuple(r.rstrip(os.sep) + os.sep for r in roots)
        self._stdlib = tuple(os.path.abspath(p).rstrip(os.sep) + os.sep
                             for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib")} if p)
        self._cwd = os.getcwd().rstrip(os.sep) + os.sep

    def of(self, node) -> dict:
        """The user's frame of an equation; inside a sub-jaxpr whose own
        frames are all jax's (jnp's jitted functions: a jit's traceback
        stops at its boundary), the frame of the innermost call that has one."""
        own = self.stack(node.eqn.source_info.traceback)
        for traceback in node.calls:
            if own:
                break
            own = self.stack(traceback)
        if not own:
            return {"file": None, "line": None, "function": None}
        path, line, function = own[0]
        shown = path[len(self._cwd):] if path.startswith(self._cwd) else path
        return {"file": shown, "line": line, "function": function}

    def stack(self, traceback) -> list:
        """The user's frames of a traceback, innermost first."""
        found = []
        for frame in self._frames(traceback):
            path = os.path.abspath(frame.file_name)
            if path.startswith(self._foreign) or (path.startswith(self._stdlib)
                                                  and "-packages" + os.sep not in path):
                continue
            found.append((path, int(frame.start_line), frame.function_name))
        return found
