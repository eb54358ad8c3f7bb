"""What a model's outputs mean to a replay: which one is the loss
(`find_loss`, the recorder's rule), and which ones a backward starts from.

A model that computes its loss inside (Hugging Face models called with
`labels=`, nanoGPT's `(logits, loss)`) returns the loss next to the tensors
it was computed from. The recorder saves the gradient that reached every
output: 1 (times the loss scale) for the loss and d(loss)/d(logits) for the
logits. Seeding a backward with both counts the logits' share twice (every
gradient exactly 2x), so a backward starts only from the outputs that no
other output was computed from (`backward_roots`).
"""
from __future__ import annotations

# The one rule for the loss among a model's outputs, shared with the
# recorder's loss tap: both sides must agree on which output the loss is.
from recorders.format.tensors import find_loss  # noqa: F401 - the replay engine's name for it


def backward_roots(outputs) -> list[bool]:
    """Per output tensor (those with a gradient to start from): True when a
    backward starts from it.

    An output whose autograd edge `(grad_fn, output_nr)` is reachable from
    another output's `grad_fn` was used to compute that output (the logits
    of a loss computed inside the model), so the gradient saved for it
    already includes what flows back from the other one: it is dropped, as
    is a second occurrence of the same tensor. The walk stops at nodes
    created before the oldest output (`_sequence_nr`): no output edge lies
    below them. Limit: an output that also fed a term outside the model
    (the training loss added something computed from the logits) loses that
    term's share; the replay's fidelity check shows it.
    """
    edges: dict = {}
    keep = []
    for i, t in enumerate(outputs):
        edge = (t.grad_fn, t.output_nr) if t.grad_fn is not None else ("leaf", id(t))
        keep.append(edge not in edges)
        edges.setdefault(edge, i)
    nodes = [t.grad_fn for t in outputs if t.grad_fn is not None]
    if len(nodes) < 2:
        return keep
    oldest = min(n._sequence_nr() for n in nodes)
    seen: set = set()
    todo = list(dict.fromkeys(nodes))
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for nxt, nr in node.next_functions:
            if nxt is None:
                continue
            j = edges.get((nxt, nr))
            if j is not None:
                keep[j] = False
            if nxt not in seen and nxt._sequence_nr() >= oldest:
                todo.append(nxt)
    return keep
