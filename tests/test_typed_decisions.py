"""Decisions rest on typed results, never on the words of a note: a
producer may reword a note (they are output) without changing what `fix`
or `recommend` decide (issue 23 item 7)."""
from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import amp_postmortem
from amp_postmortem import whatif
from amp_postmortem.names import BackwardFrom, BackwardStart
from amp_postmortem.whatif import fix as fix_mod
from amp_postmortem.whatif import saved_steps

_TEXT_TESTS = {"startswith", "endswith", "find", "index", "count"}


def _note_loops(tree):
    """(loop variable, node of the loop) for every loop/comprehension over
    something named `notes`."""
    for node in ast.walk(tree):
        gens = node.generators if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp,
                                                    ast.DictComp)) else []
        loops = [(g.target, g.iter) for g in gens] + ([(node.target, node.iter)] if isinstance(node, ast.For) else [])
        for target, it in loops:
            name = it.attr if isinstance(it, ast.Attribute) else getattr(it, "id", None)
            if name and name.endswith("notes") and isinstance(target, ast.Name):
                yield target.id, node


def test_no_decision_reads_the_words_of_a_note():
    """No code in amp_postmortem tests a note's text (startswith, `in`
    on its words, a regular expression): the bug class this guards is a
    decision that breaks when a producer rewords its note."""
    found = []
    for path in Path(amp_postmortem.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for var, loop in _note_loops(tree):
            for sub in ast.walk(loop):
                if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                        and sub.func.attr in _TEXT_TESTS and getattr(sub.func.value, "id", None) == var):
                    found.append(f"{path.name}:{sub.lineno} {var}.{sub.func.attr}")
                if (isinstance(sub, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn)) for o in sub.ops)
                        and isinstance(sub.left, ast.Constant)
                        and any(getattr(c, "id", None) == var for c in sub.comparators)):
                    found.append(f"{path.name}:{sub.lineno} '...' in {var}")
                if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                        and getattr(sub.func.value, "id", None) == "re"
                        and any(getattr(a, "id", None) == var for a in sub.args)):
                    found.append(f"{path.name}:{sub.lineno} re.{sub.func.attr}(..., {var})")
    assert found == []


# The keys of the dict form of a trial, a saved-step check, a bfloat16
# replay and a bisected sample: rendered, never decided on.
_TYPED_KEYS = {"saved", "saved_as_recorded", "fails", "finite", "not_saved_by", "culprit", "params_off", "backoffs",
               "why", "finite_at_max", "max_finite_k", "avoids", "gradients_confirmed", "modules", "suspicious",
               "fp64_finite", "judged"}
# bisect's verdicts (`BisectKind`): compared as the enum, never as its JSON string.
_BISECT_KINDS = {"not_reproduced", "model", "data", "batch"}


def _decision_modules():
    root = Path(amp_postmortem.__file__).parent
    return sorted((root / "whatif").glob("*.py")) + sorted((root / "advice").glob("*.py"))


def _readers_of_the_dict_form(tree):
    """Nodes inside `Trial.of`, the one reader of a trial's dict form."""
    allowed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Trial":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "of":
                    allowed |= {id(n) for n in ast.walk(fn)}
    return allowed


def test_no_decision_reads_a_trial_or_a_check_as_a_string_keyed_dict():
    """Trials, saved-step checks and bfloat16 replays are dataclasses:
    nothing in the what-if modules or in recommend subscripts them (or
    calls .get) by one of their keys; only `Trial.of` reads the dict form
    (a `--json` document read back)."""
    found = []
    for path in _decision_modules():
        tree = ast.parse(path.read_text(), str(path))
        allowed = _readers_of_the_dict_form(tree)
        for node in ast.walk(tree):
            if id(node) in allowed:
                continue
            key = None
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                    and isinstance(node.slice, ast.Constant):
                key = node.slice.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                  and node.args and isinstance(node.args[0], ast.Constant)):
                key = node.args[0].value
            if key in _TYPED_KEYS:
                found.append(f"{path.name}:{node.lineno} [{key!r}]")
    assert found == []


def test_bisect_kinds_are_compared_as_the_enum():
    found = []
    for path in _decision_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(x, ast.Attribute) and x.attr == "kind" for x in sides) and any(
                        isinstance(x, ast.Constant) and x.value in _BISECT_KINDS for x in sides):
                    found.append(f"{path.name}:{node.lineno}")
    assert found == []


def _constants(node) -> list:
    """The string constants a comparison side is or holds (`x in ("a", "b")`)."""
    if isinstance(node, ast.Constant):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant)]
    return []


def _is_field(node, name: str) -> bool:
    """`x.name`, a variable `name`, `getattr(x, "name", ...)`, or a dict
    form's `d["name"]` / `d.get("name")`."""
    if isinstance(node, ast.Attribute):
        return node.attr == name
    if isinstance(node, ast.Name):
        return node.id == name
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
        return node.args[1].value == name
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == name
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == name)


def _string_compares(tree, name: str, values) -> list[int]:
    """Lines of the comparisons of a field `name` with one of `values`
    spelled as a string literal."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_field(x, name) for x in sides) and any(v in values for x in sides for v in _constants(x)):
                found.append(node.lineno)
    return found


def _package_modules():
    return sorted(Path(amp_postmortem.__file__).parent.rglob("*.py"))


def test_the_string_compare_check_finds_what_it_guards():
    tree = ast.parse("a = r.status == 'collapse'\nb = s.kind in ('keep_fp32', 'x')\nc = d.get('status') != 'healthy'\n"
                     "ok = r.status is S.COLLAPSE\nok2 = m.get('status') == 'closed'\nd = status == 'healthy'\n"
                     "e = getattr(p, 'status', 'x') != 'collapse'\n")
    assert _string_compares(tree, "status", {"collapse", "healthy"}) == [1, 3, 6, 7]
    assert _string_compares(tree, "kind", {"keep_fp32"}) == [2]


def test_scale_status_is_compared_as_the_enum():
    """`ScaleReport.status` is a `ScaleStatus`: nothing in the package
    compares a status (or a scale report's dict form) with its JSON string."""
    from amp_postmortem.analyses.scale import ScaleStatus
    values = {s.value for s in ScaleStatus}
    found = [f"{p.name}:{line}" for p in _package_modules()
             for line in _string_compares(ast.parse(p.read_text(), str(p)), "status", values)]
    assert found == []


def _typed_fields():
    """(field, its enum) of the decision modules' typed outcomes."""
    from amp_postmortem.advice import RecommendationKind, Source
    from amp_postmortem.whatif.fix import FixSearch
    from amp_postmortem.whatif.op_fix import ChosenBy
    from amp_postmortem.whatif.scale_result import ScalePosition, WindowMethod
    return [("kind", RecommendationKind), ("recorded_position", ScalePosition), ("source", Source),
            ("search", FixSearch), ("chosen_by", ChosenBy), ("method", WindowMethod)]


def test_recommendation_kinds_and_the_what_ifs_outcomes_are_compared_as_enums():
    """`Recommendation.kind` is a `RecommendationKind` (its `source` a
    `Source`), a window's `recorded_position` a `ScalePosition` (its
    `method` a `WindowMethod`), fix's `search` a `FixSearch`, an op fix's
    `chosen_by` a `ChosenBy`, a replay's `backward_start` a
    `BackwardStart` and its `backward_from` a `BackwardFrom` (anywhere in
    the package): no comparison with their JSON strings in the
    decision modules (recommend and the what-ifs), nor, for the
    recommendation kinds no finding shares (a finding's kind is its own
    string), anywhere in the package."""
    from amp_postmortem.advice import RecommendationKind
    from amp_postmortem.names import FINDING_KINDS
    found = []
    for path in _package_modules():
        tree = ast.parse(path.read_text(), str(path))
        if path in _decision_modules():
            for name, typed in _typed_fields():
                found += [f"{path.name}:{line} {name}" for line in
                          _string_compares(tree, name, {v.value for v in typed})]
        else:
            only_ours = {k.value for k in RecommendationKind} - set(FINDING_KINDS)
            found += [f"{path.name}:{line} kind" for line in _string_compares(tree, "kind", only_ours)]
        # A replay's backward start and seed are decided on in the replay layer too.
        found += [f"{path.name}:{line} backward_start" for line in
                  _string_compares(tree, "backward_start", {v.value for v in BackwardStart})]
        found += [f"{path.name}:{line} backward_from" for line in
                  _string_compares(tree, "backward_from", {v.value for v in BackwardFrom})]
    assert found == []


def test_the_enums_keep_their_json_strings():
    """The `--json` values are a contract: the enums' values are the
    strings the fields held before they were typed."""
    from amp_postmortem.advice import ORDER, RecommendationKind
    from amp_postmortem.analyses.scale import ScaleStatus
    from amp_postmortem.whatif.scale_result import ScalePosition
    assert {s.value for s in ScaleStatus} == {"no_scaler", "collapse", "stuck_low", "growth_blocked", "healthy"}
    assert [k.value for k in ORDER] == ["check_data", "check_weights", "training_instability", "keep_fp32",
                                        "add_grad_scaler",
                                        "gradient_drift",
                                        "use_bf16", "scaler_settings", "fp32_master_weights",
                                        "larger_learning_rate", "stochastic_rounding", "avoid_mixed_precision",
                                        "no_change"]
    assert tuple(RecommendationKind) == ORDER
    assert {p.value for p in ScalePosition} == {"inside", "above", "below"}
    fields = dict(_typed_fields())
    assert {v.value for v in fields["source"]} == {"replay", "recorded"}
    assert {v.value for v in fields["search"]} == {"not_needed", "single", "greedy", "none"}
    assert {v.value for v in fields["chosen_by"]} == {"origin", "local_error"}
    assert {v.value for v in fields["method"]} == {"replay", "estimate"}
    assert {v.value for v in BackwardStart} == {"saved", "substitute_mean", "loss_fn"}
    assert {v.value for v in BackwardFrom} == {"loss", "loss_fn", "output_gradient"}


def test_a_typed_trial_renders_the_dict_it_replaced():
    """`Trial.to_dict` is the `--json` form: the keys (and values) of the
    dict `Prepared.trial` returned before it was typed."""
    from amp_postmortem.whatif import Trial
    metrics = {"finite": True, "forward_finite": True, "backward_finite": True, "nonfinite_values": 0,
               "nonfinite_params": 0, "loss": 1.5, "loss_rel_err": 0.01, "output_rel_err": 0.02,
               "grad_rel_err": 0.03, "worst_param": "w", "worst_param_rel_err": 0.04, "params_off": {},
               "error": None, "loss_scale": 256.0, "backoffs": 0, "saved": True, "why": None, "culprit": None}
    assert Trial.of(metrics).to_dict() == metrics
    in_fix = {"modules": ["a", "b"], "round": 2, **metrics}
    assert Trial.of(in_fix).to_dict() == in_fix
    assert Trial.of(metrics).with_modules(("a",), 1).to_dict() == {"modules": ["a"], "round": 1, **metrics}


class _Stub:
    """A prepared step whose float64 run is non-finite and whose note says
    so in other words; replaying it is an error (nothing should)."""
    step, rank, precision, loss_scale, backward_start = 0, 0, "fp16", 256.0, BackwardStart.SAVED
    bundle = SimpleNamespace(step=0, rank=0, path="/nonexistent/bundle")

    def __init__(self, reference_finite: bool):
        self.reference_finite = reference_finite
        self.notes = ["REWORDED: float64 itself went NaN"]

    def reference_for(self, *a, **k):
        return SimpleNamespace(calls={})

    def trial(self, **changes):
        return whatif.Trial.of({"saved": False, "finite": False, "forward_finite": False, "backward_finite": False,
                                "nonfinite_values": 3, "grad_rel_err": None, "loss_scale": 256.0, "backoffs": 0,
                                "why": "NaN/Inf in the forward", "culprit": None, "params_off": {}})

    def policy_dict(self):
        return {"device_type": "cpu", "emulated": False}

    def run(self, *a, **k):
        raise AssertionError("a step whose float64 run is non-finite is not searched")


def test_fix_stops_on_the_typed_reference_status_whatever_the_note_says():
    r = fix_mod.find_fix(None, prepared=_Stub(reference_finite=False))
    assert r.search is fix_mod.FixSearch.NONE and r.fix is None and r.trials == []
    assert r.notes == ["REWORDED: float64 itself went NaN"]  # the words pass through untouched


def test_the_saved_steps_check_reads_the_typed_reference_status(monkeypatch):
    """`try_on_saved_steps` says "non-finite too" of another step from its
    `reference_finite`, not from the wording of its note."""
    for finite, want in ((False, "the float64 replay is non-finite too: no precision setting saves it"),
                         (True, "with m in float32: NaN/Inf in the forward")):
        monkeypatch.setattr(saved_steps, "other_bundles", lambda p: [(1, "/nonexistent/step1")])
        monkeypatch.setattr(saved_steps, "prepare_like", lambda p, path, **k: _Stub(reference_finite=finite))
        out = saved_steps.try_on_saved_steps(_Stub(True), ["m"])
        assert out[1] == saved_steps.StepCheck(1, saved=False, saved_as_recorded=False, why=want)
        assert out[1].to_dict() == {"step": 1, "saved": False, "saved_as_recorded": False, "why": want}


def test_the_producers_note_is_one_constant():
    assert whatif.REFERENCE_NONFINITE_NOTE.startswith("the float64 reference is itself non-finite")


def test_a_trial_is_read_into_typed_fields_and_its_failed_check_is_an_enum():
    from amp_postmortem.whatif import NotSavedBy, Trial
    base = {"saved": False, "finite": True, "forward_finite": True, "backward_finite": True,
            "nonfinite_values": 0, "params_off": {}, "culprit": None, "why": "w", "modules": ["a"]}
    cases = [({**base, "saved": True}, NotSavedBy.NOTHING, ""),
             ({**base, "finite": False, "backward_finite": False, "nonfinite_values": 4}, NotSavedBy.NONFINITE,
              "NaN/Inf"),
             ({**base, "params_off": {"w": 2.0, "b": 1.0}}, NotSavedBy.PARAMS_OFF, "2 param grads off"),
             ({**base, "culprit": {"name": "q", "phase": "backward"}}, NotSavedBy.BROKEN_MODULE,
              "q broken (backward)")]
    for d, by, words in cases:
        assert Trial.of(d).not_saved_by is by
        assert fix_mod.not_saved_by(d) == words   # the words come from the enum, in one place
    t = Trial.of(cases[1][0])
    assert t.nonfinite_phases == ["backward"] and t.modules == ("a",) and Trial.of(t) is t
    assert fix_mod._verdict(cases[1][0]) == "NON-FINITE in the backward (4 NaN/Inf values)"


def test_recommend_decides_avoid_mixed_precision_and_bf16_as_enums():
    from amp_postmortem.advice.decisions import Bf16Outcome, NoFp16Config, bf16_outcome, no_fp16_config
    from amp_postmortem.whatif.window_check import WindowStatus
    facts = dict(unstable=False, reference_finite=True, data_problem=False, fp16_ok=False, bf16_ok=False,
                 precision="fp16")
    assert no_fp16_config(**facts) is NoFp16Config.FLOAT32
    assert no_fp16_config(**{**facts, "unstable": True, "bf16_ok": True}) is NoFp16Config.INSTABILITY
    assert no_fp16_config(**{**facts, "bf16_ok": True}) is NoFp16Config.USE_BF16
    for off in ("reference_finite", "data_problem", "fp16_ok"):
        flipped = {**facts, off: not facts[off], "unstable": True}
        assert no_fp16_config(**flipped) is None
    fails = SimpleNamespace(status=WindowStatus.FAILS, failed_at=7)
    assert bf16_outcome(True, True, fails) is Bf16Outcome.STEP_ONLY
    assert bf16_outcome(True, False, None) is Bf16Outcome.AVOIDS_UNCONFIRMED
    assert bf16_outcome(True, True, SimpleNamespace(status=WindowStatus.VERIFIED)) is Bf16Outcome.AVOIDS
    assert bf16_outcome(False, True, None) is Bf16Outcome.DOES_NOT_AVOID


class _BeyondFloat64(__import__("torch").nn.Module):
    """Its output is Inf in float64 too: no precision setting fixes it."""

    def __init__(self):
        super().__init__()
        self.lin = __import__("torch").nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(x) * 1e200 * 1e200


def test_recommend_decides_check_data_from_the_typed_status_when_the_note_is_reworded(tmp_path, monkeypatch,
                                                                                      one_torch_thread):
    import torch

    import whatif_runs as W
    from amp_postmortem.advice import recommend
    from amp_postmortem.reading.loader import load_run
    torch.manual_seed(0)
    run = W.record(tmp_path / "beyond_fp64", _BeyondFloat64(), steps=1)
    monkeypatch.setattr(whatif, "REFERENCE_NONFINITE_NOTE", "REWORDED: float64 overflowed as well")
    r = recommend(load_run(run), model=_BeyondFloat64)
    assert r.kinds()[0] == "check_data"
    assert "the float64 replay is non-finite too: no precision setting fixes it" in r.get("check_data").evidence
    assert "REWORDED: float64 overflowed as well" in r.notes   # the words pass through untouched
    assert "keep_fp32" not in r.kinds() and "avoid_mixed_precision" not in r.kinds()


def test_recommend_decides_the_recorded_origin_as_an_enum():
    """The recorded branch decides where the forward overflow was born
    (`recorded_origin`) before any words are made; its words come from
    the `recorded_*_recommendation` functions."""
    from amp_postmortem.advice import RecommendationKind, Source
    from amp_postmortem.advice.decisions import RecordedOrigin, recorded_origin
    from amp_postmortem.advice.words import recorded_check_data_recommendation, recorded_keep_fp32_recommendation

    def fwd(layer, basis="rule"):
        return SimpleNamespace(layer=layer, step=7, message="m", evidence={"origin": {"basis": basis}})
    assert recorded_origin(None) is None
    assert recorded_origin(fwd("blocks.0.attn", "nonfinite_weights")) is RecordedOrigin.WEIGHTS
    assert recorded_origin(fwd("<input>")) is RecordedOrigin.INPUT
    assert recorded_origin(fwd("blocks.0.attn")) is RecordedOrigin.MODULE
    assert recorded_origin(fwd("<loss>")) is RecordedOrigin.OTHER
    assert recorded_origin(fwd(None)) is RecordedOrigin.OTHER
    check = recorded_check_data_recommendation(fwd("<input>"))
    assert (check.kind, check.source, check.data) == (RecommendationKind.CHECK_DATA, Source.RECORDED, {"step": 7})
    keep = recorded_keep_fp32_recommendation(fwd("blocks.0.attn"), "RUN")
    assert keep.to_dict()["kind"] == "keep_fp32" and keep.to_dict()["source"] == "recorded"
    assert keep.data == {"modules": ["blocks.0.attn"], "step": 7} and "--step 7" in keep.action


def test_an_outcome_that_was_a_string_still_equals_and_prints_as_it():
    """The Python API's results held these outcomes as strings before they
    were enums: a user's `scale(run).status == "collapse"` and the f-string
    around it must keep working (`names.Word`)."""
    from amp_postmortem.advice import RecommendationKind, Source
    from amp_postmortem.analyses.scale import ScaleStatus
    from amp_postmortem.names import BackwardFrom, BackwardStart, Word
    from amp_postmortem.whatif.bisect import BisectKind
    from amp_postmortem.whatif.fix import FixSearch
    from amp_postmortem.whatif.op_fix import ChosenBy
    from amp_postmortem.whatif.scale_result import ScalePosition, WindowMethod
    for enum_type in (ScaleStatus, RecommendationKind, Source, BackwardStart, BackwardFrom, BisectKind,
                      FixSearch, ChosenBy, ScalePosition, WindowMethod):
        assert issubclass(enum_type, Word), enum_type
        for member in enum_type:
            assert member == member.value and f"{member}" == member.value and str(member) == member.value
            assert json.loads(json.dumps(member)) == member.value
