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
             "amp_postmortem")


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
