"""`amp-postmortem replay`: the CLI face of `amp_postmortem.replay.replay`.

No logic here: parse the options, call `replay(...)`, return the result to
the shared output path (`output.py`: a readable report and table, `--json`,
`--csv`). Library errors become `Error: ...` and exit code 2 in `cli.main`.
Registered in `cli.py`.
"""
from __future__ import annotations

import click

from pathlib import Path

from .output import LOCAL_RUN_LOCATION, output_options

PRECISIONS = ("fp64", "fp32", "fp16", "bf16")


def _precisions(ctx, param, value):
    names = [p.strip() for p in value.split(",") if p.strip()]
    bad = [p for p in names if p not in PRECISIONS]
    if bad or not names:
        raise click.BadParameter(f"{(bad or [value])[0]!r} is not one of {', '.join(PRECISIONS)}")
    return names


@click.command("replay")
@click.argument("run_dir", metavar="RUN", type=LOCAL_RUN_LOCATION)
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="The rank whose bundle to replay (default: the lowest rank that saved one).")
@click.option("--step", type=int, required=True, help="The step whose bundle to replay.")
@click.option("--model", "model_spec", default=None, metavar="SPEC",
              help="package.module:factory or path/to/file.py:factory returning the model "
                   "(default: the recorded class, built with no arguments).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where to replay.")
@click.option("--precisions", default=",".join(PRECISIONS), show_default=True, callback=_precisions,
              help="Comma-separated precisions; fp64, the reference, always runs.")
@click.option("--policy", type=click.Choice(["recorded", "cuda", "cpu"]), default="recorded",
              show_default=True,
              help="Autocast policy of the fp16/bf16 runs: the recording device's, CUDA's or the CPU's.")
@click.option("--anomaly", is_flag=True,
              help="Re-run the failing precision under torch.autograd.detect_anomaly and say what it found: "
                   "the op, the first backward op holding NaN/Inf, or why anomaly mode raised nothing.")
@output_options(csv=True)
def replay_command(run_dir, rank, step, model_spec, device, precisions, policy, anomaly):
    """Replay a saved step in fp64/fp32/fp16/bf16 and name the culprit: the
    first module (forward, then backward) whose own arithmetic breaks when
    fed the float64 run's inputs rounded as the precision would. Says first
    whether the replay reproduced the recorded step.

    \b
        amp-postmortem replay runs/exp1 --step 1234 --model mypkg.models:build
        amp-postmortem replay runs/exp1 --step 1234 --model train.py:make_model --precisions fp16,bf16 --json
    """
    from .replay import replay
    return replay(run_dir, step, rank=rank, model=model_spec, device=device, precisions=precisions,
                  policy=policy, anomaly=anomaly)
