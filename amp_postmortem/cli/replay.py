"""`amp-postmortem replay`: the CLI face of `amp_postmortem.replay`.

No logic here: parse the options, call the API function, return the result
to the shared output path (`output.py`: a readable report and table,
`--json`, `--csv`). Errors become one `Error: ...` line in `cli.main`.
Registered in `cli.py`.
"""
from __future__ import annotations

from pathlib import Path

import click

import amp_postmortem as api

from ..names import DEVICES, POLICIES, PRECISIONS
from .output import RUN_LOCATION, api_default, output_options

MODEL_HELP = ("package.module:factory or path/to/file.py:factory returning the model, or a "
              "transformers class such as transformers:AutoModelForCausalLM (built from the config "
              "saved with the run), or 'recorded': import and build the class the run recorded, from "
              "installed code only (never the working directory or the run). Required: a run's data "
              "never chooses the code a replay runs.")
LOSS_FN_HELP = ("package.module:function or path/to/file.py:function, called as loss_fn(output, micro_batch), "
                "giving the loss when the model does not return it (and a finite backward start when the "
                "saved gradient of the loss is NaN/Inf). For a Flax bundle: the step's loss, called with the "
                "recorded step's arguments (the model in its place, None for the optimizer), so the backward "
                "is replayed too.")


def _precisions(ctx, param, value):
    names = [p.strip() for p in value.split(",") if p.strip()]
    bad = [p for p in names if p not in PRECISIONS]
    if bad or not names:
        raise click.BadParameter(f"{(bad or [value])[0]!r} is not one of {', '.join(PRECISIONS)}")
    return names


@click.command("replay")
@click.argument("run", metavar="RUN", type=RUN_LOCATION)
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="The rank whose bundle to replay (default: the lowest rank that saved one); in a sharded "
                   "job, whose micro-batches, on the weights made whole from every rank's bundle of the step.")
@click.option("--step", type=int, default=None,
              help="The step whose bundle to replay (default: the bundle of the first failure, "
                   "as `summary` names it; the output says which).")
@click.option("--model", metavar="SPEC", default=None, help=MODEL_HELP)
@click.option("--loss-fn", metavar="SPEC", default=None, help=LOSS_FN_HELP)
@click.option("--device", type=click.Choice(DEVICES), default=api_default(api.replay, "device"), show_default=True,
              help="Where to replay.")
@click.option("--precisions", default=",".join(api_default(api.replay, "precisions")), show_default=True,
              callback=_precisions, help="Comma-separated precisions; fp64, the reference, always runs.")
@click.option("--policy", type=click.Choice(POLICIES), default=api_default(api.replay, "policy"), show_default=True,
              help="Autocast policy of the fp16/bf16 runs: the recording device's, CUDA's or the CPU's.")
@click.option("--anomaly", is_flag=True,
              help="Re-run the failing precision under torch.autograd.detect_anomaly and say what it found: "
                   "the op, the first backward op holding NaN/Inf, or why anomaly mode raised nothing.")
@click.option("--trace", "trace", metavar="MODULE", multiple=True,
              help="Also trace this module (its dotted name, repeatable) op by op: per aten op its dtype, "
                   "output absmax and NaN/Inf, error vs float64 and the model's source line. The culprit "
                   "is always traced.")
@output_options(csv=True)
def replay_command(run, **options):
    """Replay a saved step in fp64/fp32/fp16/bf16 and name the culprit: the
    first module (forward, then backward) whose own arithmetic breaks when
    fed the float64 run's inputs rounded as the precision would. Says first
    whether the replay reproduced the recorded step, and, from an op trace of
    the culprit, the first operation (and source line) whose output turned
    NaN/Inf from finite inputs. Without --step: the bundle of the first
    failure (else the most telling one saved), and it says so.

    \b
        amp-postmortem replay runs/exp1 --model mypkg.models:build
        amp-postmortem replay runs/exp1 --step 1234 --model mypkg.models:build
        amp-postmortem replay runs/exp1 --step 1234 --model train.py:make_model --precisions fp16,bf16 --json
        amp-postmortem replay runs/exp1 --step 1234 --model mypkg.models:build --trace blocks.1.attn
    """
    return api.replay(run, **options)
