"""The benchmarks, at a tiny size: they keep working. Not timed tests: the
figures live in benchmarks/RESULTS.md, measured on a stated machine."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import analyzer_scale  # noqa: E402
import compile_overhead  # noqa: E402
import recorder_hot_path  # noqa: E402
import recorder_overhead  # noqa: E402
import recorder_overhead_cuda  # noqa: E402
import report_scale  # noqa: E402
import watch_latency  # noqa: E402


def test_recorder_overhead_smoke_reports_every_dtype_and_variant(tmp_path):
    out = tmp_path / "overhead.json"
    assert recorder_overhead.main(["--smoke", "--memory-steps", "0", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["dtypes"]) == {"fp32", "bf16", "fp16"}
    for r in doc["dtypes"].values():
        assert set(r["variants"]) == {"baseline", "default", "full", "paused"}
        for v in r["variants"].values():
            assert v["ratio"] > 0
            assert v["losses_identical_to_baseline"] is True  # recording changes no bit
            assert v["ratio_mean"] > 0
            assert set(v["gc"]["collections_per_step"]) == {"0", "1", "2"} and v["gc"]["ms_per_step"] >= 0
        assert r["variants"]["full"]["tiers"] == {"full": 2}
        assert r["variants"]["default"]["buffers"]["queue_max_steps"] > 0
        assert r["variants"]["default"]["buffers"]["writer_buffer_bytes_per_step"] > 0
    # The same run measures the diverging job, the hook profile and the cost per module.
    assert set(doc["diverging"]) == {"fp32", "bf16"}  # fp16 takes ~12 s a step here: left out
    for d in doc["diverging"].values():
        assert d["first_nonfinite_loss_step"] == 2 and d["ratio_whole_run"] > 0
        assert sum(d["tiers"].values()) == d["steps"] == 4
        assert d["losses_identical_to_baseline"] is True
    assert any(f["function"].startswith("collectors/") for f in doc["hook_profile"]["top_functions"])
    assert doc["module_cost"]["watched_modules"] == 9 and "us_per_watched_module" in doc["module_cost"]
    # ... and the statistics' reductions alone: one per distinct tensor of a cheap-tier step.
    for dtype, r in doc["reductions"].items():
        assert r["tiers"] == {"cheap": 1} and r["reductions_per_step"] > 0 and r["values_per_step"] > 0
        # A measured share: no bound here (a loaded CI machine read 2.18 in smoke mode).
        assert r["reduction_share_of_baseline_step"] > 0


def test_recorder_overhead_leaves_variant_watches_no_container(tmp_path):
    out = tmp_path / "leaves.json"
    assert recorder_overhead.main(["--smoke", "--dtypes", "fp32", "--variants", "baseline,default,leaves",
                                   "--memory-steps", "0", "--diverging-steps", "0", "--profile-steps", "0",
                                   "--reduction-steps", "0", "--module-layers", "0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["dtypes"]["fp32"]["variants"]
    assert rows["leaves"]["losses_identical_to_baseline"] is True
    assert 0 < rows["leaves"]["raw_rows_per_step"] < rows["default"]["raw_rows_per_step"]


def test_recorder_overhead_memory_child_reports_peak_rss():
    r = recorder_overhead.memory_child("fp32", "default", 1, recorder_overhead.SMOKE_SIZE, 0)
    assert r["peak_rss_mib"] > 0


def test_recorder_hot_path_smoke_measures_every_variant_the_floor_and_the_targets(tmp_path):
    out = tmp_path / "hot.json"
    assert recorder_hot_path.main(["--smoke", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["machine"]["cpu_model"]
    lb = doc["launch_bound"]["fp32"]
    # 3 blocks of 5 modules, the stack and the root.
    assert lb["watched_modules"] == 17 and set(lb["variants"]) == set(recorder_hot_path.LAUNCH_VARIANTS)
    for row in lb["variants"].values():
        assert row["ratio"] > 0 and row["cpu_ratio"] > 0 and "us_per_module" in row
        assert row["losses_identical_to_plain"] is True  # no hook changes a bit
    assert lb["variants"]["recorder_full"]["tiers"] == {"full": 2}
    assert "writer_cpu_ms_per_step" in lb["variants"]["recorder"]
    cb = doc["compute_bound"]
    assert set(cb["variants"]) == set(recorder_hot_path.GPT_VARIANTS)
    assert all(row["losses_identical_to_plain"] is True for row in cb["variants"].values())
    floor = cb["floor"]
    assert floor["tensors"] > 0 and floor["values"] > 0
    assert all(floor[k]["ratio"] > 1 for k in recorder_hot_path.FLOORS)
    dv = doc["diverging"]
    assert dv["first_nonfinite_loss_step"] == 2 and dv["losses_identical_to_plain"] is True
    assert sum(dv["tiers"].values()) == dv["steps"] == 4
    # Every target of issue 27 is reported beside its figure, none asserted.
    assert len(doc["targets"]) == 4 and all(isinstance(t["met"], bool) for t in doc["targets"])


def test_recorded_tensors_are_every_output_gradient_and_parameter_gradient_once():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    x = torch.randn(5, 3)
    kept = recorder_hot_path.recorded_tensors(model, lambda m, b: m(b).square().mean(), x, torch.float32)
    # Outputs: Linear 0 and Linear 1 (the Sequential's is Linear 1's);
    # gradients of both outputs; Linear 1's gradient to its input is the
    # gradient of Linear 0's output; Linear 0's input needs none; 4 parameter
    # gradients.
    assert len(kept) == 2 + 2 + 4
    assert sum(t.numel() for t in kept) == (5 * 4 + 5 * 2) * 2 + (4 * 3 + 4 + 2 * 4 + 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_cuda_benchmark_exits_cleanly_without_cuda(capsys):
    assert recorder_overhead_cuda.main(["--smoke"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["skipped"] == "CUDA not available"
    assert "CUDA is not available" in captured.err


def test_analyzer_scale_smoke_finds_the_planted_nan_and_reads_few_shards(tmp_path):
    out = tmp_path / "scale.json"
    assert analyzer_scale.main(["--smoke", "--run-dir", str(tmp_path / "run"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    run = doc["run"]
    assert run["tensor_rows"] == 400 * 41 and run["shards"] == 4
    assert doc["cli"]["nans"]["origin"]["name"] == run["nan_layer"]
    assert doc["cli"]["nans"]["origin"]["step"] == run["nan_at"]
    # Only the last shard holds non-finite rows: the footers rule out the rest.
    assert doc["functions"]["nans_shards_opened"] == run["shards_with_nonfinite"] == 1
    assert doc["naive_pandas"]["rows"] == run["tensor_rows"]


def test_analyzer_scale_memory_smoke_measures_ranges_and_summary_on_a_wide_and_a_long_run(tmp_path):
    out = tmp_path / "memory.json"
    assert analyzer_scale.main(["--memory", "--smoke", "--run-dir", str(tmp_path), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    wide, long = doc["runs"]["wide"], doc["runs"]["long"]
    assert wide["tensor_rows"] == long["tensor_rows"] == 8_000 and wide["shards"] < long["shards"]
    for command in ("ranges", "summary"):
        assert wide[command]["peak_rss_mib"] > 0 and doc[f"{command}_wide_over_long"] > 0


def test_synthetic_scale_series_collapses_late_and_probes_when_it_grows():
    before, after, tracker, skipped = analyzer_scale.scale_series(10_000, 9_000, 2_000)
    assert skipped[:9_000].sum() == 4  # a probe overflow after each growth
    assert skipped[2_000] and after[1_999] == 2.0 ** 17 and after[2_000] == 2.0 ** 16
    assert list(skipped[9_000:].nonzero()[0] + 9_000) == [9_000, 9_600]
    assert after[-1] == 2.0 ** 14


def test_replay_timing_smoke_reports_a_multiple_of_a_training_step(tmp_path):
    import replay_timing
    out = tmp_path / "replay.json"
    assert replay_timing.main(["--smoke", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["train_step_s"] > 0 and doc["replay_x_train_step"] > 0


def test_report_scale_smoke_draws_the_long_run_page_without_errors(tmp_path):
    out = tmp_path / "report.json"
    assert report_scale.main(["--smoke", "--run-dir", str(tmp_path / "run"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["run"]["steps"] == report_scale.SMOKE["steps"]
    r = doc["report"]
    assert r["downsampled"] and r["browser_state"] == "ready" and r["browser_errors"] == []
    assert all(points > 0 for points in r["plots"].values()) and r["mib"] < 6

def test_distributed_scan_smoke_agrees_across_engines_and_opens_one_shard(tmp_path):
    import distributed_scan
    out = tmp_path / "ranks.json"
    assert distributed_scan.main(["--smoke", "--run-dir", str(tmp_path / "run"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    run = doc["run"]
    assert run["ranks"] == 6 and run["tensor_rows"] == 6 * 40 * 9 and run["shard_pairs"] == 24
    assert doc["dask_matches_local"] is True
    for r in doc["results"]:
        assert r["rc"] == 0
        if r["command"] == "nans":
            assert (r["origin"], r["origin_rank"], r["origin_step"]) == (run["nan_layer"], 4, 33)
            # Indexed or not, only the one shard holding the NaN is opened.
            assert r["shards_scanned"] == run["shards_with_nonfinite"] == 1
            assert r["shards_total"] == 24
        else:
            assert r["findings"] == ["nonfinite"]


def test_compile_overhead_smoke_reports_no_recompilation(tmp_path):
    out = tmp_path / "compile.json"
    assert compile_overhead.main(["--smoke", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    variants = doc["variants"]
    assert set(variants) == {"compiled", "compiled_again", "after", "before", "before_rows", "graph_breaks_total",
                             "floor_aminmax"}
    assert variants["floor_aminmax"]["tensors"] > 0 and variants["floor_aminmax"]["ratio"] > 1
    assert variants["graph_breaks_total"] == 0
    for v in compile_overhead.VARIANTS:
        assert variants[v]["recompiles_after_warmup"] == 0 and variants[v]["ratio"] > 0
        assert variants[v]["losses_identical_to_compiled"] is True  # eager backend: deterministic
    # compiled_rows=True: every module's rows on the compiled steps; by
    # default the loss and the parameter gradients only.
    assert variants["before_rows"]["tensor_rows_last_step"] > variants["before"]["tensor_rows_last_step"] > 0
    assert doc["dtype"] == "bf16"


def test_compile_overhead_runs_in_float32_for_a_cpu_without_bf16(tmp_path):
    out = tmp_path / "compile.json"
    assert compile_overhead.main(["--smoke", "--dtype", "fp32", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["dtype"] == "fp32"
    assert all(doc["variants"][v]["losses_identical_to_compiled"] is True for v in compile_overhead.VARIANTS)


def test_watch_latency_smoke_alerts_and_closes(tmp_path, capsys):
    out = tmp_path / "watch.json"
    assert watch_latency.main(["--smoke", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["exit_code"] for r in doc["rounds"]] == [1] and doc["rounds"][0]["latency_s"] > 0
    assert doc["clean"]["exit_code"] == 0 and doc["clean"]["watch_cpu_s"] > 0


def test_the_lean_bound_reduces_every_output_gradient_and_parameter_gradient_of_a_step():
    """The `lean` variant is a bound only if it does the rows' work: one
    absmax per module output, per gradient its nodes receive and hand back,
    per parameter gradient, every step."""
    import torch
    torch.manual_seed(0)
    model = recorder_hot_path.common.deep_narrow(2, 4)
    lean = recorder_hot_path.LeanHooks(model)
    x = torch.randn(3, 4)
    model(x).square().mean().backward()
    lean.step()
    modules = sum(1 for _ in model.modules())
    params = sum(1 for _ in model.parameters())
    # Each output and its node's received gradient, its handed-back ones, the parameters'.
    assert lean.absmax_rows >= 2 * modules + params
    assert lean.pending == []


def test_sentinel_cost_smoke_measures_every_job_and_variant_and_changes_no_bit(tmp_path):
    import sentinel_cost
    out = tmp_path / "sentinel.json"
    assert sentinel_cost.main(["--smoke", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["jobs"]) == set(sentinel_cost.JOBS) and doc["machine"]["cpu_model"]
    for job in doc["jobs"].values():
        assert set(job["variants"]) == set(sentinel_cost.VARIANTS)
        assert all(v["same_bits"] for v in job["variants"].values())  # recording changes no bit
        assert job["target"]["default_at_most"] > 1 and isinstance(job["target"]["met"], bool)


def test_sentinel_cost_repeats_report_medians_and_the_judged_range(tmp_path, capsys):
    import sentinel_cost
    out = tmp_path / "sentinel.json"
    assert sentinel_cost.main(["--smoke", "--jobs", "launch", "--repeats", "3", "--json", str(out)]) == 0
    job = json.loads(out.read_text())["jobs"]["launch"]
    runs = job["repeats"]
    assert len(runs) == 3 and set(job["variants"]) == set(sentinel_cost.VARIANTS)
    paired = sorted(r["variants"]["default"]["paired"] for r in runs)
    assert job["variants"]["default"]["paired"] == paired[1] and job["variants"]["plain"]["paired"] == 1.0
    # Four rounds measure no sampled tier: the judged figure is NaN (no claim), in every repeat.
    assert all(math.isnan(r["target"]["judged"]) for r in runs) and math.isnan(job["target"]["judged"])
    assert len(job["target"]["judged_range"]) == 2 and job["target"]["met"] is False
    assert "the median of 3 repeats" in capsys.readouterr().out


def test_sentinel_cost_copies_run_their_writers_on_a_lone_jobs_clock(tmp_path):
    """A copy stepped once a round among 15 runners sees 15 steps' time pass
    between two of its own: its writer's intervals in seconds are scaled by
    that, so that it hands over, fsyncs and rolls per step as a lone job."""
    import sentinel_cost
    from recorders import run_writer
    from recorders.options import WriterOptions
    template, make_opt, dtype, scaler, _, loss_fn = sentinel_cost._job("mlp", True)
    for interleaved in (1, 15):
        for variant in ("default", "every_step"):
            r = sentinel_cost._Runner(variant, template, make_opt, dtype, scaler, loss_fn,
                                      tmp_path / f"{variant}{interleaved}", False, interleaved=interleaved)
            w = r.rec.run_writer
            assert w._hold_back_s == pytest.approx(run_writer.HOLD_BACK_S * interleaved)
            assert w.flush_interval_s == pytest.approx(WriterOptions().flush_interval_s * interleaved)
            assert w.shards.journal.durable_interval_s == pytest.approx(
                WriterOptions().durable_interval_s * interleaved)
            r.close()


def test_xp_recorder_cost_smoke_measures_keras_tf_with_its_probe(tmp_path):
    """One child process (Keras on TensorFlow: its four variants, the
    probe's difference). Keras on JAX shares the Keras child's code; Flax
    is the next test (two tests: xdist's two workers run them at once)."""
    import math

    import xp_recorder_cost
    out = tmp_path / "xp.json"
    assert xp_recorder_cost.main(["--smoke", "--frameworks", "keras_tf", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["machine"]["cpu_model"] and set(doc["frameworks"]) == {"keras_tf"}
    keras_tf = doc["frameworks"]["keras_tf"]
    assert set(keras_tf["variants"]) == set(xp_recorder_cost.VARIANTS["keras_tf"])
    assert all(v["steps"] == 3 and v["median_ms"] > 0 for v in keras_tf["variants"].values())
    assert keras_tf["tiers"]["full"] == {"full": 5}  # every step of the run, warm-up included
    assert math.isfinite(keras_tf["probe"]["ms_per_step"])


def test_xp_recorder_cost_smoke_measures_flax():
    """Flax in this process (jax is imported by the suite anyway)."""
    import xp_recorder_cost
    flax = xp_recorder_cost._flax_child(rounds=2, warmup=1, smoke=True, seed=0)
    assert set(flax["variants"]) == set(xp_recorder_cost.VARIANTS["flax"])
    assert flax["tiers"]["full"] == {"full": 3} and flax["tiers"]["default"]["full"] >= 1
    assert all(v["same_bits"] for v in flax["variants"].values())  # recording changes no bit


def test_sentinel_floor_takes_the_facts_the_default_records(tmp_path, sentinel_mode):
    """The `floor` variant is a fair floor only if it does the work the
    default must do: the same loss, loss scale, stepped flag and gradient
    norm, step for step, on identical copies (the launch-bound model's
    grouped norms and an MLP's single reduction, under a GradScaler)."""
    import copy

    import torch.nn as nn

    import amp_postmortem
    from common import deep_narrow
    from sentinel_floor import FloorSentinel
    from tiny_models import recorder_at, train

    for name, template in (("narrow", deep_narrow(6, 8)),
                           ("mlp", nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))):
        torch.manual_seed(0)
        x, y = torch.randn(4, 8), torch.randn(4, template(torch.randn(1, 8)).shape[-1])
        runs = [train(copy.deepcopy(template), [(x, y)] * 5, lr=1e-2, recorder=make,
                      scaler={"init_scale": 2.0 ** 8, "growth_interval": 1}).rec  # a new scale every step
                for make in (FloorSentinel, recorder_at(tmp_path / name))]
        floor_facts = runs[0].facts
        steps = amp_postmortem.load_run(tmp_path / name).steps.sort_values("step")
        assert len(floor_facts) == len(steps) == 5
        for (loss, scale, stepped, norm), (_, row) in zip(floor_facts, steps.iterrows()):
            assert loss == pytest.approx(row["loss"], rel=1e-6)
            assert scale == row["loss_scale_before"] and stepped
            assert norm == pytest.approx(row["grad_norm"], rel=1e-4)


def test_facts_floor_takes_the_defaults_facts_and_sentinel_parts_times_every_variant(tmp_path):
    """`FactsFloor` (the floor with the default's other facts work, written
    compactly) keeps the floor's facts and adds a row per step, handed to
    its writer thread in blocks, flagging an overflowing step as an event;
    `sentinel_parts.py` runs its variants (parts of the default turned
    off included) and writes its figures with the CPU model."""
    import sentinel_parts
    from common import deep_narrow
    from sentinel_floor import FactsFloor
    from tiny_models import train

    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    batches = [(x, y)] * 4 + [(x * 1e30, y)]  # the fifth step's gradients overflow
    facts = train(deep_narrow(4, 8), batches, lr=1e-2, recorder=FactsFloor,
                  scaler={"init_scale": 2.0 ** 8}).rec
    assert [r[0] for r in facts.rows] == [0, 1, 2, 3, 4] and all(r[3] > 0 for r in facts.rows[:4])
    assert [r[-1] for r in facts.rows] == [False] * 4 + [True] and facts.events == 1
    assert all(r[5] == pytest.approx(1e-2) for r in facts.rows)  # the learning rate
    out = tmp_path / "parts.json"
    variants = "floor,facts_floor,default,default-bundles-reexecute-loss_tap-writer"
    assert sentinel_parts.main(["--smoke", "--segments", "--variants", variants, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["machine"]["cpu_model"]
    assert list(doc["result"]["variants"]) == ["plain"] + variants.split(",")
    assert all(v["paired"] > 0 for v in doc["result"]["variants"].values())
    # Each part of the step, paired with plain's: plain's own excess is nil.
    segments = doc["result"]["segments"]
    assert segments == ["forward", "backward", "optimizer", "step_end"]
    assert all(list(v["segments_us"]) == segments for v in doc["result"]["variants"].values())
    assert all(t == 0 for t in doc["result"]["variants"]["plain"]["segments_us"].values())
    with pytest.raises(SystemExit):
        sentinel_parts.main(["--smoke", "--variants", "default-nothing"])


def test_step_instructions_smoke_runs_every_variant_and_reads_callgrind_totals(tmp_path):
    """`step_instructions.py` (callgrind's count of the training thread's
    instructions a step) runs each variant's loop without valgrind, refuses
    an unknown variant with exit 2, and reads a callgrind file's total."""
    import step_instructions
    assert step_instructions.main(["--smoke"]) == 0
    assert step_instructions.main(["--smoke", "--variants", "plain,typo"]) == 2
    f = tmp_path / "callgrind.default.out-01"
    f.write_text("version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nsummary: 0\nfn=(1) main\n0 5\ntotals: 123456\n")
    assert step_instructions._totals(f) == 123456
