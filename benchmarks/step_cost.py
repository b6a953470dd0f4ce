"""Where a fine-tuning step's time goes, and what AS-Speed can save of it.

AS-Speed (paper eq. 19) saves optimizer updates: with `s` micro-batches per
update, `1 - 1/s` of the updates are skipped, while every micro-batch still
runs its forward and backward pass. This script times the parts of one
training step of the model that `benchmarks/as_speed.py` fine-tunes
(all-MiniLM-L6-v2 + a 45-class head, AdamW, TensorFlow with XLA), and prints
the bound that follows:

    speed-up <= 1 / (1 - update_share * (1 - 1/s))

It also times the forward and backward pass at a half and a quarter of the
batch: the cost of a lever that trains only on part of a batch. Then it
times that lever, `ASSpeed` with `filters.SkipMasked`, end to end with its
scoring passes: train steps under XLA and as a TensorFlow graph on batches
with 0, 1/2, 3/4 and 7/8 of the samples masked, against the plain step.

Run from the repository root:

    python benchmarks/step_cost.py             # batch 32, length 32, 15 rounds
    python benchmarks/step_cost.py --no-skip   # only the parts of a step
    python benchmarks/step_cost.py --quick     # smoke run

Every part is compiled first, then timed in interleaved rounds; medians are
printed, with each part's share of the full step measured in the same round.
This is a timing script, not a test: nothing here asserts on times.
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Measure the checkout this script lives in, not whichever copy is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--sequence-length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--preset", default="offline-minilm")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument(
        "--no-skip", action="store_true", help="leave out the filtered steps"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_size, args.sequence_length, args.repeats = 8, 8, 2

    import keras
    import numpy as np
    import tensorflow as tf

    import as_softmax_lab as lab
    import keras_as_softmax as kas

    if keras.backend.backend() != "tensorflow":
        print(
            "step_cost.py times TensorFlow with XLA "
            "(KERAS_BACKEND=tensorflow).",
            file=sys.stderr,
        )
        return 2
    keras.utils.set_random_seed(0)
    model = lab.build_classifier("multiclass", 45, args.preset)
    loss = kas.ASSoftmaxLoss(0.3)
    optimizer = keras.optimizers.AdamW(1e-4, weight_decay=0.01)
    variables = model.trainable_variables
    optimizer.build(variables)
    rng = np.random.default_rng(0)

    def batch(size):
        shape = (size, args.sequence_length)
        x = {
            "token_ids": tf.constant(
                rng.integers(1000, 20000, shape).astype("int32")
            ),
            "padding_mask": tf.ones(shape, "int32"),
            "segment_ids": tf.zeros(shape, "int32"),
        }
        return x, tf.constant(rng.integers(0, 45, size).astype("int32"))

    def gradients(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        grads = tape.gradient(value, variables)
        return value, [
            tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
            for g, v in zip(grads, variables, strict=True)
        ]

    @tf.function(jit_compile=True)
    def train_step(x, y):
        value, grads = gradients(x, y)
        optimizer.apply(grads, variables)
        return value

    @tf.function(jit_compile=True)
    def forward_backward(x, y):
        # Returned, so that every gradient is computed and kept.
        return gradients(x, y)

    @tf.function(jit_compile=True)
    def forward(x, y):
        return loss(y, model(x, training=False))

    zeros = [tf.zeros_like(v) for v in variables]

    @tf.function(jit_compile=True)
    def update(grads):
        optimizer.apply(grads, variables)
        return optimizer.iterations

    b = args.batch_size
    full, half, quarter = batch(b), batch(max(b // 2, 1)), batch(max(b // 4, 1))
    parts = {
        f"train step [{b}] (fwd + bwd + AdamW)": lambda: train_step(
            *full
        ).numpy(),
        f"forward + backward [{b}]": lambda: forward_backward(*full)[0].numpy(),
        "AdamW update alone": lambda: update(zeros).numpy(),
        f"inference forward [{b}]": lambda: forward(*full).numpy(),
        f"forward + backward [{b // 2}]": lambda: forward_backward(*half)[
            0
        ].numpy(),
        f"forward + backward [{b // 4}]": lambda: forward_backward(*quarter)[
            0
        ].numpy(),
    }
    names = list(parts)
    start = time.perf_counter()
    for run in parts.values():  # compile, then one warm-up call
        run()
        run()
    n_params = sum(int(np.prod(v.shape)) for v in variables)
    print(
        f"keras {keras.__version__}, tensorflow {tf.__version__} (XLA), "
        f"{os.cpu_count()} CPU cores; "
        f"{args.preset}, batch {b}, length {args.sequence_length}, "
        f"{n_params / 1e6:.1f}M trainable parameters; "
        f"compiled in {time.perf_counter() - start:.0f}s"
    )
    times = {name: [] for name in names}
    shares = {name: [] for name in names}
    for r in range(args.repeats):
        order = names if r % 2 == 0 else names[::-1]
        round_times = {}
        for name in order:
            t = time.perf_counter()
            parts[name]()
            round_times[name] = time.perf_counter() - t
        for name in names:
            times[name].append(round_times[name])
            shares[name].append(round_times[name] / round_times[names[0]])
    print(
        f"\nmedian of {args.repeats} interleaved rounds; "
        "share = part / train step, same round"
    )
    for name in names:
        print(
            f"  {name:<38} {1e3 * statistics.median(times[name]):8.1f} ms   "
            f"share {statistics.median(shares[name]):5.2f}"
        )
    update_share = statistics.median(shares["AdamW update alone"])
    print(
        "\nAS-Speed skips only the AdamW update, "
        f"{100 * update_share:.1f}% of a step here. "
        "Upper bound on its speed-up, every micro-batch accumulated s times:"
    )
    for s in (2, 3, 4, 5):
        bound = 1.0 / (1.0 - update_share * (1.0 - 1.0 / s))
        print(f"  s = {s}: {bound:.3f}x")
    if not args.no_skip:
        skip_masked_steps(model, full, args.repeats, args.quick)
    return 0


def skip_masked_steps(model, data, repeats, quick=False):
    """Times `ASSpeed` with `filters.SkipMasked` end to end, scoring passes
    included: train steps (`train_on_batch`) on batches with a chosen share
    of masked samples, under XLA and as a TensorFlow graph, against the
    plain step, in interleaved rounds of consecutive steps.

    The share is set through the labels: the head's kernel is scaled up so
    that every prediction is confident, then a sample is labelled with its
    predicted class (masked: the target leads by more than delta) or with
    another class (not masked). With half the samples masked, the queue
    fills a training pass every second step, so the cost of a drawn batch
    is the mean over consecutive steps. Every window is one step
    (`max_steps=1`), with a learning rate of 0 so the masks stay as set.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_as_softmax as kas
    from keras_as_softmax import filters

    x, _ = data
    head = model.layers[-1]
    head.kernel.assign(head.kernel * 200.0)
    logits = model(x, training=False)
    predicted = np.argmax(logits, axis=-1)
    batch = len(predicted)
    num_classes = logits.shape[-1]
    steps = 8  # consecutive steps per round: whole queue cycles

    def wrap(skip, jit):
        f = filters.SkipMasked(0.0, warmup_epochs=0) if skip else None
        w = kas.ASSpeed(model, max_steps=1, sample_filter=f)
        # Learning rate 0: the update costs what it always does, and the
        # weights, hence the masks, stay as set up.
        w.compile(
            optimizer=keras.optimizers.AdamW(0.0, weight_decay=0.0),
            loss=kas.ASSoftmaxLoss(0.3),
            jit_compile=jit,
        )
        if skip:
            # What `fit` does before its first batch. The schedule stays at
            # epoch 0 of 1, where a filter with no warm-up is on.
            w._prepare_filters(x, predicted, None, batch, None)
        return w

    parts = {}
    # XLA compiles the filtered step (a scoring and a training pass, each
    # in a conditional) for minutes on 2 CPU cores: the smoke run leaves it
    # out.
    modes = ((False, "graph"),) if quick else ((True, "XLA"), (False, "graph"))
    for jit, mode in modes:
        parts[f"plain step, {mode}"] = (wrap(False, jit), predicted)
        skip = wrap(True, jit)
        for masked in (0, batch // 2, 3 * batch // 4, 7 * batch // 8):
            y = np.where(
                np.arange(batch) < masked,
                predicted,
                (predicted + 1) % num_classes,
            )
            name = f"SkipMasked, {mode}, {masked}/{batch} masked"
            parts[name] = (skip, y)
    names = list(parts)

    def run(name):
        w, y = parts[name]
        out = []
        for _ in range(steps):
            logs = w.train_on_batch(
                x, tf.constant(y.astype("int32")), return_dict=True
            )
            out.append(
                (
                    float(logs["masked_ratio"]),
                    float(logs.get("trained_fraction", 1.0)),
                )
            )
        return np.mean(np.array(out), axis=0)

    for name in names:  # compile, then one warm-up round
        run(name)
        run(name)
    times = {name: [] for name in names}
    shares = {name: [] for name in names}
    measured = {name: [] for name in names}
    for r in range(repeats):
        round_times = {}
        for name in names if r % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            measured[name].append(run(name))
            round_times[name] = (time.perf_counter() - t) / steps
        for name in names:
            times[name].append(round_times[name])
            base = "plain step, XLA" if "XLA" in name else "plain step, graph"
            shares[name].append(round_times[name] / round_times[base])
    print(
        "\nASSpeed train step (train_on_batch), max_steps=1, end to end with "
        f"scoring; mean over {steps} consecutive steps, median of {repeats} "
        "interleaved rounds; x = time / plain step of the same mode, same round"
    )
    for name in names:
        masked_ratio, trained = np.mean(np.array(measured[name]), axis=0)
        print(
            f"  {name:<38} {1e3 * statistics.median(times[name]):8.1f} ms   "
            f"x {statistics.median(shares[name]):5.2f}   "
            f"masked {masked_ratio:4.2f}   trained {trained:4.2f}"
        )


if __name__ == "__main__":
    sys.exit(main())
