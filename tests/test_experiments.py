"""Fast offline tests of the experiment harness (as_softmax_lab), tiny BERT."""

import json
import os
import subprocess
import sys
import types

import keras
import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

import as_softmax_lab as lab  # noqa: E402
from as_softmax_lab import datasets  # noqa: E402
from keras_as_softmax import ASSpeed  # noqa: E402
from keras_as_softmax import MultiLabelCategoricalCrossentropy  # noqa: E402
from keras_as_softmax import filters  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {"train": 64, "validation": 16, "test": 16}


@pytest.fixture(scope="module")
def tiny_backbone():
    from as_softmax_lab.backbones import load_bert

    try:
        _, tokenizer = load_bert("offline-minilm", load_weights=False)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return lab.tiny_backbone(tokenizer, max_sequence_length=32)


# ------------------------------------------------------------- BIO F1


def test_bio_spans_seqeval_rules():
    assert lab.bio_spans(["B-PER", "I-PER", "O", "B-LOC"]) == {
        ("PER", 0, 2),
        ("LOC", 3, 4),
    }
    # An I- without a B- starts a span; a type change ends one.
    assert lab.bio_spans(["I-PER", "I-LOC", "I-LOC"]) == {
        ("PER", 0, 1),
        ("LOC", 1, 3),
    }
    # B- after B- of the same type: two spans.
    assert lab.bio_spans(["B-X", "B-X", "I-X"]) == {("X", 0, 1), ("X", 1, 3)}
    assert lab.bio_spans(["O", "O"]) == set()
    assert lab.bio_spans(["B-verb.motion"]) == {("verb.motion", 0, 1)}


def test_bio_f1_hand_computed():
    true = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    assert lab.bio_f1_score(true, true) == 1.0
    # 3 true spans; predicted: PER right, LOC wrong type, ORG right + extra.
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "B-MISC"]]
    # correct 2, predicted 4, true 3: P = 1/2, R = 2/3, F1 = 4/7.
    assert lab.bio_f1_score(true, pred) == pytest.approx(4 / 7)
    # Partial span overlap counts as wrong.
    assert lab.bio_f1_score([["B-PER", "I-PER"]], [["B-PER", "O"]]) == 0.0
    assert lab.bio_f1_score([["O"]], [["O"]]) == 0.0


def test_task_metric_tokens_uses_first_pieces_only():
    names = ("O", "B-A", "I-A")
    y = np.array([[-1, 1, -1, 2, 0, -1]])
    logits = np.full((1, 6, 3), -5.0)
    for pos, tag in enumerate(
        [0, 1, 0, 2, 0, 1]
    ):  # non-first pieces are wrong on purpose
        logits[0, pos, tag] = 5.0
    assert lab.task_metric("tokens", y, logits, names) == 1.0


def test_micro_f1_and_margins():
    y = np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    logits = np.array([[2.0, -1.0, -1.0], [-1.0, 3.0, 1.0]])
    # tp = 2, predicted 3, true 3.
    assert lab.micro_f1(y, logits) == pytest.approx(2 / 3)
    m = lab.probability_margins(
        "multiclass",
        np.array([0, 1]),
        np.log([[0.7, 0.2, 0.1], [0.5, 0.3, 0.2]]),
    )
    np.testing.assert_allclose(m, [0.5, -0.2], atol=1e-9)


# ------------------------------------------------------------ data prep


def test_tokenize_tagged_aligns_first_pieces(tiny_backbone):
    tok = tiny_backbone.tokenizer
    x, y = lab.tokenize_tagged(tok, [["unbelievably", "fast"]], [[1, 2]], 16)
    n_pieces = len(np.asarray(tok("unbelievably")).reshape(-1))
    assert n_pieces > 1
    assert x["token_ids"][0, 0] == tok.cls_token_id
    assert y[0, 0] == -1 and y[0, 1] == 1 and y[0, 1 + n_pieces] == 2
    assert np.all(y[0, 2 : 1 + n_pieces] == -1)
    assert x["token_ids"][0, 2 + n_pieces] == tok.sep_token_id
    assert x["padding_mask"][0].sum() == 3 + n_pieces
    # Truncation keeps [SEP] and never splits a word.
    x, y = lab.tokenize_tagged(tok, [["word"] * 20], [[1] * 20], 8)
    assert (
        x["padding_mask"][0].sum() == 8
        and x["token_ids"][0, 7] == tok.sep_token_id
    )
    assert np.sum(y[0] == 1) == 6


# ----------------------------------------------------------------- runs


@pytest.mark.parametrize(
    "task,method,jit",
    [
        ("multiclass", "softmax", False),
        ("multilabel", "as_softmax", False),
        ("tokens", "as_speed", True),
    ],
)
def test_run_each_task(tiny_backbone, tmp_path, task, method, jit):
    loader = {
        "multiclass": datasets.load_text_classification,
        "multilabel": datasets.load_multilabel_classification,
        "tokens": datasets.load_token_classification,
    }[task]
    prepared = lab.prepare_data(
        loader("wordnet", max_examples=SIZES), tiny_backbone.tokenizer, 24
    )
    assert prepared.task == task
    result = lab.run(
        method,
        prepared,
        tiny_backbone,
        seed=1,
        epochs=2,
        batch_size=16,
        evals_per_epoch=2,
        jit_compile=jit,
        verbose=0,
        keep_model=True,
    )
    assert result.steps_per_epoch == 4
    assert len(result.masked_ratio) == 8 and len(result.epoch_times) == 2
    assert all(0.0 <= v <= 1.0 for v in result.masked_ratio)
    assert len(result.evals) == 4 and [e["epoch"] for e in result.evals][
        1::2
    ] == [0, 1]
    assert 0.0 <= result.test_metric <= 1.0 and np.isfinite(result.test_loss)
    assert result.metric_name == lab.METRIC_NAMES[task]
    assert result.test_margins.ndim == 1 and np.all(
        np.abs(result.test_margins) <= 1.0
    )
    if method == "as_speed":
        assert isinstance(result.model, ASSpeed)
        assert len(result.accum_steps) == 8 and result.optimizer_updates <= 8
    else:
        assert result.optimizer_updates == 8

    table = lab.compare([result])
    assert method in table and result.metric_name in table
    for plot in (
        lab.plot_masked_ratio,
        lab.plot_loss_vs_metric,
        lab.plot_margins,
    ):
        path = tmp_path / f"{plot.__name__}.png"
        plot([result], str(path))
        assert path.stat().st_size > 0


def test_make_loss_and_build_classifier(tiny_backbone):
    loss = lab.make_loss("as_softmax", "tokens")
    assert loss.ignore_class == -1 and float(
        keras.ops.convert_to_numpy(loss.delta)
    ) == pytest.approx(0.3)
    assert isinstance(
        lab.make_loss("softmax", "multilabel"),
        MultiLabelCategoricalCrossentropy,
    )
    with pytest.raises(ValueError, match="method"):
        lab.make_loss("adam", "multiclass")
    model = lab.build_classifier("tokens", 5, tiny_backbone)
    x = {
        k: np.ones((2, 8), "int32")
        for k in ("token_ids", "padding_mask", "segment_ids")
    }
    assert tuple(model(x).shape) == (2, 8, 5)
    # Fresh copies start from the same backbone weights.
    a = lab.build_classifier("multiclass", 3, tiny_backbone).get_layer(index=3)
    np.testing.assert_array_equal(
        a.get_weights()[0], tiny_backbone.backbone.get_weights()[0]
    )


@pytest.mark.parametrize(
    "method,task,kwargs",
    [
        ("label_smoothing", "multiclass", {"label_smoothing": 0.2}),
        ("t_softmax", "tokens", {"temperature": 0.5}),
        ("am_softmax", "multiclass", {"scale": 8.0, "margin": 0.35}),
        ("sparsemax", "multiclass", {}),
        ("entmax15", "tokens", {}),
        ("sparse_softmax", "tokens", {"k": 3}),
        ("bce", "multilabel", {}),
    ],
)
def test_baseline_methods_make_their_losses(method, task, kwargs):
    assert method in lab.BASELINE_METHODS and method not in lab.METHODS
    loss = lab.make_loss(method, task, **kwargs)
    rng = np.random.default_rng(0)
    if task == "multilabel":
        y = (rng.random((4, 6)) < 0.3).astype("float32")
        logits = rng.normal(size=(4, 6)).astype("float32")
    elif task == "tokens":
        y = rng.integers(-1, 6, size=(4, 5)).astype("int32")
        logits = rng.normal(size=(4, 5, 6)).astype("float32")
    else:
        y = rng.integers(0, 6, size=(4,)).astype("int32")
        logits = rng.normal(size=(4, 6)).astype("float32")
    value = float(keras.ops.convert_to_numpy(loss(y, logits)))
    assert np.isfinite(value) and value > 0
    for name, expected in kwargs.items():
        assert getattr(loss, name) == pytest.approx(expected)
    other = "multilabel" if task != "multilabel" else "multiclass"
    with pytest.raises(ValueError, match="applies to tasks"):
        lab.make_loss(method, other)
    with pytest.raises(ValueError, match="hyper-parameters"):
        lab.make_loss("softmax", task, k=3)


def test_label_smoothing_loss_is_keras_on_one_hot_labels():
    y = np.array([0, 2, 1])
    logits = np.random.default_rng(1).normal(size=(3, 4)).astype("float32")
    ours = lab.LabelSmoothingLoss(0.1)(y, logits)
    keras_loss = keras.losses.CategoricalCrossentropy(
        from_logits=True, label_smoothing=0.1
    )(np.eye(4)[y], logits)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(ours),
        keras.ops.convert_to_numpy(keras_loss),
        rtol=1e-6,
    )
    with pytest.raises(ValueError, match="label_smoothing"):
        lab.LabelSmoothingLoss(1.0)


def test_build_scratch_classifier_shapes():
    x = {
        "token_ids": np.ones((2, 7), "int32"),
        "padding_mask": np.array([[1] * 7, [1] * 3 + [0] * 4], "int32"),
    }
    model = lab.build_scratch_classifier("multiclass", 5, 50)
    assert tuple(model(x).shape) == (2, 5)
    model = lab.build_scratch_classifier("tokens", 4, 50, hidden_dim=8)
    assert tuple(model(x).shape) == (2, 7, 4)
    with pytest.raises(ValueError, match="vocabulary_size"):
        lab.build_scratch_classifier("multiclass", 5, 0)


def test_run_patience_and_selected_checkpoints():
    rng = np.random.default_rng(0)

    def split(n):
        ids = rng.integers(1, 30, size=(n, 6)).astype("int32")
        x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
        return x, (ids[:, 0] % 3).astype("int32")

    data = lab.PreparedData(
        "toy", "multiclass", ("a", "b", "c"), split(64), split(32), split(32)
    )
    result = lab.run(
        "sparse_softmax",
        data,
        None,
        epochs=30,
        batch_size=16,
        learning_rate=0.05,
        loss_kwargs={"k": 2},
        build_model=lambda task, n: lab.build_scratch_classifier(task, n, 30),
        patience=2,
        select_test=True,
        jit_compile=False,
        verbose=0,
    )
    # A perfectly learnable toy task: the metric saturates, and training
    # stops two epochs after its last improvement.
    assert result.epochs < 30 and len(result.evals) == result.epochs
    metrics = [e["val_metric"] for e in result.evals]
    losses = [e["val_loss"] for e in result.evals]
    best = result.selected["best_val"]
    low = result.selected["min_val_loss"]
    assert best["eval"] == int(np.argmax(metrics))
    assert result.epochs - 1 - best["eval"] == 2
    assert low["eval"] == int(np.argmin(losses))
    assert low["val_loss"] == min(losses)
    for picked in (best, low):
        assert 0.0 <= picked["test_metric"] <= 1.0
        assert np.isfinite(picked["test_loss"])
    if low["eval"] == len(result.evals) - 1:
        assert low["test_metric"] == result.test_metric
    with pytest.raises(ValueError, match="patience"):
        lab.run("softmax", data, None, patience=0)


def test_wrap_model_builds_each_method(tiny_backbone):
    model = lab.build_classifier("multiclass", 3, tiny_backbone)
    assert lab.wrap_model("as_softmax", model, num_samples=8) is model
    wrapped = lab.wrap_model("as_speed", model, 8, lam=0.5, max_steps=3)
    assert isinstance(wrapped, ASSpeed) and wrapped.sample_filters == []
    wrapped = lab.wrap_model("as_skip_hybrid", model, 8, seed=1)
    assert isinstance(wrapped, ASSpeed)
    assert [type(f) for f in wrapped.sample_filters] == [
        filters.SkipMaskedLastSeen,
        filters.SkipMasked,
    ]
    # A prefixed option goes to that filter alone, a plain one to each.
    options = {"last_seen.anneal_fraction": 0.125, "warmup_epochs": 2}
    wrapped = lab.wrap_model("as_skip_hybrid", model, 8, filter_options=options)
    last_seen, skip = wrapped.sample_filters
    assert (last_seen.anneal_fraction, skip.anneal_fraction) == (0.125, 0.0)
    assert last_seen.warmup_epochs == skip.warmup_epochs == 2
    with pytest.raises(ValueError, match="score.anneal_fraction"):
        lab.wrap_model(
            "as_skip_hybrid",
            model,
            8,
            filter_options={"score.anneal_fraction": 0.1},
        )


def test_compare_time_to_reach():
    def fake(method, times, metrics, epoch_time):
        evals = [
            {
                "step": i,
                "epoch": i,
                "time": t,
                "val_loss": 1.0 - m,
                "val_metric": m,
            }
            for i, (t, m) in enumerate(zip(times, metrics, strict=True))
        ]
        return lab.RunResult(
            method,
            0,
            "multiclass",
            "accuracy",
            "d",
            len(times),
            10,
            10,
            1.0,
            [epoch_time] * len(times),
            [10] * len(times),
            [0.5] * 10,
            [],
            evals,
            metrics[-1],
            0.0,
            metrics[-1],
            0.0,
            np.zeros(3),
        )

    base = fake("softmax", [10, 20, 30], [0.5, 0.7, 0.6], 10.0)
    fast = fake("as_speed", [8, 16, 24], [0.6, 0.75, 0.8], 8.0)
    assert fast.time_to_reach(base.best_val_metric) == 16
    table = lab.compare([base, fast])
    row = [line for line in table.splitlines() if line.startswith("as_speed")][
        0
    ]
    assert "0.80" in row  # time ratio 16 / 20 and epoch ratio 8 / 10
    # With compilation (1 s each): (3 * 8 + 1) / (3 * 10 + 1).
    assert f"{25 / 31:.2f}" in row


def test_time_to_target_on_a_synthetic_history(tmp_path):
    from as_softmax_lab import time_to_target as ttt

    def fake(method, seed, seconds, metrics, test):
        evals = [
            {"seconds": t, "time": t - 1.0, "val_metric": m}
            for t, m in zip(seconds, metrics, strict=True)
        ]
        return types.SimpleNamespace(
            method=method, seed=seed, evals=evals, test_metric=test
        )

    runs = [
        # Softmax peaks at 0.80: the target is 0.792, reached at 30 s.
        fake("softmax", 0, [10, 20, 30, 40], [0.5, 0.7, 0.795, 0.80], 0.78),
        fake("fast", 0, [5, 10, 15, 20], [0.6, 0.792, 0.70, 0.81], 0.79),
        fake("never", 0, [5, 10, 15, 20], [0.6, 0.79, 0.791, 0.7], 0.77),
        fake("softmax", 1, [10, 20], [0.5, 0.6], 0.60),
        fake("fast", 1, [8, 16], [0.55, 0.7], 0.62),
        fake("never", 1, [8, 16], [0.5, 0.5], 0.50),
        fake("fast", 2, [8, 16], [0.9, 0.9], 0.9),  # no softmax: left out
    ]
    assert ttt.time_to_target(runs[1].evals, 0.792) == 10.0
    assert ttt.time_to_target(runs[2].evals, 0.792) is None
    records = ttt.records(runs, backend="b", task="t", output="o.txt")
    by = {(r["method"], r["seed"]): r for r in records}
    assert len(records) == 6
    np.testing.assert_allclose(by["fast", 0]["target"], 0.792)
    assert by["softmax", 0]["seconds"] == 30.0 and by["fast", 0]["seconds"]
    assert by["fast", 0]["speedup"] == 3.0  # 30 s over 10 s
    assert not by["never", 0]["reached"] and by["never", 0]["speedup"] == 0
    assert by["never", 0]["seconds"] is None
    # Seed 1: softmax's best is 0.6, so 0.594, reached at 20 s.
    assert by["fast", 1]["speedup"] == 20 / 16
    summary = ttt.summarise([by["never", 0], by["never", 1]])
    assert summary["reached"] == 0 and summary["median_speedup"] == 0.0
    summary = ttt.summarise([by["fast", 0], by["fast", 1]])
    assert summary["reached"] == 2 and summary["median_speedup"] == 2.125
    np.testing.assert_allclose(summary["test_diff"], 1.5)  # +1 and +2
    table = ttt.table(records)
    assert "| b | t | `never` | 0/2 | 0.00x |" in table
    assert (
        "| b | t | `fast` | 2/2 | 2.12x | +1.50 ± 6.35 | [o.txt](o.txt) |"
        in table
    )
    assert "`softmax`" not in table
    # A later run of the same key replaces the record; others stay.
    path = tmp_path / "records.json"
    ttt.merge(path, records)
    again = dict(by["fast", 0], seconds=1.0)
    merged = ttt.merge(path, [again, dict(again, backend="c")])
    assert len(merged) == 7
    assert json.loads(path.read_text()) == merged
    assert [r["seconds"] for r in merged if r["method"] == "fast"][:2] == [
        1.0,
        16,
    ]
    with pytest.raises(ValueError, match="target fraction"):
        ttt.target_of(runs[0].evals, 1.5)
    # Epochs of 10 s a half; the third epoch's first half took 20 s.
    steady = {"history": [[10 * i, 0.5] for i in range(1, 5)]}
    stalled = {"history": [[t, 0.5] for t in (10, 20, 30, 40, 60, 70)]}
    assert ttt.epoch_start_ratios(steady) == [1.0]
    assert ttt.epoch_start_ratios(stalled) == [1.0, 2.0]


# ------------------------------------------------------------------ demo


@pytest.mark.slow
def test_demo_quick(tmp_path):
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "demo.py"),
            "--quick",
            "--output-dir",
            str(tmp_path),
            "--json",
            str(tmp_path / "demo.json"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("masked_ratio.png", "loss_vs_accuracy.png", "margins.png"):
        assert (tmp_path / name).stat().st_size > 0
    recommended = lab.RECOMMENDED["multiclass"]
    assert recommended in proc.stdout and "t->base best" in proc.stdout
    assert "of softmax's best); softmax reached it in" in proc.stdout
    assert (
        f"the recommended setting ({recommended}) reached softmax's "
        "accuracy sooner: "
    ) in proc.stdout
    figures = json.loads((tmp_path / "demo.json").read_text())["methods"]
    assert set(figures) == {"softmax", recommended}
    assert figures["softmax"]["seconds_to_target"] > 0
    for values in figures.values():
        assert set(values) >= {
            "val_metric",
            "test_metric",
            "train_seconds",
            "updates",
            "trained_fraction",
        }
        assert values["train_seconds"] > 0
