"""Smoke tests: the benchmark scripts run with `--quick` and print their tables.

Only checks that the script works (tiny shapes, 2 rounds); it asserts
nothing about the times it prints.
"""

import importlib.util
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import types

import keras
import pytest

SCRIPT = (
    pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "loss_speed.py"
)


# A guard against a hang, not a check of speed: on a busy 2-core runner,
# `gpu_check.py --quick` has taken 298 s, and `paper_tables.py --smoke` 311.
SCRIPT_TIMEOUT = 900


def run_quick(script, backend, *args):
    """Runs `script --quick *args` on `backend`; returns its stdout."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, str(script), "--quick", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=SCRIPT_TIMEOUT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_loss_speed_quick_runs_and_prints_table():
    backend = keras.backend.backend()
    if backend not in ("tensorflow", "jax"):
        pytest.skip(f"loss_speed.py runs on tensorflow or jax, not {backend}")
    out = run_quick(SCRIPT, backend)
    header = [line for line in out.splitlines() if line.startswith("case")]
    assert header, out
    for column in ("ours ms", "base ms", "time x", "peak MiB ours", "mem x"):
        assert column in header[0], out
    for name in (
        "AS-Softmax vs SCCE ",
        "AS-Softmax vs SCCE tok",
        "ML AS-Softmax vs MLCCE",
        "ML AS fn, fixed delta",
    ):
        assert name in out, out
    assert "Targets: time x <= 1.10" in out, out


STEP_OVERHEAD = SCRIPT.parent / "step_overhead.py"


def test_step_overhead_quick_prints_every_variant():
    backend = keras.backend.backend()
    if backend not in ("tensorflow", "jax"):
        pytest.skip(f"ASSpeed trains on tensorflow or jax, not {backend}")
    variants = (
        "keras",
        "keras_metrics",
        "keras_untracked",
        "as_speed",
        "skip_masked",
        "pair",
        "selective_backprop",
    )
    out = run_quick(STEP_OVERHEAD, backend, "--variants", ",".join(variants))
    rows = {}
    for line in out.splitlines():
        words = line.split()
        if words and words[0] in variants:
            rows[words[0]] = words[1:]
    assert len(rows) == len(variants), out
    assert rows["keras"][1] == "1.00x", out
    for ms, ratio, *_ in rows.values():
        assert math.isfinite(float(ms)) and float(ms) > 0, out
        assert math.isfinite(float(ratio.rstrip("x"))), out
    for name in ("skip_masked", "selective_backprop"):
        assert float(rows[name][3]) > 0, out  # these filters scored


def test_step_overhead_takes_wide_rows():
    # 8 x 512 values a sample: a queue buffer of their own.
    backend = keras.backend.backend()
    if backend not in ("tensorflow", "jax"):
        pytest.skip(f"ASSpeed trains on tensorflow or jax, not {backend}")
    out = run_quick(
        STEP_OVERHEAD,
        backend,
        "--row-shape",
        "8,512",
        "--variants",
        "keras,skip_masked",
    )
    assert "row_shape=8,512" in out, out
    lines = out.splitlines()
    (row,) = [line.split() for line in lines if "skip_masked" in line]
    assert float(row[1]) > 0 and float(row[4]) > 0, out  # it scored
    with pytest.raises(AssertionError, match="at least 16 features"):
        run_quick(STEP_OVERHEAD, backend, "--row-shape", "8")


PAPER_TABLES = SCRIPT.parent / "paper_tables.py"
# Every method row runs once: the multi-class and multi-label rows from
# scratch, the token rows fine-tuning (a tiny random BERT), both regimes.
SMOKE_TASKS = "multiclass_scratch,multilabel_scratch,token"


def _load_script(path):
    """A script as a module, without running its `main`."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_task_block(task_key, block, rows):
    assert block["regime"] in ("finetune", "scratch"), task_key
    assert isinstance(block["metric"], str), task_key
    assert set(block["methods"]) == {row.name for row in rows}, task_key
    for name, method in block["methods"].items():
        where = f"{task_key}/{name}"
        assert method["seeds"] == [0], where
        for key in (
            "val",
            "test",
            "val_best",
            "test_at_best_val",
            "test_at_min_val_loss",
            "test_at_early_stopping",
            "train_seconds",
        ):
            values = method[key]
            assert len(values) == 1, where
            assert values[0] is not None and math.isfinite(values[0]), where
        # Pearson may be undefined on a constant tiny run, never NaN.
        assert len(method["pearson"]) == 1, where
        assert method["pearson"][0] is None or math.isfinite(
            method["pearson"][0]
        ), where
        assert method["train_seconds"][0] > 0, where
        assert method["epochs"][0] >= 1, where
        for key, diffs in method["diff_vs_reference"].items():
            assert len(diffs) == 1 and math.isfinite(diffs[0]), (where, key)
        assert method["peaked_before_last"][0] in (True, False), where
        curve = method["curves"][0]
        assert len(curve["val_loss"]) == len(curve["val_metric"]) >= 1, where
        assert len(curve["test_metric"]) == len(curve["val_loss"]), where
        assert all(math.isfinite(v) for v in curve["val_loss"]), where


def test_paper_tables_smoke_writes_json_plots_and_markdown(tmp_path):
    if keras.backend.backend() != "tensorflow":
        pytest.skip("paper_tables.py trains on TensorFlow")
    pytest.importorskip("keras_hub")
    pytest.importorskip("matplotlib")
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    md = tmp_path / "RESULTS.md"
    md.write_text("# Results\n\n## Kept section\n\nunchanged\n")
    result = subprocess.run(
        [
            sys.executable,
            str(PAPER_TABLES),
            "--smoke",
            "--tasks",
            SMOKE_TASKS,
            "--out",
            str(tmp_path / "results"),
            "--results-md",
            str(md),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=SCRIPT_TIMEOUT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(
        (tmp_path / "results" / "paper_tables.json").read_text()
    )
    paper_tables = _load_script(PAPER_TABLES)
    assert list(document["tasks"]) == SMOKE_TASKS.split(",")
    for task_key, block in document["tasks"].items():
        lab_task, regime = paper_tables.TASKS[task_key]
        assert block["regime"] == regime
        _check_task_block(task_key, block, paper_tables.ROWS[lab_task])
        for kind in ("loss_vs_metric", "test_bars"):
            png = tmp_path / "results" / f"paper_tables_{task_key}_{kind}.png"
            assert png.stat().st_size > 0, png
    text = md.read_text()
    assert "## Kept section\n\nunchanged" in text
    assert text.count(paper_tables.BEGIN) == 1
    assert "results/paper_tables_token_test_bars.png" in text
    # Re-rendering replaces the section instead of appending a second one.
    paper_tables.main(
        [
            "--smoke",
            "--render-only",
            "--out",
            str(tmp_path / "results"),
            "--results-md",
            str(md),
        ]
    )
    assert md.read_text().count(paper_tables.BEGIN) == 1


def test_paper_tables_lists_a_repeated_resume_command_once():
    paper_tables = _load_script(PAPER_TABLES)
    argv = ["--resume", "--tasks", "multiclass"]
    args = paper_tables.parse_args(argv)
    args.argv = argv
    again = "python benchmarks/paper_tables.py " + " ".join(argv)
    document = paper_tables.build_json(
        {}, args, "today", "python benchmarks/paper_tables.py", [again, again]
    )
    assert document["resumed_with"] == [again]


def _fake_run(paper_tables, seed, test):
    run = {key: 0.5 for key in paper_tables.RUN_KEYS}
    run.update(
        seed=seed,
        test=test,
        epochs=8,
        optimizer_updates=512,
        peaked_before_last=True,
        compile_seconds=1.0,
        curve={"step": [64], "val_loss": [0.9], "val_metric": [0.5]},
    )
    return run


def test_paper_tables_merge_adds_the_missing_runs_only(tmp_path):
    paper_tables = _load_script(PAPER_TABLES)
    argv = ["--tasks", "multiclass"]
    args = paper_tables.parse_args(argv)
    args.argv = argv

    def write(folder, store, command):
        document = paper_tables.build_json(store, args, "today", command)
        (tmp_path / folder).mkdir()
        path = str(tmp_path / folder / paper_tables.JSON_NAME)
        paper_tables.write_json(document, path)
        return path, document

    ours = {
        "softmax": [_fake_run(paper_tables, s, 0.7) for s in (0, 1)],
        "as_softmax": [_fake_run(paper_tables, 0, 0.75)],
    }
    theirs = {
        "softmax": [_fake_run(paper_tables, 1, 0.1)],
        "as_softmax": [_fake_run(paper_tables, s, 0.8) for s in (2, 1)],
    }
    _, before = write("main", {"multiclass": ours}, "first")
    other_path, _ = write("other", {"multiclass": theirs}, "beside")
    merge_argv = ["--out", str(tmp_path / "main"), "--merge", other_path]
    merge_args = paper_tables.parse_args(merge_argv)
    merge_args.argv = merge_argv
    merged = paper_tables.merge_json(merge_args)
    methods = merged["tasks"]["multiclass"]["methods"]
    # A run both hold keeps --out's values.
    assert methods["softmax"]["seeds"] == [0, 1]
    assert methods["softmax"]["test"] == [0.7, 0.7]
    assert methods["as_softmax"]["seeds"] == [0, 1, 2]
    assert methods["as_softmax"]["test"] == [0.75, 0.8, 0.8]
    diffs = methods["as_softmax"]["diff_vs_reference"]["test"]
    assert diffs[:2] == pytest.approx([0.05, 0.1]) and diffs[2] is None
    assert merged["command"] == "first" and merged["date"] == before["date"]
    assert "beside" in merged["resumed_with"]
    assert "first" not in merged["resumed_with"]
    assert "--merge" in merged["resumed_with"][-1]
    on_disk = json.loads((tmp_path / "main" / "paper_tables.json").read_text())
    assert on_disk["tasks"] == merged["tasks"]

    # Runs made at another size are refused, not mixed in.
    document = json.loads(open(other_path).read())
    document["tasks"]["multiclass"]["config"]["train"] = 128
    paper_tables.write_json(document, other_path)
    with pytest.raises(ValueError, match="Expected multiclass's runs"):
        paper_tables.merge_json(merge_args)


@pytest.mark.parametrize(
    "val_loss, picked",
    [
        ([0.9, 0.8, 0.85, 0.86, 0.7, 0.6], 1),  # stops before the minimum
        ([0.9, 0.8, 0.85, 0.7, 0.86, 0.6], 5),
        ([0.5, 0.6, 0.7, 0.4], 0),
        ([0.9, 0.8, 0.7, 0.6], 3),  # never stops
        ([0.5, 0.5, 0.5], 0),  # ties keep the first
    ],
)
def test_early_stopping_pick_stops_with_patience_2(val_loss, picked):
    """The evaluation whose weights `EarlyStopping(monitor="val_loss",
    patience=2, restore_best_weights=True)` restores."""
    paper_tables = _load_script(PAPER_TABLES)
    assert paper_tables.early_stopping_pick(val_loss, 2) == picked


def test_paper_tables_tfds_source_on_mock_data():
    tfds = pytest.importorskip("tensorflow_datasets")
    pytest.importorskip("keras_hub")
    from as_softmax_lab import datasets
    from tests.test_datasets import _conll_as_dataset

    paper_tables = _load_script(PAPER_TABLES)
    with tfds.testing.mock_data(num_examples=5):
        data = paper_tables.load_task_data("multiclass", "tfds")
        assert data.name == "clinc_oos"
        data = paper_tables.load_task_data("multilabel", "tfds", 4)
        assert data.name == "goemotions" and data.multi_label
    with tfds.testing.mock_data(as_dataset_fn=_conll_as_dataset(True)):
        data = paper_tables.load_task_data("tokens", "tfds")
    assert isinstance(data, datasets.TokenClassificationData)
    assert data.name == "conll2003"
    with pytest.raises(ValueError, match="source"):
        paper_tables.load_task_data("tokens", "imdb")


GPU_CHECK = SCRIPT.parent / "gpu_check.py"


LAB = SCRIPT.parent.parent / "lab"
TRACE_SUMMARY = LAB / "trace_summary.py"
GPU_PROGRAM = LAB / "gpu_program.py"
COND_COST = LAB / "cond_cost.py"
GRAPH_UPDATES = LAB / "graph_updates.py"


def _gpu_check_rows(out, variants):
    """`gpu_check.py`'s table: `{variant: [ms/step, ratio, trained, scored,
    masked, host ms]}`, as printed, the ratio without its `x`."""
    rows = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) == 7 and words[0] in variants:
            rows[words[0]] = [word.rstrip("x") for word in words[1:]]
    return rows


@pytest.mark.slow
def test_gpu_check_quick_trains_without_tensorflow(tmp_path):
    """`gpu_check.py --quick` on JAX, with TensorFlow hidden as on a GPU
    image with JAX alone: every variant trains, the filters skip samples,
    and the table and the verdicts print finite numbers. `--trace` leaves
    a profile of each variant that `lab/trace_summary.py` reads."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("one run is enough: the script runs on JAX itself")
    traces = tmp_path / "traces"
    out = run_quick(GPU_CHECK, "jax", "--trace", str(traces))
    assert "FAILED" not in out, out
    assert "runs without TensorFlow" in out, out
    variants = ("softmax", "as_softmax", "as_speed", "skip_masked", "pair")
    rows = _gpu_check_rows(out, variants)
    assert set(rows) == set(variants), out
    for name, numbers in rows.items():
        # Plain Keras models log no masked ratio.
        if name in ("softmax", "as_softmax"):
            assert numbers.pop(4) == "nan", out
        assert all(math.isfinite(float(n)) for n in numbers), out
        assert float(numbers[-1]) > 0, out  # the host's time a step
    for name in ("skip_masked", "pair"):
        trained, scored = float(rows[name][2]), float(rows[name][3])
        assert trained < 1 and scored > 0, out
    losses = [line for line in out.splitlines() if "epoch's loss:" in line]
    assert len(losses) == 1, out
    for item in losses[0].split(":", 1)[1].split(","):
        assert math.isfinite(float(item.split()[1])), out
    for name in ("as_speed", "skip_masked", "pair"):
        verdict = re.search(rf"^{name} / softmax step: (\S+)x", out, re.M)
        assert verdict and math.isfinite(float(verdict[1])), out
    summary = subprocess.run(
        [sys.executable, str(TRACE_SUMMARY), str(traces), "--tracks", "99"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in variants:
        section = summary.split(f"== tiny/{name}\n")[1].split("\n== ")[0]
        # The 8 traced steps ran: their dispatches are on the host's track.
        calls = re.search(r"(\d+)x  PjitFunction\(train_step\)", section)
        assert calls and int(calls[1]) >= 8, summary


@pytest.mark.slow
def test_gpu_check_core_keras_backbone_with_steps_per_execution():
    """`--backbone keras` (the encoder in core Keras layers, for a Keras
    that keras-hub does not import with) trains with
    `--steps-per-execution 2`: the filter skips samples, and the table
    prints finite numbers."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("one run is enough: the script runs on JAX itself")
    out = run_quick(
        GPU_CHECK,
        "jax",
        "--backbone",
        "keras",
        "--steps-per-execution",
        "2",
        "--variants",
        "softmax,skip_masked",
    )
    assert "steps_per_execution=2 backbone=keras" in out, out
    rows = _gpu_check_rows(out, ("softmax", "skip_masked"))
    assert set(rows) == {"softmax", "skip_masked"}, out
    numbers = [float(n) for row in rows.values() for n in row[:4]]
    assert all(math.isfinite(n) for n in numbers), out
    trained, scored = map(float, rows["skip_masked"][2:4])
    assert trained < 1 and scored > 0, out


POOL_SEEDS = SCRIPT.parent / "pool_seeds.py"


def pool_seeds(*args):
    return subprocess.run(
        [sys.executable, str(POOL_SEEDS), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_pool_seeds_pairs_seeds_across_outputs_and_refuses_conflicts(tmp_path):
    if keras.backend.backend() != "tensorflow":
        pytest.skip("plain Python: one backend is enough")
    first, second, other = (tmp_path / f"{n}.txt" for n in "abc")
    first.write_text(
        "seed 0 softmax    val  70.00 test  72.00   80.0s/epoch\n"
        "seed 0 as_softmax val  69.00 test  71.00   80.0s/epoch\n"
        "seed 1 softmax    val  74.00 test  76.00   80.0s/epoch\n"
    )
    # Seed 1 of softmax again, as a second file repeats it: the same values.
    second.write_text(
        "seed 1 softmax    val  74.00 test  76.00   81.0s/epoch\n"
        "seed 1 as_softmax val  75.00 test  74.00   80.0s/epoch\n"
        "seed 2 as_softmax val  60.00 test  60.00   80.0s/epoch\n"
    )
    result = pool_seeds(first, second)
    assert result.returncode == 0, result.stderr
    lines = [line.split() for line in result.stdout.splitlines() if line]
    rows = {words[0]: words for words in lines}
    assert rows["softmax"][1:] == [
        "0,1",
        "74.00",
        "±",
        "2.83",
        "72.00",
        "±",
        "2.83",
    ]
    # as_softmax: three seeds pooled, the paired difference on seeds 0 and 1:
    # test -1 and -2 (mean -1.5), validation -1 and +1 (one lower, one higher).
    as_softmax = rows["as_softmax"]
    assert as_softmax[1:3] == ["0,1,2", "68.33"] and as_softmax[8] == "0,1"
    assert as_softmax[9] == "-1.50" and as_softmax[12] == "2/0"
    # Half-width t(0.975, 1 df) * std / sqrt(2) = 12.706 * 0.7071 / 1.4142.
    assert as_softmax[10:12] == ["[-7.85,", "+4.85]"]
    assert as_softmax[13] == "+0.00" and as_softmax[16] == "1/1"
    # A tag names the methods of one output apart (softmax's runs excepted).
    result = pool_seeds(first, second, "--tag", f"{second}=warm-up")
    assert result.returncode == 0, result.stderr
    # The method column ends at its first two spaces.
    names = [line.split("  ")[0] for line in result.stdout.splitlines()]
    assert {"softmax", "as_softmax", "as_softmax [warm-up]"} <= set(names)
    other.write_text("seed 0 softmax    val  70.00 test  73.00   80.0s/epoch\n")
    result = pool_seeds(first, other)
    assert result.returncode != 0
    assert (
        "seed 0 of softmax" in result.stderr and "(70.0, 73.0)" in result.stderr
    )


def test_pool_seeds_divides_times_within_the_output_holding_a_seeds_pair(
    tmp_path,
):
    if keras.backend.backend() != "tensorflow":
        pytest.skip("plain Python: one backend is enough")
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    tail = "updates 4/4 batches/epoch [2, 2] s/epoch"
    first.write_text(
        f"seed 0 softmax  val 70.00 test 72.00  60.0s/epoch compile   10s "
        f"{tail} [50.0, 70.0] [140s]\n"
        f"seed 0 as_skip  val 69.00 test 71.00  30.0s/epoch compile   20s "
        f"{tail} [40.0, 20.0] [90s]\n"
    )
    # Seed 1's softmax ran slower beside another job: its ratio is taken
    # against that run, not seed 0's.
    second.write_text(
        f"seed 1 softmax  val 74.00 test 76.00  90.0s/epoch compile   10s "
        f"{tail} [90.0, 90.0] [200s]\n"
        f"seed 1 as_skip  val 75.00 test 74.00  45.0s/epoch compile   10s "
        f"{tail} [45.0, 45.0] [110s]\n"
    )
    result = pool_seeds(first, second)
    assert result.returncode == 0, result.stderr
    row = next(
        line for line in result.stdout.splitlines() if line.startswith("as_")
    )
    # Per epoch 60/30 and 90/45; whole runs (120+10)/(60+20) = 1.625 and
    # (180+10)/(90+10) = 1.90, their mean 1.7625.
    assert row.split("  ")[-2:] == ["2.00x (2.00/2.00)", "1.76x (1.62/1.90)"]
    # Lines without compile times leave the whole-run cell empty.
    second.write_text(
        "seed 1 softmax  val 74.00 test 76.00  90.0s/epoch\n"
        "seed 1 as_skip  val 75.00 test 74.00  45.0s/epoch\n"
    )
    result = pool_seeds(first, second)
    row = next(
        line for line in result.stdout.splitlines() if line.startswith("as_")
    )
    assert row.split()[-3:] == ["2.00x", "(2.00/2.00)", "-"]


# XLA's thunk sequences as its GPU compiler dumps them (abridged): a
# conditional held in a CUDA graph, and one between graphs.
IN_GRAPH = """\
000: kCommandBuffer [source | sink]
    001: kCopy         [source       | next=194 (1)] kCopy
    194: kConditional  [prev=001 (1) | next=195 (1)]
      false_branch:
        005: kCustomKernel [source | next=006 (1)] loop_xor_fusion
        006: kCustomKernel [prev=005 (1) | sink] gemm_fusion_dot
      true_branch:
        192: kCopy         [source | sink] kCopy
    195: kCustomKernel [prev=194 (1) | sink] input_reduce_fusion
"""
BETWEEN_GRAPHS = """\
001: kCopy          [source       | next=194 (1)] kCopy
194: kConditional   [prev=001 (1) | next=000 (1)]
  false_branch:
    000: kCommandBuffer [source | sink]
        005: kCustomKernel [source | next=006 (1)] loop_xor_fusion
        006: kCustomKernel [prev=005 (1) | sink] gemm_fusion_dot
  true_branch:
    192: kCopy [source | sink] kCopy
000: kCommandBuffer [prev=194 (1) | sink]
    195: kCustomKernel [prev=194 (1) | sink] input_reduce_fusion
"""


@pytest.mark.parametrize(
    "text, top, in_graph",
    [
        (IN_GRAPH, {"kCommandBuffer": 1}, True),
        (
            BETWEEN_GRAPHS,
            {"kCommandBuffer": 1, "kConditional": 1, "kCopy": 1},
            False,
        ),
    ],
)
def test_gpu_program_reads_where_a_conditional_sits(
    tmp_path, text, top, in_graph
):
    """`lab/gpu_program.py` tells a conditional that a CUDA graph holds
    from one between graphs, and counts each branch's thunks."""
    path = tmp_path / "thunk_sequence_after_thunk_passes.txt"
    path.write_text(text)
    program = _load_script(GPU_PROGRAM).read_program(path)
    found_top, unconditional, conditionals, loops = program
    assert dict(found_top) == top
    assert unconditional == 2  # the copy before, the reduction after
    assert len(conditionals) == 1
    assert conditionals[0]["in_graph"] is in_graph
    assert [b["thunks"] for b in conditionals[0]["branches"]] == [2, 1]
    assert loops == []


# A scan of steps (`steps_per_execution`): a loop between graphs, the
# conditional in its body's graph, and the loops' trip counts in an HLO
# (one line each: the backslash continues the first).
LOOP = """000: kCommandBuffer [source       | next=013 (1)]
    011: kCustomKernel [source | sink] loop_concatenate_fusion
013: kWhile         [prev=000 (1) | next=000 (1)]
condition:
    014: kCustomKernel [source | sink] loop_compare_fusion
  body:
    000: kCommandBuffer [source | sink]
        091: kConditional  [source | sink]
          false_branch:
            028: kCopy         [source | sink] kCopy
          true_branch:
            029: kCustomKernel [source | sink] gemm_fusion_dot
000: kCommandBuffer [prev=013 (1) | sink]
    195: kCustomKernel [source | sink] input_reduce_fusion
"""
LOOP_HLO = """ENTRY %main (p: (s32[], f32[2])) -> (s32[], f32[2]) {
  %while.1 = (s32[], f32[2]{0}) while(%p), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"8"}}
  %while.2 = (s32[], f32[2]{0}) while(%p), condition=%cond, body=%body
}
"""


def test_gpu_program_reads_a_loop_and_its_trip_count(tmp_path):
    """`lab/gpu_program.py` finds a loop between graphs, with the
    conditional of its body inside a graph, and reads which loops have a
    trip count XLA knows (run without reading their condition back)."""
    script = _load_script(GPU_PROGRAM)
    path = tmp_path / "thunk_sequence_after_thunk_passes.txt"
    path.write_text(LOOP)
    found_top, _, conditionals, loops = script.read_program(path)
    assert dict(found_top) == {"kCommandBuffer": 2, "kWhile": 1}
    assert loops == [False]
    assert [c["in_graph"] for c in conditionals] == [True]
    hlo = tmp_path / "program.txt"
    hlo.write_text(LOOP_HLO)
    assert script.trip_counts(hlo) == [8, None]


# An optimized step and its buffer assignment as XLA dumps them (abridged):
# the batch (`args_1`) read in one branch, a small value of the other
# conditional's branch in the allocation of an output not aliased to an
# input, and the state (`args_0`) aliased to its output.
HLO = """\
%branch_score (p: (s32[4], f32[2])) -> f32[] {
  %p = (s32[4]{0}, f32[2]{0}) parameter(0)
  %gte = s32[4]{0} get-tuple-element(%p), index=0
  ROOT %sum = f32[] fusion(%gte), kind=kLoop, calls=%fused_sum
}
%branch_skip (q: (s32[4], f32[2])) -> f32[] {
  %q = (s32[4]{0}, f32[2]{0}) parameter(0)
  ROOT %zero = f32[] constant(0)
}
%branch_update (r: f32[2]) -> f32[2] {
  %r = f32[2]{0} parameter(0)
  %seed = u32[] fusion(%r), kind=kLoop, calls=%fused_xor
  ROOT %new = f32[2]{0} fusion(%r, %seed), kind=kLoop, calls=%fused_add
}
%branch_keep (s: f32[2]) -> f32[2] {
  ROOT %s = f32[2]{0} parameter(0)
}
ENTRY %main (args_0__0_.1: f32[2], args_1__0_.1: s32[4]) -> (f32[], f32[2]) {
  %args_0__0_.1 = f32[2]{0} parameter(0)
  %args_1__0_.1 = s32[4]{0} parameter(1)
  %pred = pred[] fusion(%args_0__0_.1), kind=kLoop, calls=%fused_compare
  %operands = (s32[4]{0}, f32[2]{0}) tuple(%args_1__0_.1, %args_0__0_.1)
  %score = f32[] conditional(%pred, %operands, %operands), \
true_computation=%branch_score, false_computation=%branch_skip, \
metadata={op_name="cond"}
  %update = f32[2]{0} conditional(%pred, %args_0__0_.1, %args_0__0_.1), \
true_computation=%branch_update, false_computation=%branch_keep
  %loss = f32[] fusion(%score), kind=kLoop, calls=%fused_copy
  ROOT %out = (f32[], f32[2]{0}) tuple(%loss, %update)
}
"""
ASSIGNMENT = """\
BufferAssignment:
allocation 0: size 8, page 0, parameter 0, shape |f32[2]| at ShapeIndex {}, \
maybe-live-out:
 value: <1 args_0__0_.1 @0> (size=8,offset=0): f32[2]{0}
 value: <2 new @0> (size=8,offset=0): f32[2]{0}
allocation 1: size 16, page 0, parameter 1, shape |s32[4]| at ShapeIndex {}:
 value: <3 args_1__0_.1 @0> (size=16,offset=0): s32[4]{0}
allocation 2: size 16, page 0, output shape is |(f32[], f32[2])|, \
maybe-live-out:
 value: <4 out @0> (size=16,offset=0): (f32[], f32[2]{0})
allocation 3: size 4, page 0, maybe-live-out:
 value: <5 seed @0> (size=4,offset=0): u32[]
 value: <6 loss @0> (size=4,offset=0): f32[]
allocation 4: size 4, page 0, preallocated-temp:
 value: <7 sum @0> (size=4,offset=0): f32[]
"""


def test_gpu_program_finds_what_a_branch_holds_in_a_new_buffer(tmp_path):
    """`lab/gpu_program.py` names, per conditional, the buffers its
    branches use that are new at each execution: the batch, read through
    the conditional's operands, and an output's allocation lent to a
    value of a branch; the donated state and the temporary buffer are
    not."""
    hlo, assignment = tmp_path / "hlo.txt", tmp_path / "assignment.txt"
    hlo.write_text(HLO)
    assignment.write_text(ASSIGNMENT)
    found = _load_script(GPU_PROGRAM).fresh_buffers(hlo, assignment)
    assert found == [("score", True, [], 5), ("update", False, ["seed"], 4)]


def test_cond_cost_quick_times_every_program_in_every_regime():
    """`lab/cond_cost.py --quick`: its own check passes (the untaken
    branch leaves the parameters as they were, the taken one changes
    them) and it prints a finite time for each program and regime, each
    program's wall time over `full`'s, `full` itself at 1.00x."""
    regimes = ("fresh", "same", "scan")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("one run is enough: the script is plain JAX")
    out = run_quick(COND_COST, "jax")
    rows = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) == 5 and words[0] in regimes:
            rows[words[0], words[1]] = [float(w.rstrip("x")) for w in words[2:]]
    programs = ("full", "score", "skip", "take")
    expected = {(r, p) for r in regimes for p in programs}
    assert set(rows) == expected, out
    numbers = [n for row in rows.values() for n in row]
    assert all(math.isfinite(n) and n > 0 for n in numbers), out
    assert all(rows[r, "full"][2] == 1.0 for r in regimes), out


STEP_PROGRAM = LAB / "step_program.py"


def test_step_program_counts_each_variants_compiled_step():
    """`lab/step_program.py --quick`: a count per variant, each kind's
    counts summing to its total; `ASSpeed` adds to the plain step, and a
    filter to `ASSpeed`'s."""
    backend = keras.backend.backend()
    if backend not in ("tensorflow", "jax"):
        pytest.skip(f"step_program.py runs on tensorflow or jax, not {backend}")
    out = run_quick(STEP_PROGRAM, backend)
    totals = {}
    for line in out.splitlines():
        name, _, rest = line.partition(": ")
        if name in ("keras", "as_speed", "skip_masked", "pair"):
            total, kinds = rest.split(" | ")
            counts = [int(k.rpartition("=")[2]) for k in kinds.split()]
            assert sum(counts) == int(total), line
            totals[name] = int(total)
    assert list(totals) == ["keras", "as_speed", "skip_masked", "pair"], out
    assert totals["keras"] < totals["as_speed"] < totals["skip_masked"], out


STATE_TRACKING = LAB / "state_tracking.py"


def test_state_tracking_quick_times_both_assignments():
    """`lab/state_tracking.py --quick`: per model its state arrays (the
    MLP's 4 weights, Adam's 10 variables, the loss tracker's 2) and a
    finite time for each way of setting `_jax_state`."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("one run is enough: the script runs on JAX")
    out = run_quick(STATE_TRACKING, "jax")
    rows = {}
    for line in out.splitlines():
        words = line.split()
        if words and words[0] in ("mlp", "tiny"):
            rows[words[0]] = [float(w) for w in words[1:]]
    assert list(rows) == ["mlp", "tiny"], out
    assert rows["mlp"][0] == 16 and rows["tiny"][0] > 16, out
    times = [t for row in rows.values() for t in row[1:]]
    assert all(math.isfinite(t) and t > 0 for t in times), out


HOST_TIME = LAB / "host_time.py"


def test_host_time_quick_splits_each_variants_host_time():
    """`lab/host_time.py --quick`: per variant and steps a dispatch, the
    host's time a step by component, the components within the total.
    (`ASSpeed` without a filter runs in `gpu_check.py`'s smoke.)"""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("one run is enough: the script runs on JAX")
    variants = ("softmax", "skip_masked")
    out = run_quick(HOST_TIME, "jax", "--variants", ",".join(variants))
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if "host us a step" in line)
    words = lines[header].split()[4:]
    assert list(zip(words[::2], words[1::2])) == [
        (variant, spe) for spe in ("spe1", "spe8") for variant in variants
    ], out
    rows = {
        line[:32].strip(): [float(c) for c in line[32:].split()]
        for line in lines[header + 1 :]
        if line.strip()
    }
    assert len(rows["total"]) == 2 * len(variants), out
    parts = [r for k, r in rows.items() if k != "total"]
    for i, total in enumerate(rows["total"]):
        assert total > 0 and all(r[i] >= 0 for r in parts[:-1]), out
        assert sum(r[i] for r in parts) == pytest.approx(total, abs=10), out
    assert all(t > 0 for t in rows["jit dispatch"]), out


def test_graph_updates_reads_xla_command_buffer_log(capsys):
    """`lab/graph_updates.py` on lines as XLA's GPU runtime logs them
    (`command_buffer_thunk.cc`, `command_executor.cc`): each command buffer's
    updates, with the executions between them, the moved allocations and the
    host time, told apart by top-level command count; the re-recorded nested
    sequences with how many of their commands were updated."""
    thunk = "I1128 08:00:00.0 1 command_buffer_thunk.cc:2] "
    executor = "I1128 08:00:00.0 1 command_executor.cc:3] "
    update = (
        thunk + "Update command buffer on device #0 by recoding command buffer"
        " cmd sequence after {} executions since last update; "
        "num_commands={}; updated_allocs={}"
    )
    lines = [
        update.format(1, 71, 3),
        executor
        + "Updated 168 commands in 900 \u03bcs (skipped 160 command updates)",
        executor
        + "Updated 71 commands in 2000 \u03bcs (skipped 60 command updates)",
        thunk + "Updated command buffer in 2100 \u03bcs; num_commands=71",
        thunk + "Execute command buffer on device #0; num_executions=1",
        update.format(5, 663, 1),
        thunk + "Execute command buffer on device #0; num_executions=1",
        update.format(3, 71, 5),
        thunk + "Updated command buffer in 1900 us",
        thunk + "Execute command buffer on device #0; num_executions=1",
        "an unrelated line",
    ]
    module = _load_script(GRAPH_UPDATES)
    executions, buffers, sequences = module.parse(lines)
    assert executions == 3
    assert buffers == {71: [[1, 3, 2100], [3, 5, 1900]], 663: [[5, 1, None]]}
    assert sequences == {168: [(8, 900)], 71: [(11, 2000)]}
    module.report(executions, buffers, sequences)
    assert "3 updates (4.0 ms on the host in all)" in capsys.readouterr().out
    # jaxlib 0.11.2's plugin logs updates without their times.
    module.report(*module.parse([update.format(1, 71, 3)]))
    assert "1 updates (time not logged on the host" in capsys.readouterr().out


def test_time_to_target_report_prints_the_table_and_plots(tmp_path):
    from as_softmax_lab import RECOMMENDED

    def record(method, seed, seconds, reached=True):
        return {
            "backend": "jax 0.12.1",
            "task": "multiclass",
            "method": method,
            "seed": seed,
            "target": 0.7,
            "reached": reached,
            "seconds": seconds if reached else None,
            "softmax_seconds": 100.0,
            "speedup": 100.0 / seconds if reached else 0.0,
            "test_metric": 0.71,
            "softmax_test_metric": 0.72,
            "history": [[seconds / 2, 0.5], [seconds, 0.7]],
            "output": "benchmarks/results/x.txt",
        }

    recommended = RECOMMENDED["multiclass"]
    records = [record("softmax", s, 100.0) for s in (0, 1)] + [
        record(recommended, 0, 50.0),
        record(recommended, 1, 60.0, reached=False),
    ]
    path = tmp_path / "records.json"
    path.write_text(json.dumps(records))
    script = SCRIPT.parent / "time_to_target.py"
    result = subprocess.run(
        [sys.executable, str(script), "--records", str(path)]
        + ["--plots", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The seed not reached counts 0x: the median of 2.0x and 0x is 1.0x.
    row = f"| jax 0.12.1 | multiclass | `{recommended}` | 1/2 | 1.00x | -1.00 "
    assert row in result.stdout, result.stdout
    assert (tmp_path / "time_to_target_jax_multiclass.png").stat().st_size


def test_as_speed_flags_the_steps_after_an_evaluation():
    as_speed = _load_script(SCRIPT.parent / "as_speed.py")
    # 16 steps, evaluations after steps 4 and 12 and at the end: steps
    # 5-6 and 13-14 (step_times 3-4 and 11-12) follow one, at 3 s.
    seconds = [1.0] * 15
    seconds[3] = seconds[4] = seconds[11] = seconds[12] = 3.0
    result = types.SimpleNamespace(
        step_times=[(1, i, t) for i, t in enumerate(seconds)],
        evals=[{"step": 4}, {"step": 12}, {"step": 16}],
    )
    assert as_speed.after_evaluations(result, steps=2) == (
        "after evaluations x3.00 "
    )
    result.evals = [{"step": 16}]  # only the final one: nothing to compare
    assert as_speed.after_evaluations(result) == ""


def test_as_speed_quick_writes_time_to_target_records(tmp_path):
    from as_softmax_lab import RECOMMENDED

    records, log = tmp_path / "records.json", tmp_path / "log.txt"
    out = run_quick(
        SCRIPT.parent / "as_speed.py",
        keras.backend.backend(),
        "--records",
        str(records),
        "--log",
        str(log),
    )
    assert "time to target:" in out and "| seeds reached |" in out, out
    assert log.read_text() == out
    written = json.loads(records.read_text())
    methods = {r["method"] for r in written}
    assert methods == {"softmax", RECOMMENDED["multiclass"]}, methods
    for r in written:
        assert r["command"].startswith("KERAS_BACKEND=")
        assert r["reached"] == (r["seconds"] is not None)
        assert len(r["history"]) >= 4  # twice an epoch, two epochs
