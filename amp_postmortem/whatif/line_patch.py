"""The op-level patch `fix` prints: one source line of the model rewritten to
run in float32, written from the line's own text.

    patch = line_patch("scores = q @ k.transpose(-1, -2)", {"q", "k"}, others=0, device_type="cuda")
    patch.text
    # with torch.autocast("cuda", enabled=False):
    #     scores = q.float() @ k.float().transpose(-1, -2)

The rewrite puts the line in an autocast-disabled block and appends
`.float()` to every read of the variables that held its float16 inputs
(`replaying.fp32_lines.LineInputs`): exactly what the replay verified. It is
exact only when the line is a whole statement that parses alone and every
float16 input of the line was one of those variables; otherwise
(`PatchKind.BLOCK`) the block is shown around the line as it is, with the
casts left to the user, and `reason` says why.
"""
from __future__ import annotations

import ast
import enum
from dataclasses import dataclass

__all__ = ["LinePatch", "PatchKind", "NotExact", "line_patch"]


class PatchKind(enum.Enum):
    REWRITE = "rewrite"   # the line rewritten: autocast off, .float() on its float16 variables
    BLOCK = "block"       # the autocast-disabled block around the line, casts left to the user


class NotExact(enum.Enum):
    NO_SOURCE = "no_source"                # the line's text could not be read
    NOT_A_STATEMENT = "not_a_statement"    # part of a statement over several lines, or a block's header
    INPUT_NOT_A_VARIABLE = "input_not_a_variable"  # a float16 input came from an attribute, a list, a call
    NO_INPUT = "no_input"                  # no float16 input reached the line: nothing to cast


@dataclass(frozen=True)
class LinePatch:
    kind: PatchKind
    text: str                     # the replacement, unindented (indent it as the line was)
    cast: tuple = ()              # the variables given .float()
    reason: NotExact | None = None

    @property
    def exact(self) -> bool:
        return self.kind is PatchKind.REWRITE

    def to_dict(self) -> dict:
        return {"kind": self.kind.value, "exact": self.exact, "text": self.text, "cast": list(self.cast),
                "reason": self.reason.value if self.reason else None}


def _statement(code: str):
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or isinstance(tree.body[0], (ast.If, ast.For, ast.While, ast.With, ast.Try,
                                                           ast.FunctionDef, ast.ClassDef)):
        return None
    return tree.body[0]


def line_patch(code: str, variables, *, others: int, device_type: str) -> LinePatch:
    """The patch for the source line `code` (stripped), whose float16 inputs
    were `variables` (and `others` inputs that were none of its variables)."""
    head = f"with torch.autocast({device_type!r}, enabled=False):"
    variables = set(variables)
    statement = _statement(code) if code else None
    reason = (NotExact.NO_SOURCE if not code else NotExact.NOT_A_STATEMENT if statement is None else
              NotExact.INPUT_NOT_A_VARIABLE if others else NotExact.NO_INPUT if not variables else None)
    if reason is not None:
        body = code or "<the line>"
        return LinePatch(PatchKind.BLOCK, f"{head}\n    {body}", (), reason)
    reads = sorted((n for n in ast.walk(statement) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                    and n.id in variables), key=lambda n: n.end_col_offset, reverse=True)
    # From the right, so earlier offsets stay valid; ast's offsets count UTF-8 bytes.
    text = code.encode()
    for node in reads:
        text = text[:node.end_col_offset] + b".float()" + text[node.end_col_offset:]
    return LinePatch(PatchKind.REWRITE, f"{head}\n    {text.decode()}", tuple(sorted(variables)), None)
