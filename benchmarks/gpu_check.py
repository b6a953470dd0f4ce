"""JAX on a GPU: does `ASSpeed` + `SkipMasked` train, and what do its steps
and its scoring pass cost there?

A randomly initialised keras-hub `BertBackbone` with all-MiniLM-L6-v2's
shape (vocabulary 30522, 6 layers, 12 heads, hidden 384, intermediate
1536, max length 512; the pretrained weights are not needed to time it),
mean pooling, dropout and a 45-class head, as `as_softmax_lab`'s
classifier; random token ids (batch 32, length 32) whose labels are
learnable (three quarters of each sentence's tokens come from its class's
band of the vocabulary), so that AS-Softmax masks samples and the filter
skips them. Parts, in order:

* `env`: device, versions, XLA's float32 matmul precision (the error of a
  float32 product against float64, at the default precision and at
  `"highest"`: TF32 shows as an error near 1e-3).
* `tensorflow`: whether `fit` with a sample filter runs without
  TensorFlow installed.
* `scoring`: the scoring pass alone (`jax_stage_cost.py`'s `scoring`
  part): training and inference mode, float32 products at the default
  precision and at `"highest"`, and bfloat16 ones
  (`SkipMasked(score_precision="bfloat16")`), interleaved, medians; and
  how far the logits and probabilities are apart.
* `softmax`: a plain Keras model, softmax cross entropy, AdamW,
  `jit_compile=True`: `fit`'s per-step time (blocking on the step's
  outputs and state in a callback).
* `skip`, `skip_bf16`: `ASSpeed(model, sample_filter=SkipMasked(...))`
  with `ASSoftmaxLoss(0.3)`, `jit_compile=True`, for `score_precision`
  `None` and `"bfloat16"`: the per-epoch logs (loss, masked_ratio,
  trained_fraction, ...), finite losses, every staged program's calls
  timed (blocking), and the step time by which programs a step ran.
* `skip_untimed`, `skip_bf16_untimed`: the same fits with no blocking
  between the staged programs; `skip_fixed_untimed`: with
  `min_masked_ratio=1/3` (no break-even meter timing each step);
  `asspeed`: `ASSpeed` without a filter (Keras's one jitted step).
* `softmax_highest`: the softmax fit again under
  `jax.default_matmul_precision("highest")` (skipped past `--budget-s`).

Results on an H200: `benchmarks/results/gpu_check_jax.txt`.

    python benchmarks/gpu_check.py             # full sizes (a GPU)
    python benchmarks/gpu_check.py --quick     # tiny sizes, a CPU smoke test

TensorFlow is hidden from this process (`--allow-tensorflow` lets it be
imported), so a CPU run behaves as a machine without it.
"""

import argparse
import collections
import contextlib
import importlib.util
import os
import platform
import sys
import time
import traceback

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TF_HIDDEN = "--allow-tensorflow" not in sys.argv
TF_INSTALLED = importlib.util.find_spec("tensorflow") is not None


class _HideTensorflow:
    """A meta path finder that makes `import tensorflow` fail, as on a
    machine without it."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("tensorflow", "tensorflow_text"):
            raise ModuleNotFoundError(
                f"No module named {name!r} (hidden by gpu_check.py)",
                name=name,
            )
        return None


if TF_HIDDEN:
    sys.meta_path.insert(0, _HideTensorflow())

import jax  # noqa: E402
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
from jax_stage_cost import scoring_programs  # noqa: E402
from keras import ops  # noqa: E402

import keras_as_softmax as kas  # noqa: E402
from keras_as_softmax import filters  # noqa: E402
from keras_as_softmax.training import _jax  # noqa: E402

TF_ABSENT = TF_HIDDEN or not TF_INSTALLED
NAMES = ("token_ids", "padding_mask", "segment_ids")
START = time.perf_counter()


def say(*args):
    print(*args, flush=True)


def elapsed():
    return time.perf_counter() - START


# --------------------------------------------------------------- settings

PARTS = (
    "env",
    "tensorflow",
    "scoring",
    "softmax",
    "skip",
    "skip_bf16",
    "skip_untimed",
    "skip_bf16_untimed",
    "skip_fixed_untimed",
    "asspeed",
    "softmax_highest",
)

FULL = dict(
    vocabulary=30522,
    layers=6,
    heads=12,
    hidden=384,
    intermediate=1536,
    max_length=512,
    classes=45,
    batch=32,
    length=32,
    samples=2048,
    epochs=8,
    softmax_epochs=4,
    calls=200,
    learning_rate=3e-4,
)
QUICK = dict(
    FULL,
    vocabulary=1000,
    layers=2,
    heads=2,
    hidden=32,
    intermediate=64,
    max_length=64,
    length=16,
    samples=512,
    epochs=3,
    softmax_epochs=2,
    calls=5,
    learning_rate=3e-3,
)


# ------------------------------------------------------------------ model


def build_classifier(cfg, seed=0, dropout=0.1):
    """`as_softmax_lab.build_classifier("multiclass", ...)` on a randomly
    initialised backbone of `cfg`'s shape."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=cfg["vocabulary"],
        num_layers=cfg["layers"],
        num_heads=cfg["heads"],
        hidden_dim=cfg["hidden"],
        intermediate_dim=cfg["intermediate"],
        dropout=dropout,
        max_sequence_length=cfg["max_length"],
    )
    for layer in backbone.layers:
        if layer.name == "pooled_dense":
            layer.trainable = False
    inputs = {
        n: keras.Input(shape=(None,), dtype="int32", name=n) for n in NAMES
    }
    sequence = backbone(inputs)["sequence_output"]
    mask = ops.expand_dims(ops.cast(inputs["padding_mask"], sequence.dtype), -1)
    x = ops.sum(sequence * mask, axis=1) / ops.maximum(
        ops.sum(mask, axis=1), 1.0
    )
    x = keras.layers.Dropout(dropout)(x)
    logits = keras.layers.Dense(cfg["classes"], dtype="float32", name="logits")(
        x
    )
    return keras.Model(inputs, logits, name="bert_multiclass_classifier")


def make_data(cfg, samples, seed=0):
    """Random sentences whose labels are learnable: three quarters of the
    tokens come from the class's band of the vocabulary."""
    rng = np.random.default_rng(seed)
    vocabulary, length, classes = (
        cfg["vocabulary"],
        cfg["length"],
        cfg["classes"],
    )
    low = 1000 if vocabulary > 20000 else 10
    band = (vocabulary - low) // classes
    y = rng.integers(0, classes, samples).astype("int32")
    ids = rng.integers(low, vocabulary, (samples, length))
    from_class = rng.random((samples, length)) < 0.75
    in_band = low + y[:, None] * band + rng.integers(0, band, (samples, length))
    ids = np.where(from_class, in_band, ids)
    lengths = rng.integers(length // 2, length + 1, samples)
    mask = np.arange(length)[None, :] < lengths[:, None]
    ids[:, 0] = min(101, low - 1)
    ids[np.arange(samples), lengths - 1] = min(102, low - 2)
    ids = np.where(mask, ids, 0)
    x = {
        "token_ids": ids.astype("int32"),
        "padding_mask": mask.astype("int32"),
        "segment_ids": np.zeros((samples, length), "int32"),
    }
    return x, y


# ------------------------------------------------------ TensorFlow absent


def tensorflow_part():
    say("\n== fit with a sample filter, TensorFlow absent ==")
    if not TF_ABSENT:
        say("  TensorFlow is importable here: not checked")
        return
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    model = kas.ASSpeed(
        keras.Model(inputs, keras.layers.Dense(3)(inputs)),
        sample_filter=filters.SkipMasked(),
    )
    model.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3))
    x, y = np.zeros((64, 8), "float32"), np.zeros(64, "int32")
    try:
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    except ImportError:
        say("  FAILS: ASSpeed.fit with SkipMasked() imports tensorflow:")
        lines = traceback.format_exc().rstrip().splitlines()
        for line in lines[-8:]:
            say("   ", line)
        raise
    else:
        say("  runs without TensorFlow")


# ------------------------------------------------------------ environment


def version(name):
    try:
        from importlib import metadata

        return metadata.version(name)
    except Exception:  # noqa: BLE001
        return "-"


def matmul_error(precision, size=1024):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((size, size)).astype("float32")
    b = rng.standard_normal((size, size)).astype("float32")
    reference = a.astype("float64") @ b.astype("float64")
    with contextlib.ExitStack() as stack:
        if precision is not None:
            stack.enter_context(jax.default_matmul_precision(precision))
        out = np.asarray(jax.jit(jax.numpy.matmul)(a, b)).astype("float64")
    return float(np.abs(out - reference).max() / np.abs(reference).max())


def env_part(cfg, quick):
    device = jax.devices()[0]
    say("== environment ==")
    say(f"  date (UTC)        {time.strftime('%Y-%m-%d %H:%M', time.gmtime())}")
    say(f"  devices           {jax.devices()}")
    say(f"  device kind       {getattr(device, 'device_kind', '?')}")
    say(f"  platform          {device.platform}")
    say(f"  python            {platform.python_version()}")
    for name in (
        "jax",
        "jaxlib",
        "jax-cuda13-plugin",
        "keras",
        "keras-hub",
        "numpy",
        "ml-dtypes",
    ):
        say(f"  {name:17s} {version(name)}")
    say(f"  tensorflow        installed {TF_INSTALLED}, hidden {TF_HIDDEN}")
    say("  backbone          keras_hub.models.BertBackbone, random init")
    say(
        "  sizes             "
        + ", ".join(f"{k} {v}" for k, v in cfg.items())
        + (" (--quick)" if quick else "")
    )
    try:
        setting = jax.config.jax_default_matmul_precision
    except AttributeError:
        setting = "?"
    say(f"  jax_default_matmul_precision = {setting!r}")
    say(f"  XLA_FLAGS = {os.environ.get('XLA_FLAGS', '')!r}")
    for precision in (None, "highest"):
        error = matmul_error(precision)
        name = "default" if precision is None else precision
        say(
            f"  float32 1024^3 matmul at {name:8s} precision: max error "
            f"{error:.1e} of max |result| against float64"
        )
    say("  (about 1e-3 is TF32 or bfloat16 passes; about 1e-6 is float32)")


# ------------------------------------------------------------ the scoring


def scoring_part(cfg, calls):
    model = build_classifier(cfg)
    x, _ = make_data(cfg, cfg["batch"], seed=1)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def at(precision, program):
        def call(*args):
            with jax.default_matmul_precision(precision):
                return program(*args)

        return call

    programs = {}
    for (mode, precision), program in scoring_programs(model).items():
        programs[mode, precision] = program
        if precision == "float32":
            programs[mode, "float32 highest"] = at("highest", program)
    compile_s = {}
    outputs = {}
    for key, program in programs.items():
        start = time.perf_counter()
        outputs[key] = jax.block_until_ready(
            program(trainable, non_trainable, x)
        )[0]
        compile_s[key] = time.perf_counter() - start
        jax.block_until_ready(program(trainable, non_trainable, x))
    times = collections.defaultdict(list)
    for _ in range(calls):
        for key, program in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(program(trainable, non_trainable, x))
            times[key].append(time.perf_counter() - start)
    say(
        f"\n== the scoring pass alone (batch {cfg['batch']}, length "
        f"{cfg['length']}), median of {calls} interleaved calls =="
    )
    say("  mode       products            median ms   min ms   first call s")
    for (mode, precision), seconds in times.items():
        ms = 1000 * np.asarray(seconds)
        say(
            f"  {mode:10s} {precision:18s} {np.median(ms):9.3f} "
            f"{ms.min():8.3f} {compile_s[(mode, precision)]:10.1f}"
        )
    for mode in ("training", "inference"):
        base = np.median(times[(mode, "float32")])
        for precision in ("float32 highest", "bfloat16"):
            ratio = np.median(times[(mode, precision)]) / base
            say(f"  {mode} mode: {precision} / float32 default = {ratio:.2f}")
    exact = outputs[("inference", "float32 highest")]
    say(
        "  inference mode, against float32 highest (largest |logit| "
        f"{float(np.abs(exact).max()):.2g}):"
    )
    p_exact = jax.nn.softmax(exact)
    for precision in ("float32", "bfloat16"):
        other = outputs[("inference", precision)]
        p_other = jax.nn.softmax(other)
        name = "float32 default" if precision == "float32" else precision
        say(
            f"    {name:16s} logits within "
            f"{float(np.abs(exact - other).max()):.2g}, probabilities within "
            f"{float(np.abs(p_exact - p_other).max()):.2g}"
        )


# ------------------------------------------------------------- the fits

EVENTS = []  # (program, seconds, its call number)
CALLS = collections.Counter()


def program_name(fn):
    args = getattr(fn, "args", None)
    if args:
        return {"decide": "decide", "run": "score"}.get(args[0], str(args[0]))
    name = getattr(fn, "__name__", type(fn).__name__)
    if name == "<lambda>" and fn.__defaults__:
        return "finish+train" if fn.__defaults__[-1] else "finish, no train"
    return {"zeros": "reset sums", "_end_window": "end window"}.get(name, name)


class TimedJax:
    """`jax` for `_jax.py`, whose `jit` times each call, blocking."""

    def __getattr__(self, name):
        return getattr(jax, name)

    def jit(self, fn, **kwargs):
        compiled = jax.jit(fn, **kwargs)
        name = program_name(fn)

        def timed(*args):
            start = time.perf_counter()
            outputs = compiled(*args)
            jax.block_until_ready(outputs)
            EVENTS.append((name, time.perf_counter() - start, CALLS[name]))
            CALLS[name] += 1
            return outputs

        return timed


class StepTimer(keras.callbacks.Callback):
    """Each step's seconds, blocking on its logs and state (without writing
    the state back to the variables), with the staged programs it ran."""

    def __init__(self):
        super().__init__()
        self.steps = []  # (epoch, seconds, events)
        self.ratios = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.mark = len(EVENTS)
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        # `self._model`: on JAX, `self.model` writes `fit`'s state back to
        # every variable, which no plain `fit` step does.
        state = getattr(self._model, "_jax_state", None)
        jax.block_until_ready((logs, state))
        seconds = time.perf_counter() - self.start
        self.steps.append((self.epoch, seconds, tuple(EVENTS[self.mark :])))

    def on_epoch_end(self, epoch, logs=None):
        ratio = getattr(self.model, "_min_masked_ratio", None)
        self.ratios.append(
            None if ratio is None else float(np.asarray(ratio.value))
        )


def steady(timer, first_epoch=1):
    """Steps from `first_epoch` on that compiled nothing."""
    return [
        (epoch, seconds, events)
        for epoch, seconds, events in timer.steps
        if epoch >= first_epoch and all(call > 0 for _, _, call in events)
    ]


def fit_model(cfg, x, y, weights, sample_filter, precision=None):
    """Fits the softmax model (`sample_filter` is None), ASSpeed without a
    filter (`"none"`) or ASSpeed with the filter: `(history, StepTimer,
    wall seconds)`."""
    model = build_classifier(cfg)
    model.set_weights(weights)
    optimizer = keras.optimizers.AdamW(cfg["learning_rate"], weight_decay=0.01)
    if sample_filter is None:
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            jit_compile=True,
        )
        epochs = cfg["softmax_epochs"]
    else:
        if sample_filter == "none":
            sample_filter = None
        model = kas.ASSpeed(model, sample_filter=sample_filter)
        model.compile(
            optimizer=optimizer,
            loss=kas.ASSoftmaxLoss(delta=0.3),
            metrics=["accuracy"],
            jit_compile=True,
        )
        epochs = cfg["epochs"]
    timer = StepTimer()
    EVENTS.clear()
    CALLS.clear()
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if precision is not None:
            stack.enter_context(jax.default_matmul_precision(precision))
        history = model.fit(
            x,
            y,
            batch_size=cfg["batch"],
            epochs=epochs,
            verbose=0,
            callbacks=[timer],
        )
    return history.history, timer, time.perf_counter() - start


def epoch_table(history, timer):
    keys = [
        k
        for k in (
            "loss",
            "accuracy",
            "masked_ratio",
            "accum_steps",
            "scored_fraction",
            "trained_fraction",
        )
        if k in history
    ]
    say(
        "  epoch "
        + " ".join(f"{k:>16s}" for k in keys)
        + "   step ms mean"
        + "   median"
        + ("   min_masked_ratio" if timer.ratios[0] is not None else "")
    )
    epochs = len(history["loss"])
    for e in range(epochs):
        seconds = [s for ep, s, _ in timer.steps if ep == e]
        row = " ".join(f"{history[k][e]:16.4f}" for k in keys)
        ratio = timer.ratios[e]
        say(
            f"  {e + 1:5d} {row} {1000 * np.mean(seconds):14.2f} "
            f"{1000 * np.median(seconds):8.2f}"
            + (f" {ratio:18.3f}" if ratio is not None else "")
        )


def softmax_part(cfg, x, y, weights, precision=None):
    history, timer, wall = fit_model(cfg, x, y, weights, None, precision)
    name = "default" if precision is None else precision
    say(
        f"\n== softmax: plain Keras model, float32 matmuls at {name} "
        f"precision, {len(history['loss'])} epochs, fit {wall:.1f} s "
        "with compilation =="
    )
    epoch_table(history, timer)
    seconds = 1000 * np.asarray([s for _, s, _ in steady(timer)])
    say(
        f"  steady step (epochs 2+): median {np.median(seconds):.2f} ms, "
        f"mean {np.mean(seconds):.2f} ms, min {seconds.min():.2f} ms "
        f"over {len(seconds)} steps; first step (compiles) "
        f"{timer.steps[0][1]:.1f} s"
    )
    return float(np.mean(seconds)), float(np.median(seconds))


def skip_part(
    cfg, x, y, weights, precision, softmax_ms, timed=True, min_masked_ratio=None
):
    """ASSpeed + SkipMasked; `timed`: each staged program's calls timed,
    blocking on each; `precision="none"`: ASSpeed without a filter."""
    if precision == "none":
        sample_filter, timed = "none", False
    else:
        sample_filter = filters.SkipMasked(
            min_masked_ratio=min_masked_ratio, score_precision=precision
        )
    if timed:
        _jax.jax = TimedJax()
    try:
        history, timer, wall = fit_model(cfg, x, y, weights, sample_filter)
    finally:
        _jax.jax = jax
    name = "no filter" if sample_filter == "none" else repr(sample_filter)
    say(
        f"\n== ASSpeed + {name}, ASSoftmaxLoss(0.3), "
        f"{len(history['loss'])} epochs, fit {wall:.1f} s with compilation, "
        + ("staged programs timed, blocking" if timed else "not instrumented")
        + " =="
    )
    epoch_table(history, timer)
    losses = np.asarray(history["loss"], "float64")
    trained = history.get("trained_fraction", [])
    scored = history.get("scored_fraction", [])
    say(
        f"  finite losses: {bool(np.all(np.isfinite(losses)))}; "
        f"trained_fraction {[round(t, 3) for t in trained]}"
    )
    exercised = any(s > 0 for s in scored) and any(t < 1 for t in trained)
    say(f"  scoring and skipping exercised: {exercised}")
    rows = steady(timer)
    active = [s for e, s, _ in rows if e >= 2]
    if active:
        mean = 1000 * float(np.mean(active))
        say(
            f"  mean step, epochs 3+ (filter active): {mean:.2f} ms; softmax "
            f"steady mean {softmax_ms:.2f} ms: softmax / this = "
            f"{softmax_ms / mean:.2f}x"
        )
    if not timed:
        return history
    by_program = collections.defaultdict(list)
    first = collections.defaultdict(float)
    for name, seconds, call in EVENTS:
        if call == 0:
            first[name] = seconds
        elif call >= 2:
            by_program[name].append(seconds)
    say("  staged programs (blocking on each): calls, median ms, first call s")
    for name in sorted(set(by_program) | set(first)):
        ms = 1000 * np.asarray(by_program.get(name, [np.nan]))
        say(
            f"    {name:18s} {CALLS[name]:5d} {np.median(ms):9.3f} "
            f"{first[name]:9.1f}"
        )
    say("  steady steps (epochs 2+) by the programs they ran:")
    kinds = collections.defaultdict(list)
    for _, seconds, events in rows:
        names = []
        for name, _, _ in events:
            if name not in names:
                names.append(name)
        kinds[" + ".join(names) or "(none)"].append(seconds)
    for kind, seconds in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        ms = 1000 * np.asarray(seconds)
        say(f"    {len(ms):4d} steps  median {np.median(ms):8.2f} ms  {kind}")
    return history


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--allow-tensorflow", action="store_true")
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="skip softmax_highest once this many seconds have passed",
    )
    args = parser.parse_args()
    cfg = QUICK if args.quick else FULL
    parts = args.parts.split(",")

    def attempt(part, fn, *fn_args, default=None):
        """Runs one part; a failure is reported and the next part runs."""
        if part not in parts:
            return default
        try:
            return fn(*fn_args)
        except Exception:  # noqa: BLE001
            say(f"\n== {part} FAILED after {elapsed():.0f} s ==")
            say(traceback.format_exc())
            return default

    attempt("env", env_part, cfg, args.quick)
    attempt("tensorflow", tensorflow_part)
    attempt("scoring", scoring_part, cfg, cfg["calls"])
    x, y = make_data(cfg, cfg["samples"])
    weights = build_classifier(cfg).get_weights()
    softmax_ms = attempt(
        "softmax", softmax_part, cfg, x, y, weights, default=(float("nan"),)
    )[0]
    attempt("skip", skip_part, cfg, x, y, weights, None, softmax_ms)
    attempt("skip_bf16", skip_part, cfg, x, y, weights, "bfloat16", softmax_ms)
    # The same fits without timing each program (no blocking between them),
    # with a fixed break-even (no per-step timing by the meter either), and
    # ASSpeed without a filter.
    for part, precision, ratio in (
        ("skip_untimed", None, None),
        ("skip_bf16_untimed", "bfloat16", None),
        ("skip_fixed_untimed", None, 1 / 3),
        ("asspeed", "none", None),
    ):
        attempt(
            part,
            skip_part,
            cfg,
            x,
            y,
            weights,
            precision,
            softmax_ms,
            False,
            ratio,
        )
    if "softmax_highest" in parts and elapsed() > args.budget_s:
        say(f"\n(softmax_highest skipped: {elapsed():.0f} s elapsed)")
    else:
        attempt("softmax_highest", softmax_part, cfg, x, y, weights, "highest")
    say(f"\ntotal {elapsed():.0f} s")


if __name__ == "__main__":
    main()
