"""The recorder core imports only torch, numpy, pyarrow and the standard
library: a training job never pays for the analyzer or for a framework it
does not use; `recorders.integrations` imports its framework only in the
module a user picks."""
from __future__ import annotations

import subprocess
import sys

# Not pandas: pyarrow imports it by itself when it is installed (at the
# first Parquet write), whatever the recorder does.
FORBIDDEN = ("transformers", "accelerate", "lightning", "pytorch_lightning", "scipy", "click",
             "amp_postmortem", "tensorflow", "keras", "jax", "flax", "optax")


def test_recording_imports_no_framework_and_no_analyzer(tmp_path):
    code = (
        "import sys, torch\n"
        "import recorders, recorders.integrations, recorders.loss_tap, recorders.unwrap\n"
        "from recorders import AmpRecorder\n"
        "m = torch.nn.Linear(2, 1)\n"
        f"with AmpRecorder({str(tmp_path / 'run')!r}, m, bundles=False) as rec:\n"
        "    m(torch.ones(1, 2)).sum().backward(); rec.step()\n"
        f"print(sorted(n for n in {FORBIDDEN!r} if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------- the same rule, statically
# (every module, lazy imports included, not only what one recording runs)
CORE_ALLOWED = {"torch", "numpy", "pyarrow", "recorders"} | set(sys.stdlib_module_names)
# Edge code that lives in a core module: imported inside the function that
# needs it, so a job that does not use it never imports it.
LAZY_EDGE = {"format/locations.py": {"fsspec"}}  # the filesystem of a URI pyarrow does not open itself
FRAMEWORKS = {"integrations/transformers.py": {"transformers"},
              "integrations/lightning.py": {"lightning", "pytorch_lightning"},
              # The recorders of other frameworks: each imported only by who records with it.
              "keras_recorder.py": {"keras", "tensorflow", "jax"},
              "keras_loss_scaling.py": {"keras", "tensorflow"},  # the Keras recorder's loss-scaling probe
              "flax_recorder.py": {"jax", "flax", "optax"},
              "jax_grad_tap.py": {"jax"},  # both recorders' JAX gradient tap
              "jax_program.py": {"jax"},  # the float16 reductions of a JAX step's program
              # How those recorders name layers and variables, with the run format.
              "format/keras_names.py": {"keras"},
              "format/flax_names.py": {"jax", "flax"}}


def _foreign_imports():
    """(file, line, top-level package, lazy) of every import in recorders/
    of a package that is not the core's."""
    from import_graph import module_imports
    from test_readme import REPO
    package = REPO / "recorders"
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        for line, module, lazy in module_imports(path, package):
            top = module.split(".")[0]
            if top not in CORE_ALLOWED:
                yield rel, line, top, lazy


def test_recorders_import_only_torch_numpy_pyarrow_and_the_standard_library():
    wrong = [f"recorders/{rel}:{line} imports {top}" + (" (lazily)" if lazy else "")
             for rel, line, top, lazy in _foreign_imports()
             if not (lazy and top in LAZY_EDGE.get(rel, ())) and top not in FRAMEWORKS.get(rel, ())]
    assert not wrong


def test_each_integration_imports_only_its_own_framework():
    seen = {(rel, top) for rel, _, top, _ in _foreign_imports() if rel.startswith("integrations/")}
    # integrations/__init__.py imports none; no core module imports an
    # integration (tests/test_api.py: the layers import only downward)
    assert seen <= {(rel, top) for rel, tops in FRAMEWORKS.items() for top in tops}
