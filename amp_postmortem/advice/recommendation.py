"""What `recommend` returns: each `Recommendation` (its `RecommendationKind`,
what it rests on: `Source`, its evidence and code) and the list of them,
`Recommendations`, the command's result."""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from ..names import Word
from ..result import CommandResult


class RecommendationKind(Word):
    """What a recommendation recommends (the module's doc), in the order
    they are listed; `value` is the `--json` "kind"."""
    CHECK_DATA = "check_data"
    CHECK_WEIGHTS = "check_weights"
    TRAINING_INSTABILITY = "training_instability"
    KEEP_FP32 = "keep_fp32"
    ADD_GRAD_SCALER = "add_grad_scaler"
    GRADIENT_DRIFT = "gradient_drift"
    USE_BF16 = "use_bf16"
    SCALER_SETTINGS = "scaler_settings"
    # the remedies of lost updates (`analyses.updates.UpdateRemedy`, the same strings)
    FP32_MASTER_WEIGHTS = "fp32_master_weights"
    LARGER_LEARNING_RATE = "larger_learning_rate"
    STOCHASTIC_ROUNDING = "stochastic_rounding"
    AVOID_MIXED_PRECISION = "avoid_mixed_precision"
    NO_CHANGE = "no_change"

ORDER = tuple(RecommendationKind)


class Source(Word):
    """What a recommendation rests on; `value` is the `--json` "source"."""
    REPLAY = "replay"              # what-if replays of saved steps
    RECORDED = "recorded"          # the recorded statistics alone


@dataclass
class Recommendation:
    kind: RecommendationKind
    action: str
    evidence: list                 # sentences, each citing numbers
    source: Source
    code: str | None = None
    data: dict = field(default_factory=dict)
    # Checked by replaying the run's saved steps; else `why` not.
    verified: bool = False
    why: str | None = None

    def to_dict(self) -> dict:
        return {"kind": self.kind.value, "action": self.action, "evidence": self.evidence, "source": self.source.value,
                "code": self.code, "data": self.data, "verified": self.verified, "why": self.why}


@dataclass
class Recommendations(CommandResult):
    run: str
    step: int | None               # the replayed step, when a replay ran
    replayed: bool
    recommendations: list
    notes: list = field(default_factory=list)
    show_table = False

    def kinds(self) -> list[str]:
        """The recommendations' kinds as their `--json` strings."""
        return [r.kind.value for r in self.recommendations]

    def get(self, kind: RecommendationKind | str) -> Recommendation | None:
        """The recommendation of `kind` (the enum or its `--json` string)."""
        kind = RecommendationKind(kind)
        return next((r for r in self.recommendations if r.kind is kind), None)

    def document(self) -> dict:
        from recorders.format import plain
        return plain({"run": self.run, "step": self.step, "replayed": self.replayed,
                      "recommendations": [r.to_dict() for r in self.recommendations], "notes": self.notes})

    def table(self) -> pd.DataFrame:
        return pd.DataFrame([{"kind": r.kind.value, "source": r.source.value, "verified": r.verified,
                              "action": r.action, "evidence": " | ".join(r.evidence)}
                             for r in self.recommendations],
                            columns=["kind", "source", "verified", "action", "evidence"])

    def lines(self) -> list[str]:
        head = (f"recommendations for {self.run}" +
                (f" (replayed step {self.step})" if self.replayed else " (recorded statistics only)"))
        out = [head]
        for i, r in enumerate(self.recommendations, 1):
            out += ["", f"{i}. [{r.kind.value}] {r.action}"]
            if not r.verified and r.why:
                out.append(f"   ({'not verified' if r.source is Source.REPLAY else 'estimate, not verified'}: {r.why})")
            out += [f"   evidence ({r.source.value}): {e}" for e in r.evidence]
            if r.code:
                out += ["   " + line for line in r.code.splitlines()]
        out += [f"note: {n}" for n in self.notes]
        return out
