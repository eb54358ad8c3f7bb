"""The Keras replay test's run, made and replayed in a process of its own
(Keras picks its backend at import): `KERAS_BACKEND=tensorflow|jax python
tests/keras_replay_runs.py OUT_DIR` records `OUT_DIR/run` (mixed_float16,
`tests/replay_models.keras_model`; steps 3 and 4 feed inputs of 5.0, whose
`exp` overflows float16 only) and writes `OUT_DIR/replay.json`, what
`amp-postmortem replay OUT_DIR/run --step 3 --model
tests/replay_models.py:keras_model --json` prints; and `OUT_DIR/grad`
(`keras_sqrt_model`: from step 3 its backward overflows float16, its
forward does not; step 3 saved by number) and `OUT_DIR/grad.json`, its
replay."""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from amp_postmortem.cli import main as cli  # noqa: E402
from recorders.host_bundle import BundleTriggers  # noqa: E402
from recorders.keras_recorder import KerasRecorder  # noqa: E402
from replay_models import keras_model  # noqa: E402
from replay_models import keras_sqrt_model as sqrt_model  # noqa: E402


def main(out: str) -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((40, 4)) * 0.1).astype("float32")
    x[24:] = 5.0
    y = (rng.standard_normal((40, 1)) * 0.1).astype("float32")
    net = keras_model()
    net.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3)), loss="mse")
    with KerasRecorder(f"{out}/run", net) as rec:
        net.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[rec])
    # The backward's overflow: inputs of 2.5e-7 from step 3 on (d1's sums 1e-6,
    # positive: its kernel is ones), whose square root's gradient times the
    # scale passes 65504; step 3 saved by its number (the forward is finite).
    keras.utils.set_random_seed(0)
    small = np.abs(x[:24]).astype("float32")
    tiny = np.concatenate([small, np.full((16, 4), 2.5e-7, "float32")])
    net = sqrt_model()
    net.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3)), loss="mse")
    with KerasRecorder(f"{out}/grad", net, bundles=BundleTriggers(steps=(3,))) as rec:
        net.fit(tiny, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[rec])
    keras.mixed_precision.set_global_policy("float32")
    for run, factory, name in (("run", "keras_model", "replay.json"), ("grad", "keras_sqrt_model", "grad.json")):
        result = CliRunner().invoke(cli, ["replay", f"{out}/{run}", "--step", "3", "--model",
                                          f"{HERE / 'replay_models.py'}:{factory}", "--json"])
        Path(out, name).write_text(result.output if result.exit_code == 0 else
                                   f'{{"exit_code": {result.exit_code}, "output": {result.output!r}}}')


if __name__ == "__main__":
    main(sys.argv[1])
