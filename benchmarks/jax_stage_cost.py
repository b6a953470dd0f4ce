"""JAX: what each staged program of a filtered step costs, and what the
conditional around the end of a window costs.

Two parts, each measured side by side in one process:

* `window`: a step on a MiniLM-sized state (22.7M weights, AdamW's two
  moments and the window's gradient sums, donated), with the end of the
  window inside `jax.lax.cond` (taken and not taken) and without a
  conditional (applied, and absent: what the staged step runs when the
  host knows the window is not due). Median of 15 calls.
* `stages`: fits all-MiniLM-L6-v2 on the bundled WordNet task with
  `SkipMasked` (1024 sentences, 5 epochs, batch 32, length 32) and times
  every call of the staged step's programs (decide, score, finish with
  and without a training pass, the end of a window), blocking on each,
  the first five calls of each left out; then the same fit with the end
  of the window in a conditional in every step (as in one program), and
  the softmax step's median in the last epoch. Each fit's compile
  seconds (all its programs) are printed beside it.
* `scoring`: the scoring pass alone, all-MiniLM-L6-v2 with the 45-class
  head on a batch of 32 real sentences of length 32, in training and in
  inference mode, with float32 products and with bfloat16 ones
  (`SkipMasked(score_precision="bfloat16")`), interleaved, median of 15
  calls each; and how far the bfloat16 logits and probabilities are from
  float32's (inference mode, the pretrained backbone).
* `decisions` (run only when named): fine-tunes with AS-Softmax
  (`--train-size` sentences, `--epochs`), then scores every training
  sentence in training and inference mode with float32 products and with
  bfloat16 ones, from the same weights and dropout draws, and counts the
  sentences that one precision masks and the other does not: the
  decisions `SkipMasked` takes from the pass.

    python benchmarks/jax_stage_cost.py
    python benchmarks/jax_stage_cost.py --parts window
    python benchmarks/jax_stage_cost.py --parts scoring
    python benchmarks/jax_stage_cost.py --parts decisions --epochs 4
"""

import argparse
import collections
import os
import sys
import time

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from keras_as_softmax.training import _jax  # noqa: E402

MINILM_WEIGHTS = 22_700_000


def lax_cond(pred, fn, operands):
    return jax.lax.cond(pred, fn, lambda operands: operands, operands)


def median_ms(fn, state, *args, calls=15):
    state = fn(state, *args)
    jax.block_until_ready(state)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        state = fn(state, *args)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times)), state


def window_part():
    pieces = 8
    size = MINILM_WEIGHTS // pieces

    def tensors(value):
        return [
            jax.numpy.full((size,), value, "float32") for _ in range(pieces)
        ]

    state = (tensors(1.0), tensors(0.0) + tensors(0.0), tensors(0.0))

    def apply(operands):
        weights, moments, sums = operands
        weights = [w - 1e-3 * s for w, s in zip(weights, sums)]
        moments = [0.9 * m for m in moments]
        return weights, moments, [0.0 * s for s in sums]

    print("the end of a window, MiniLM-sized state, median ms per step:")
    for pred in (False, True):
        step = jax.jit(
            lambda state, pred: lax_cond(pred, apply, state), donate_argnums=0
        )
        ms, state = median_ms(step, state, pred)
        taken = "taken" if pred else "not taken"
        print(f"  jax.lax.cond, {taken:21s} {ms:7.1f}")
    for name, fn in (("applied", apply), ("absent", lambda state: state)):
        ms, state = median_ms(jax.jit(fn, donate_argnums=0), state)
        print(f"  no conditional, {name:19s} {ms:7.1f}")


def stage_part(train_size, epochs):
    import as_softmax_lab as lab
    from as_softmax_lab import datasets

    backbone = lab.load_backbone("offline-minilm")
    data = datasets.load_text_classification(
        "wordnet",
        max_examples={"train": train_size, "validation": 64, "test": 64},
    )
    prepared = lab.prepare_data(data, backbone.tokenizer, 32)
    times = collections.defaultdict(list)

    class TimedJax:
        """`jax` for `_jax.py`, whose `jit` times each call, blocking."""

        def __getattr__(self, name):
            return getattr(jax, name)

        def jit(self, fn, **kwargs):
            compiled = jax.jit(fn, **kwargs)
            stage = getattr(fn, "args", (None,))[0]
            name = {"decide": "decide", "run": "score"}.get(stage)
            if name is None and fn.__name__ == "<lambda>":
                (train,) = fn.__defaults__
                name = f"finish, {'' if train else 'no '}training pass"
            elif name is None:
                name = {"zeros": "reset of the sums"}.get(
                    fn.__name__, "end of window"
                )

            def timed(*args):
                start = time.perf_counter()
                outputs = compiled(*args)
                jax.block_until_ready(outputs)
                times[name].append(time.perf_counter() - start)
                return outputs

            return timed

    def last_epoch_ms(result):
        return 1000 * float(
            np.median([s for e, _, s in result.step_times if e == epochs])
        )

    trainer = _jax.ASSpeedTrainer
    staged = (trainer._step, trainer._end_window)

    def conditional_every_step(self, state, data, plan, end_window=True):
        return staged[0](self, state, data, plan)

    def no_end_window(self, state):
        return {}, state

    _jax.jax = TimedJax()
    try:
        for name, (step, end_window) in (
            ("its own program, run where due", staged),
            (
                "a conditional in every step",
                (conditional_every_step, no_end_window),
            ),
        ):
            trainer._step, trainer._end_window = step, end_window
            times.clear()
            result = lab.run(
                "as_skip", prepared, backbone, seed=0, epochs=epochs, verbose=0
            )
            print(
                f"SkipMasked, end of window as {name}: last epoch's step "
                f"median {last_epoch_ms(result):.0f} ms, compile "
                f"{result.compile_time:.1f} s; per program:"
            )
            for program, seconds in sorted(times.items()):
                seconds = 1000 * np.asarray(seconds[5:])
                if len(seconds):
                    print(
                        f"  {program:42s} calls {len(seconds):4d} "
                        f"median {np.median(seconds):7.1f} ms"
                    )
    finally:
        _jax.jax = jax
        trainer._step, trainer._end_window = staged
    result = lab.run(
        "softmax", prepared, backbone, seed=0, epochs=epochs, verbose=0
    )
    print(
        f"softmax: last epoch's step median {last_epoch_ms(result):.0f} ms, "
        f"compile {result.compile_time:.1f} s"
    )


def scoring_programs(model, modes=("training", "inference")):
    """`{(mode, precision): jitted scoring pass}`, each returning
    `(y_pred, non-trainable values)` as `model.stateless_call` does."""

    def forward(training):
        def call(trainable, non_trainable, x):
            return model.stateless_call(
                trainable, non_trainable, x, training=training
            )

        return call

    return {
        (mode, precision): jax.jit(
            forward(mode == "training")
            if precision == "float32"
            else _jax.bfloat16_matmuls(forward(mode == "training"))
        )
        for mode in modes
        for precision in ("float32", "bfloat16")
    }


def scoring_part(calls=15):
    import as_softmax_lab as lab
    from as_softmax_lab import datasets

    backbone = lab.load_backbone("offline-minilm")
    data = datasets.load_text_classification(
        "wordnet", max_examples={"train": 32, "validation": 32, "test": 32}
    )
    prepared = lab.prepare_data(data, backbone.tokenizer, 32)
    model = lab.build_classifier("multiclass", prepared.num_classes, backbone)
    x = prepared.train[0]
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    programs = scoring_programs(model)
    outputs = {
        key: jax.block_until_ready(program(trainable, non_trainable, x))[0]
        for key, program in programs.items()
    }
    times = collections.defaultdict(list)
    for _ in range(calls):
        for key, program in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(program(trainable, non_trainable, x))
            times[key].append(time.perf_counter() - start)
    print("the scoring pass, MiniLM, batch 32, length 32, median ms:")
    for (mode, precision), seconds in times.items():
        ms = 1000 * np.median(seconds)
        print(f"  {mode:9s} mode, {precision} products {ms:7.1f}")
    exact, rewritten = (
        outputs[("inference", p)] for p in ("float32", "bfloat16")
    )
    probabilities = [jax.nn.softmax(o) for o in (exact, rewritten)]
    print(
        "  inference mode, bfloat16 against float32: logits within "
        f"{float(np.abs(exact - rewritten).max()):.2g} (largest logit "
        f"{float(np.abs(exact).max()):.2g}), probabilities within "
        f"{float(np.abs(probabilities[0] - probabilities[1]).max()):.2g}"
    )


def decision_part(train_size, epochs, batch_size=32):
    """Whether bfloat16 products change `SkipMasked`'s decisions on a
    trained model: fine-tunes with AS-Softmax, then scores every training
    batch in float32 and in bfloat16 from the same weights and the same
    dropout draws, and counts the samples masked in one and not the
    other."""
    import as_softmax_lab as lab
    from as_softmax_lab import datasets
    from keras_as_softmax.training import _filtering

    backbone = lab.load_backbone("offline-minilm")
    data = datasets.load_text_classification(
        "wordnet",
        max_examples={"train": train_size, "validation": 32, "test": 32},
    )
    prepared = lab.prepare_data(data, backbone.tokenizer, 32)
    model = lab.run(
        "as_softmax",
        prepared,
        backbone,
        seed=0,
        epochs=epochs,
        verbose=0,
        keep_model=True,
    ).model
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    programs = scoring_programs(model)
    x, y = prepared.train
    counts = collections.Counter()
    error, largest = 0.0, 0.0
    for start in range(0, len(y), batch_size):
        rows = slice(start, start + batch_size)
        batch = {name: values[rows] for name, values in x.items()}
        for mode in ("training", "inference"):
            exact, state = programs[mode, "float32"](
                trainable, non_trainable, batch
            )
            rewritten, _ = programs[mode, "bfloat16"](
                trainable, non_trainable, batch
            )
            masked = [
                np.asarray(_filtering.row_values(model.loss, y[rows], o)) == 0
                for o in (exact, rewritten)
            ]
            counts[mode, "rows"] += len(masked[0])
            counts[mode, "masked"] += int(masked[0].sum())
            counts[mode, "differ"] += int((masked[0] != masked[1]).sum())
            error = max(error, float(np.abs(exact - rewritten).max()))
            largest = max(largest, float(np.abs(exact).max()))
        # The next batch draws new dropout masks, the same in both.
        non_trainable = state
    print(
        f"SkipMasked's decisions after {epochs} epochs of AS-Softmax on "
        f"{train_size} sentences, every training sentence scored:"
    )
    for mode in ("training", "inference"):
        print(
            f"  {mode:9s} mode: {counts[mode, 'masked']} of "
            f"{counts[mode, 'rows']} masked with float32 products; "
            f"bfloat16 products decide {counts[mode, 'differ']} of them "
            "otherwise"
        )
    print(
        f"  logits within {error:.2g} of float32's (largest logit "
        f"{largest:.2g})"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="window,stages,scoring")
    parser.add_argument("--train-size", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if "window" in parts:
        window_part()
    if "stages" in parts:
        stage_part(args.train_size, args.epochs)
    if "scoring" in parts:
        scoring_part()
    if "decisions" in parts:
        decision_part(args.train_size, args.epochs)


if __name__ == "__main__":
    main()
