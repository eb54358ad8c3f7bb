"""Dtype policies that disagree: a Keras run whose variables are held in
float16 or bfloat16, or whose layers compute under another reduced
precision than the model's policy says.

The Keras recorder writes the model's dtype policy and every layer's at
attach time (the manifest's `dtype_policies`); the variables' own dtypes
are the manifest's `params` (a variable made with `add_weight(dtype=...)`
keeps its dtype whatever the policy). Two conditions, each a typed
`PolicyProblem`:

- `LOW_PRECISION_VARIABLES`: a variable held in float16/bfloat16 (the
  `float16` policy, or a layer's `dtype="float16"`): there is no float32
  master copy, so updates below half an ulp of the weight round away, and
  float16 variables overflow at 65504. `mixed_float16` keeps float32
  variables and computes in float16.
- `LAYER_POLICY_DIFFERS`: a layer computes in a reduced precision other
  than the model's compute dtype (a layer built before
  `set_global_policy`, or given its own `dtype=`). `compile` wraps the
  optimizer in a `LossScaleOptimizer` only when the model's own policy is
  `mixed_float16`, so float16 layers inside a float32 model train with no
  loss scale. A float32 layer inside a mixed model is not flagged: Keras'
  guide keeps a final softmax in float32 on purpose.

`dtype_policy_problems(run)`: a run without the manifest key (PyTorch,
Flax, runs recorded before it) has no problems.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from recorders.format import schema

from ..names import Word

REDUCED = ("float16", "bfloat16")


class PolicyProblem(Word):
    LOW_PRECISION_VARIABLES = "low_precision_variables"
    LAYER_POLICY_DIFFERS = "layer_policy_differs"


@dataclass
class PolicyDisagreement:
    model_policy: str | None = None
    model_compute_dtype: str | None = None
    # {layer: [dtypes of its float16/bfloat16 variables]}, in manifest order.
    low_precision_variables: dict = field(default_factory=dict)
    # {layer: its policy name}: reduced compute other than the model's.
    differing_layers: dict = field(default_factory=dict)

    @property
    def problems(self) -> list[PolicyProblem]:
        return ([PolicyProblem.LOW_PRECISION_VARIABLES] if self.low_precision_variables else []) + (
            [PolicyProblem.LAYER_POLICY_DIFFERS] if self.differing_layers else [])

    @property
    def layers(self) -> list[str]:
        """Every layer named, variables' first, each once."""
        return list(dict.fromkeys([*self.low_precision_variables, *self.differing_layers]))

    def to_dict(self) -> dict:
        return {"model_policy": self.model_policy, "model_compute_dtype": self.model_compute_dtype,
                "problems": [p.value for p in self.problems],
                "low_precision_variables": self.low_precision_variables,
                "differing_layers": self.differing_layers}


def dtype_policy_problems(run) -> PolicyDisagreement:
    """What the run's manifest says of its dtype policies (see the module's doc)."""
    policies = run.manifest.get(schema.DTYPE_POLICIES_KEY)
    if not isinstance(policies, dict):
        return PolicyDisagreement()
    model = policies.get("model") or {}
    out = PolicyDisagreement(model_policy=model.get("policy"), model_compute_dtype=model.get("compute_dtype"))
    layer_names = [str(layer.get("name")) for layer in policies.get("layers") or []]
    for p in run.manifest.get("params") or []:
        if p.get("dtype") in REDUCED:
            layer = _owner(str(p.get("name")), layer_names)
            dtypes = out.low_precision_variables.setdefault(layer, [])
            if p["dtype"] not in dtypes:
                dtypes.append(p["dtype"])
    for layer in policies.get("layers") or []:
        compute = layer.get("compute_dtype")
        if compute in REDUCED and compute != out.model_compute_dtype:
            out.differing_layers[str(layer.get("name"))] = str(layer.get("policy"))
    return out


def _owner(param: str, layers: list[str]) -> str:
    """The deepest layer whose name prefixes the variable's (`block.d1.kernel`
    -> `block.d1`), else the variable's parent path."""
    owners = [name for name in layers if param.startswith(name + ".")]
    return max(owners, key=len) if owners else (param.rpartition(".")[0] or param)
