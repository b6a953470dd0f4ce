"""AS-Softmax is not text-specific: handwritten digits, offline.

Trains the same small convolutional network on scikit-learn's bundled
digits (1,797 real 8x8 scans of handwritten digits, 10 classes; UCI
"Optical Recognition of Handwritten Digits", shipped inside scikit-learn, no
download) with softmax cross entropy, AS-Softmax and AS-Speed, for several
seeds, and prints test accuracy (mean ± std), the last epoch's masked ratio,
optimizer updates and training seconds per method.

Usage:

```
pip install -e . -e ./lab   # the harness brings scikit-learn
python examples/digits_image_classification.py          # 3 seeds, ~1-2 minutes
python examples/digits_image_classification.py --quick  # 1 seed, 2 epochs
```
"""

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_as_softmax  # noqa: E402

METHODS = ("softmax", "as_softmax", "as_speed")


def load_digits(seed=0, test_fraction=0.3):
    """Train/test split of scikit-learn's digits, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def build_model():
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dropout(0.2)(h)
    return keras.Model(inputs, keras.layers.Dense(10)(h))  # logits


def train(method, data, seed, epochs, delta=0.3):
    (x_train, y_train), (x_test, y_test) = data
    keras.utils.set_random_seed(seed)
    model = build_model()
    if method == "softmax":
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        metrics = [
            "accuracy",
            keras_as_softmax.MaskedRatio(keras_as_softmax.ASSoftmaxLoss(delta)),
        ]
    else:
        loss = keras_as_softmax.ASSoftmaxLoss(delta)
        metrics = ["accuracy"]
        if method == "as_speed":
            model = keras_as_softmax.ASSpeed(model, lam=0.5, max_steps=4)
        else:
            metrics.append(keras_as_softmax.MaskedRatio(loss))
    model.compile(
        optimizer=keras.optimizers.Adam(2e-3),
        loss=loss,
        metrics=metrics,
        jit_compile=keras.backend.backend() == "tensorflow",
    )
    start = time.perf_counter()
    history = model.fit(
        x_train, y_train, batch_size=32, epochs=epochs, shuffle=True, verbose=0
    )
    seconds = time.perf_counter() - start
    logits = model.predict(x_test, batch_size=256, verbose=0)
    return {
        "test_accuracy": float(np.mean(logits.argmax(-1) == y_test)),
        "masked_ratio": float(history.history["masked_ratio"][-1]),
        "updates": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        "seconds": seconds,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None)
    args = parser.parse_args(argv)
    seeds = args.seeds or (1 if args.quick else 3)
    epochs = args.epochs or (2 if args.quick else 15)
    data = load_digits()
    print(
        f"digits: {len(data[0][1])} train / {len(data[1][1])} test images, "
        f"{epochs} epochs, {seeds} seed(s), backend {keras.backend.backend()}"
    )
    rows = []
    for method in METHODS:
        runs = [train(method, data, seed, epochs) for seed in range(seeds)]
        acc = 100 * np.array([r["test_accuracy"] for r in runs])
        rows.append(
            f"{method:11s} {acc.mean():6.2f} ± {acc.std():4.2f}   "
            f"{100 * np.mean([r['masked_ratio'] for r in runs]):6.1f}%   "
            f"{np.mean([r['updates'] for r in runs]):7.0f}   "
            f"{np.mean([r['seconds'] for r in runs]):6.1f}"
        )
    print("method      test accuracy   masked  updates  train s")
    print("\n".join(rows))
    print(
        "masked: last epoch's share of training images whose AS-Softmax loss "
        "(delta 0.3) is exactly 0 (for softmax: would be)."
    )


if __name__ == "__main__":
    main()
