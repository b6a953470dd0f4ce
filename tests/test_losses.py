"""The loss suite: runs on the tensorflow, jax and torch backends in CI."""

import functools
import inspect
import itertools
import json
import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from keras import ops
from keras.src.losses.losses import LossFunctionWrapper

import keras_as_softmax as kas
from tests import reference
from tests.backend_utils import BACKEND
from tests.backend_utils import compiled
from tests.backend_utils import compilers
from tests.backend_utils import release
from tests.backend_utils import to_numpy
from tests.backend_utils import value_and_grad

pytestmark = pytest.mark.multibackend

RNG = np.random.default_rng(1234)


def random_case(shape, num_classes, scale=3.0, ignore_class=None, seed=0):
    rng = np.random.default_rng(seed)
    logits = (scale * rng.standard_normal(shape + (num_classes,))).astype(
        "float32"
    )
    labels = rng.integers(0, num_classes, size=shape).astype("int32")
    if ignore_class is not None:
        labels[rng.random(shape) < 0.3] = ignore_class
    return labels, logits


MULTICLASS = {
    "as_softmax": (
        lambda **kw: kas.ASSoftmaxLoss(delta=0.3, **kw),
        lambda y, o, ic: reference.as_softmax(y, o, 0.3, ic),
    ),
    "as_softmax_delta0": (
        lambda **kw: kas.ASSoftmaxLoss(delta=0.0, **kw),
        lambda y, o, ic: reference.as_softmax(y, o, 0.0, ic),
    ),
    "sparse_softmax": (
        lambda **kw: kas.SparseSoftmaxLoss(k=3, **kw),
        lambda y, o, ic: reference.sparse_softmax(y, o, 3, ic),
    ),
    "am_softmax": (
        lambda **kw: kas.AMSoftmaxLoss(scale=5.0, margin=0.3, **kw),
        lambda y, o, ic: reference.am_softmax(y, o, 5.0, 0.3, ic),
    ),
    "temperature": (
        lambda **kw: kas.TemperatureSoftmaxLoss(temperature=0.5, **kw),
        lambda y, o, ic: reference.temperature_softmax(y, o, 0.5, ic),
    ),
    "sparsemax": (
        lambda **kw: kas.SparsemaxLoss(**kw),
        lambda y, o, ic: reference.sparsemax_loss(y, o, ic),
    ),
    "entmax15": (
        lambda **kw: kas.Entmax15Loss(**kw),
        lambda y, o, ic: reference.entmax15_loss(y, o, ic),
    ),
}


@pytest.mark.parametrize("name", sorted(MULTICLASS))
@pytest.mark.parametrize(
    "shape,num_classes", [((8,), 5), ((4, 6), 9), ((3,), 151), ((3,), 300)]
)
def test_multiclass_matches_numpy_reference(name, shape, num_classes):
    make, ref = MULTICLASS[name]
    labels, logits = random_case(shape, num_classes, seed=num_classes)
    got = to_numpy(make(reduction=None)(labels, logits))
    np.testing.assert_allclose(
        got, ref(labels, logits, None), rtol=2e-5, atol=2e-5
    )


@pytest.mark.parametrize("name", sorted(MULTICLASS))
def test_multiclass_ignore_class_and_sample_weight(name):
    make, ref = MULTICLASS[name]
    labels, logits = random_case((4, 7), 6, ignore_class=-100, seed=3)
    weights = np.random.default_rng(3).random((4,)).astype("float32")
    expected_rows = ref(labels, logits, -100)

    per_row = to_numpy(make(reduction=None, ignore_class=-100)(labels, logits))
    np.testing.assert_allclose(per_row, expected_rows, rtol=2e-5, atol=2e-5)
    assert np.all(per_row[labels == -100] == 0.0)

    # Mean over non-ignored positions, each sample's tokens weighted by its
    # weight.
    valid = labels != -100
    expected = (expected_rows * weights[:, None]).sum() / valid.sum()
    got = make(ignore_class=-100)(labels, logits, sample_weight=weights)
    np.testing.assert_allclose(to_numpy(got), expected, rtol=2e-5)
    total = make(ignore_class=-100, reduction="sum")(
        labels, logits, sample_weight=weights
    )
    np.testing.assert_allclose(
        to_numpy(total), (expected_rows * weights[:, None]).sum(), rtol=2e-5
    )


def test_per_sample_weights_as_a_column_weight_every_token():
    labels, logits = random_case((4, 5), 3, ignore_class=-1, seed=3)
    weights = np.linspace(0.5, 2.0, 4).astype("float32")
    loss = kas.ASSoftmaxLoss(1.0, ignore_class=-1)
    np.testing.assert_allclose(
        to_numpy(loss(labels, logits, sample_weight=weights[:, None])),
        to_numpy(loss(labels, logits, sample_weight=weights)),
    )


def test_ignore_class_mean_matches_keras_sparse_cross_entropy():
    labels, logits = random_case((5, 8), 7, ignore_class=-1, seed=11)
    ours = kas.ASSoftmaxLoss(delta=1.0, ignore_class=-1)(labels, logits)
    theirs = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=-1
    )(labels, logits)
    np.testing.assert_allclose(to_numpy(ours), to_numpy(theirs), rtol=1e-5)


@pytest.mark.parametrize(
    "fn,kwargs",
    [
        (kas.as_softmax_cross_entropy, {"delta": 1.0}),
        (kas.sparse_softmax_cross_entropy, {"k": 7}),
    ],
    ids=["as_softmax", "sparse_softmax"],
)
def test_a_per_sample_function_leaves_ignored_rows_out_as_keras_does(
    fn, kwargs
):
    """Compiled as a function, as Keras's own
    `sparse_categorical_crossentropy(..., ignore_class=...)`: its values
    carry a Keras mask, so the mean is over the rows that count, eager and
    in a compiled step alike."""
    labels, logits = random_case((4, 6), 7, ignore_class=-1, seed=12)
    ours = functools.partial(fn, ignore_class=-1, **kwargs)
    theirs = functools.partial(
        keras.losses.sparse_categorical_crossentropy,
        from_logits=True,
        ignore_class=-1,
    )
    expected = to_numpy(LossFunctionWrapper(theirs)(labels, logits))
    got = to_numpy(LossFunctionWrapper(ours)(labels, logits))
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    inputs = keras.Input((6, 7))
    model = keras.Model(inputs, keras.layers.Dense(7)(inputs))
    results = []
    for loss in (ours, theirs):
        model.compile(loss=loss, jit_compile=BACKEND != "torch")
        results.append(model.evaluate(logits, labels, verbose=0))
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5)


def test_a_keras_mask_and_ignore_class_take_one_mean_as_keras_does():
    """Padding hidden by an `Embedding(mask_zero=True)` and sub-word pieces
    labelled `ignore_class`: the mean is over the rows both keep, taken
    once, as Keras's own loss takes it; the masked ratio counts them."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 10, (4, 6))
    tokens[:, 4:] = 0
    labels = rng.integers(0, 3, (4, 6))
    labels[:, 3] = -1
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(10, 8, mask_zero=True)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    keras_ce = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=-1
    )

    def evaluated(loss, metrics=()):
        model.compile(loss=loss, metrics=list(metrics))
        return model.evaluate(tokens, labels, verbose=0, return_dict=True)

    ours = kas.ASSoftmaxLoss(1.0, ignore_class=-1)
    ratio = kas.MaskedRatio(ours)
    got = evaluated(ours, [ratio])["loss"]
    np.testing.assert_allclose(got, evaluated(keras_ce)["loss"], rtol=1e-5)
    assert to_numpy(ratio.counts)[1] == 12  # 3 of the 6 tokens, 4 rows


@pytest.mark.parametrize("shape", [(16,), (4, 12)])
def test_delta_one_equals_keras_cross_entropy(shape):
    labels, logits = random_case(shape, 11, scale=5.0, seed=7)
    ours = kas.ASSoftmaxLoss(delta=1.0, reduction=None)(labels, logits)
    theirs = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None
    )(labels, logits)
    np.testing.assert_allclose(
        to_numpy(ours), to_numpy(theirs), rtol=1e-5, atol=1e-6
    )
    weights = np.linspace(0.5, 2.0, shape[0]).astype("float32")
    ours = kas.ASSoftmaxLoss(delta=1.0)(labels, logits, sample_weight=weights)
    # Keras wants the weights broadcast to the label shape; ours take [batch].
    theirs = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
        labels,
        logits,
        sample_weight=np.broadcast_to(
            weights.reshape((-1,) + (1,) * (len(shape) - 1)), shape
        ),
    )
    np.testing.assert_allclose(to_numpy(ours), to_numpy(theirs), rtol=1e-5)


def test_probabilities_and_one_hot_labels():
    labels, logits = random_case((10,), 6, seed=5)
    expected = reference.as_softmax(labels, logits, 0.2)
    probs = to_numpy(ops.softmax(logits))
    onehot = np.eye(6, dtype="float32")[labels]
    for loss, y, x in [
        (
            kas.ASSoftmaxLoss(0.2, reduction=None, from_logits=False),
            labels,
            probs,
        ),
        (
            kas.ASSoftmaxLoss(0.2, reduction=None, label_mode="categorical"),
            onehot,
            logits,
        ),
        (kas.ASSoftmaxLoss(0.2, reduction=None), labels[:, None], logits),
    ]:
        np.testing.assert_allclose(
            to_numpy(loss(y, x)), expected, rtol=1e-4, atol=1e-5
        )


def test_probabilities_of_zero_count_as_keras_counts_them():
    """A target probability of 0 (an underflow, frequent in float16) costs
    what Keras's own cross entropy charges for it, `-log(epsilon)`, not
    the log of float32's smallest number; a target of probability 1 is
    still masked, exactly 0."""
    probs = np.array(
        [[0.0, 1.0, 0.0], [0.0, 0.5, 0.5], [1.0, 0.0, 0.0]], "float32"
    )
    labels = np.array([0, 0, 0])
    ours = to_numpy(
        kas.ASSoftmaxLoss(1.0, from_logits=False, reduction=None)(labels, probs)
    )
    keras_ce = keras.losses.SparseCategoricalCrossentropy(reduction=None)
    np.testing.assert_allclose(
        ours, to_numpy(keras_ce(labels, probs)), rtol=1e-5, atol=1e-6
    )
    masked = kas.ASSoftmaxLoss(0.3, from_logits=False, reduction=None)
    assert to_numpy(masked(labels, probs))[2] == 0.0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_easy_rows_have_exactly_zero_loss_and_gradient(dtype):
    logits = np.array(
        [[9.0, 0.0, 1.0, -2.0], [0.0, 6.0, 0.0, 0.0], [1.0, 1.1, 0.9, 0.0]],
        dtype,
    )
    labels = np.array([0, 1, 1])
    values, grad = value_and_grad(
        lambda x: kas.as_softmax_cross_entropy(labels, x, delta=0.3), logits
    )
    assert values[0] == 0.0 and values[1] == 0.0 and values[2] > 0.0
    assert np.all(grad[:2] == 0.0)
    assert np.any(grad[2] != 0.0)


@pytest.mark.parametrize("num_classes", [7, 300])  # both row layouts
def test_classes_all_is_softmax_cross_entropy_on_the_rows_not_masked(
    num_classes,
):
    labels, logits = random_case((3, 8), num_classes, scale=4.0, seed=3)
    logits = logits.astype("float64")
    logits[0, :, :] = 0.0
    logits[0, np.arange(8), labels[0]] = 30.0  # these rows are masked
    sparse = kas.as_softmax_cross_entropy(labels, logits, delta=0.3)
    masked = to_numpy(sparse) == 0.0
    assert masked[0].all() and not masked[1:].all()
    values, grad = value_and_grad(
        lambda x: kas.as_softmax_cross_entropy(
            labels, x, delta=0.3, classes="all"
        ),
        logits,
    )
    assert np.all(values[masked] == 0.0) and np.all(grad[masked] == 0.0)
    # Elsewhere softmax cross entropy and its gradient, every class kept.
    expected = reference.as_softmax(labels, logits, 1.0)
    np.testing.assert_allclose(values[~masked], expected[~masked], rtol=1e-9)
    expected_grad = reference.as_softmax_grad(
        labels.reshape(-1), logits.reshape(-1, num_classes), 1.0
    ).reshape(logits.shape)
    np.testing.assert_allclose(
        grad[~masked], expected_grad[~masked], rtol=1e-9, atol=1e-12
    )
    loss = kas.ASSoftmaxLoss(0.3, classes="all")
    assert kas.ASSoftmaxLoss.from_config(loss.get_config()).classes == "all"
    with pytest.raises(ValueError, match="Expected `classes` 'kept' or 'all'"):
        kas.ASSoftmaxLoss(0.3, classes="every")


def test_multilabel_masked_row_is_exactly_zero():
    y = np.array([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    logits = np.array(
        [[8.0, -9.0, 8.0, -9.0], [0.5, 0.0, -1.0, 0.2]], "float64"
    )
    values, grad = value_and_grad(
        lambda x: kas.multilabel_as_softmax_cross_entropy(y, x, delta=0.3),
        logits,
    )
    assert values[0] == 0.0 and np.all(grad[0] == 0.0)
    # No positives: nothing may be dropped, so the unmasked loss applies.
    np.testing.assert_allclose(values[1], reference.multilabel(y, logits)[1])


@pytest.mark.parametrize(
    "num_classes", [7, 300]
)  # both row layouts (<= 256 and past it)
@pytest.mark.parametrize("shape", [(5,), (2, 3)])
def test_gradient_matches_analytic_for_any_row_count(num_classes, shape):
    labels, logits = random_case(
        shape, num_classes, scale=1.0, seed=num_classes
    )
    logits = logits.astype("float64")
    _, grad = value_and_grad(
        lambda x: kas.as_softmax_cross_entropy(labels, x, delta=0.02), logits
    )
    expected = reference.as_softmax_grad(
        labels.reshape(-1), logits.reshape(-1, num_classes), 0.02
    ).reshape(logits.shape)
    np.testing.assert_allclose(grad, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("delta", [0.0, 0.1, 0.3, 1.0])
def test_gradient_matches_analytic_and_finite_differences(delta):
    labels, logits = random_case((6,), 7, scale=2.0, seed=int(delta * 10))
    logits = logits.astype("float64")
    values, grad = value_and_grad(
        lambda x: kas.as_softmax_cross_entropy(labels, x, delta=delta), logits
    )
    assert values.dtype == np.float64
    np.testing.assert_allclose(
        grad,
        reference.as_softmax_grad(labels, logits, delta),
        rtol=1e-9,
        atol=1e-12,
    )
    eps = 1e-6
    numeric = np.zeros_like(logits)
    for idx in np.ndindex(logits.shape):
        up, down = logits.copy(), logits.copy()
        up[idx] += eps
        down[idx] -= eps
        numeric[idx] = (
            reference.as_softmax(labels, up, delta).sum()
            - reference.as_softmax(labels, down, delta).sum()
        ) / (2 * eps)
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7)


FD_FUNCTIONS = {
    "multilabel_as": (
        lambda y, x: kas.multilabel_as_softmax_cross_entropy(y, x, delta=0.05),
        lambda y, x: reference.multilabel(y, x, 0.05),
        "multi_hot",
    ),
    "multilabel": (
        kas.multilabel_categorical_crossentropy,
        lambda y, x: reference.multilabel(y, x),
        "multi_hot",
    ),
    "sparse_softmax": (
        lambda y, x: kas.sparse_softmax_cross_entropy(y, x, k=3),
        lambda y, x: reference.sparse_softmax(y, x, 3),
        "int",
    ),
    "am_softmax": (
        lambda y, x: kas.am_softmax_cross_entropy(y, x, scale=3.0, margin=0.2),
        lambda y, x: reference.am_softmax(y, x, 3.0, 0.2),
        "int",
    ),
    "sparsemax": (kas.sparsemax_loss, reference.sparsemax_loss, "int"),
    "entmax15": (kas.entmax15_loss, reference.entmax15_loss, "int"),
}


@pytest.mark.parametrize("name", sorted(FD_FUNCTIONS))
def test_other_losses_finite_difference_gradients(name):
    fn, ref, kind = FD_FUNCTIONS[name]
    rng = np.random.default_rng(21)
    logits = 2.0 * rng.standard_normal((5, 6))
    if kind == "int":
        y = rng.integers(0, 6, size=(5,))
    else:
        y = (rng.random((5, 6)) < 0.3).astype("float64")
    values, grad = value_and_grad(lambda x: fn(y, x), logits)
    np.testing.assert_allclose(values, ref(y, logits), rtol=1e-7, atol=1e-9)
    eps = 1e-6
    numeric = np.zeros_like(logits)
    for idx in np.ndindex(logits.shape):
        up, down = logits.copy(), logits.copy()
        up[idx] += eps
        down[idx] -= eps
        numeric[idx] = (ref(y, up).sum() - ref(y, down).sum()) / (2 * eps)
    np.testing.assert_allclose(grad, numeric, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("shape,num_classes", [((6,), 5), ((3, 4), 4)])
@pytest.mark.parametrize("delta", [0.0, 0.05, 0.5])
def test_multilabel_matches_numpy_reference(shape, num_classes, delta):
    rng = np.random.default_rng(num_classes)
    logits = (3 * rng.standard_normal(shape + (num_classes,))).astype("float32")
    y = (rng.random(shape + (num_classes,)) < 0.4).astype("float32")
    y.reshape(-1, num_classes)[0] = 0.0  # a row without positives
    y.reshape(-1, num_classes)[1] = 1.0  # a row without negatives
    got = kas.MultiLabelASSoftmaxLoss(delta, reduction=None)(y, logits)
    np.testing.assert_allclose(
        to_numpy(got),
        reference.multilabel(y, logits, delta),
        rtol=2e-5,
        atol=2e-5,
    )
    got = kas.MultiLabelCategoricalCrossentropy(reduction=None)(y, logits)
    np.testing.assert_allclose(
        to_numpy(got), reference.multilabel(y, logits), rtol=2e-5, atol=2e-5
    )


def test_multilabel_is_stable_for_huge_logits():
    y = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]], "float32")
    logits = np.array([[-500.0, 300.0, 1e4], [1e4, -1e4, 200.0]], "float32")
    values, grad = value_and_grad(
        lambda x: kas.multilabel_as_softmax_cross_entropy(y, x, 0.05), logits
    )
    np.testing.assert_allclose(values, [1e4 + 500.0, 1e4 + 1e4], rtol=1e-6)
    assert np.all(np.isfinite(grad))


@pytest.mark.parametrize(
    "loss",
    [
        kas.ASSoftmaxLoss(0.3, ignore_class=-1),
        kas.SparseSoftmaxLoss(k=3),
        kas.SparsemaxLoss(),
        kas.Entmax15Loss(),
    ],
    ids=lambda loss: loss.name,
)
def test_compiled_equals_eager(loss):
    labels, logits = random_case((8, 5), 12, ignore_class=-1, seed=2)
    labels = (
        np.where(labels == -1, 0, labels)
        if loss.ignore_class is None
        else labels
    )
    jit = compiled(lambda y, x: loss(y, x))
    if jit is None:
        pytest.skip(f"no XLA compilation on the {BACKEND} backend")
    np.testing.assert_allclose(
        to_numpy(jit(labels, logits)), to_numpy(loss(labels, logits)), rtol=1e-6
    )


def test_delta_variable_changes_compiled_value_on_tensorflow():
    if BACKEND != "tensorflow":
        pytest.skip(
            "JAX and torch are covered by the DeltaWarmup training test"
        )
    loss = kas.ASSoftmaxLoss(delta=1.0, reduction=None)
    labels, logits = random_case((32,), 4, scale=4.0, seed=9)
    jit = compiled(lambda y, x: loss(y, x))
    before = to_numpy(jit(labels, logits))
    loss.delta.assign(0.1)
    after = to_numpy(jit(labels, logits))
    np.testing.assert_allclose(
        after, reference.as_softmax(labels, logits, 0.1), rtol=1e-5
    )
    assert np.sum(after == 0) > np.sum(before == 0)


finite_or_inf = st.one_of(
    st.floats(-1e4, 1e4, width=32),
    st.sampled_from([-1e4, 1e4, -np.inf, 0.0]),
)


@settings(max_examples=40, deadline=None)
@given(
    logits=st.lists(
        st.lists(finite_or_inf, min_size=5, max_size=5), min_size=1, max_size=4
    ),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    delta=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 1000),
)
def test_extreme_logits_never_give_nan_or_inf(logits, dtype, delta, seed):
    logits = np.array(logits, "float32")
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 5, size=len(logits))
    # A target at -inf has an infinite cross entropy by definition; keep it
    # finite.
    logits[np.arange(len(logits)), labels] = np.nan_to_num(
        logits[np.arange(len(logits)), labels], neginf=-1e4
    )
    x = ops.cast(logits, dtype)
    for fn in (
        lambda v: kas.as_softmax_cross_entropy(labels, v, delta=delta),
        lambda v: kas.sparse_softmax_cross_entropy(labels, v, k=2),
        lambda v: kas.multilabel_as_softmax_cross_entropy(
            np.eye(5, dtype="float32")[labels], v, delta=delta
        ),
        lambda v: kas.multilabel_categorical_crossentropy(np.eye(5)[labels], v),
    ):
        values = to_numpy(fn(x))
        assert values.dtype == np.float32
        assert np.all(np.isfinite(values)) and np.all(values >= -1e-3)
    values, grad = value_and_grad(
        lambda v: kas.as_softmax_cross_entropy(labels, v, delta=delta), logits
    )
    assert np.all(np.isfinite(values)) and np.all(np.isfinite(grad))


def test_half_precision_logits_compute_in_float32():
    labels, logits = random_case((16,), 3000, seed=4)
    for dtype in ("float16", "bfloat16"):
        x = ops.cast(logits, dtype)
        got = to_numpy(kas.ASSoftmaxLoss(0.3, reduction=None)(labels, x))
        ref = reference.as_softmax(
            labels, to_numpy(ops.cast(x, "float32")), 0.3
        )
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "name",
    ["as_softmax", "sparse_softmax", "temperature", "sparsemax", "entmax15"],
)
def test_a_large_common_offset_of_the_logits_leaves_the_loss(name):
    """These losses are shift-invariant. Logits offset by 2**20 (exact in
    float32 for these eighths) give the loss of the logits without it:
    what the loss adds to the offset is not rounded away against it, nor
    is an unmasked row's loss rounded to 0."""
    make, ref = MULTICLASS[name]
    rng = np.random.default_rng(3)
    eighths = [
        rng.choice(np.arange(-24, 25), 6, replace=False) for _ in range(16)
    ]
    logits = (np.array(eighths) / 8).astype("float32")
    labels = rng.integers(0, 6, 16)
    expected = ref(labels, logits.astype("float64"), None)
    got = make(reduction=None)(labels, logits + np.float32(2**20))
    np.testing.assert_allclose(to_numpy(got), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- bad input


def test_bad_delta_and_hyperparameters():
    for bad in (-0.1, 1.5, float("nan"), "a"):
        with pytest.raises(ValueError, match="delta"):
            kas.ASSoftmaxLoss(delta=bad)
        with pytest.raises(ValueError, match="delta"):
            kas.MultiLabelASSoftmaxLoss(delta=bad)
    with pytest.raises(ValueError, match="k"):
        kas.SparseSoftmaxLoss(k=0)
    with pytest.raises(ValueError, match="label_mode"):
        kas.ASSoftmaxLoss(label_mode="sparse")
    with pytest.raises(ValueError, match="ignore_class"):
        kas.ASSoftmaxLoss(label_mode="categorical", ignore_class=0)
    with pytest.raises(ValueError, match="temperature"):
        kas.TemperatureSoftmaxLoss(temperature=0.0)
    labels, logits = random_case((4,), 5)
    # The per-sample functions check what their classes check.
    with pytest.raises(ValueError, match="scale.*-1"):
        kas.am_softmax_cross_entropy(labels, logits, scale=-1.0)
    with pytest.raises(ValueError, match="margin.*-5"):
        kas.am_softmax_cross_entropy(labels, logits, margin=-5.0)
    for fn in (kas.sparsemax_loss, kas.entmax15_loss):
        with pytest.raises(ValueError, match="from_logits"):
            fn(labels, logits, from_logits=False)


def test_delta_held_by_a_variable_or_tensor_is_checked_by_its_value():
    # A variable or tensor outside [0, 1] would mask every row (loss 0).
    for bad in (-1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"delta.*Received: delta="):
            kas.ASSoftmaxLoss(delta=keras.Variable(bad))
        with pytest.raises(ValueError, match="delta"):
            kas.MultiLabelASSoftmaxLoss(delta=ops.convert_to_tensor(bad))
    assert float(to_numpy(kas.ASSoftmaxLoss(np.array(0.4)).delta)) == (
        pytest.approx(0.4)
    )
    # So is one given to the per-sample functions, and it is a scalar.
    labels, logits = random_case((4,), 3)
    for fn, y in (
        (kas.as_softmax_cross_entropy, labels),
        (kas.multilabel_as_softmax_cross_entropy, np.eye(3)[labels]),
    ):
        for bad in (1.5, float("nan")):
            with pytest.raises(ValueError, match="Received: delta="):
                fn(y, logits, delta=ops.convert_to_tensor(bad))
        with pytest.raises(ValueError, match=r"scalar.*delta.shape=\(2,\)"):
            fn(y, logits, delta=ops.convert_to_tensor([0.3, 0.3]))


def test_a_variable_given_as_delta_gives_its_value_on_every_backend():
    # The loss keeps a variable of its own: assigning either one leaves the
    # other as it is (on PyTorch, a variable made from another shared its
    # storage), and reads it without a warning (a trainable torch
    # variable's value tracks gradients).
    given = keras.Variable(0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = kas.ASSoftmaxLoss(delta=given, reduction=None)
    given.assign(1.0)
    assert float(to_numpy(loss.delta)) == pytest.approx(0.3)
    loss.delta.assign(0.6)
    assert float(to_numpy(given)) == 1.0
    with pytest.raises(ValueError, match=r"scalar.*delta.shape=\(2,\)"):
        kas.ASSoftmaxLoss(delta=keras.Variable([0.3, 0.3]))


def test_a_delta_assigned_outside_0_1_is_refused_by_the_config():
    # Its config would not load (`from_config` checks delta).
    loss = kas.ASSoftmaxLoss(0.3)
    for bad in (-0.5, 1.5, float("nan")):
        loss.delta.assign(bad)
        with pytest.raises(ValueError, match=r"\[0, 1\].*holds"):
            loss.get_config()
    loss.delta.assign(0.5)
    assert type(loss).from_config(loss.get_config()).get_config() == (
        loss.get_config()
    )


@pytest.mark.parametrize("multilabel", [False, True], ids=["int", "multilabel"])
def test_a_delta_assigned_outside_0_1_is_refused_eagerly_and_nan_compiled(
    multilabel,
):
    """Read where the loss runs: it would otherwise mask every row (a loss
    of 0, nothing trains) or none. A compiled step cannot raise: its loss
    is NaN, which `TerminateOnNaN` stops at."""
    labels, logits = random_case((8,), 3, seed=5)
    if multilabel:
        loss, labels = kas.MultiLabelASSoftmaxLoss(0.05), np.eye(3)[labels]
    else:
        loss = kas.ASSoftmaxLoss(0.3)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    model.compile(loss=loss, jit_compile=BACKEND != "torch")
    assert np.isfinite(model.evaluate(logits, labels, verbose=0))
    for bad in (-0.5, 1.5, float("nan")):
        loss.delta.assign(bad)
        with pytest.raises(ValueError, match=r"delta.*Received: delta="):
            loss(labels, logits)
        if BACKEND == "torch":
            continue  # eager: refused as above
        model.make_test_function(force=True)  # JAX holds the traced delta
        assert np.isnan(model.evaluate(logits, labels, verbose=0))


def test_multilabel_loss_traces_with_an_unknown_number_of_classes():
    if BACKEND != "tensorflow":
        pytest.skip("JAX and torch trace with static shapes")
    import tensorflow as tf

    loss = kas.MultiLabelASSoftmaxLoss(0.3)
    graph = tf.function(
        lambda y, x: loss(y, x),
        input_signature=[tf.TensorSpec([None, None], "float32")] * 2,
    )
    labels = np.eye(6, dtype="float32")[[0, 2, 5, 1]]
    logits = np.random.default_rng(3).normal(size=(4, 6)).astype("float32")
    np.testing.assert_allclose(
        to_numpy(graph(labels, logits)),
        to_numpy(loss(labels, logits)),
        rtol=1e-6,
    )


def test_other_hyperparameters_are_checked():
    for bad in (float("nan"), -0.1, "0.3"):
        with pytest.raises(ValueError, match="margin"):
            kas.AMSoftmaxLoss(margin=bad)
    for bad in ("yes", None, 1):
        with pytest.raises(ValueError, match="from_logits"):
            kas.ASSoftmaxLoss(from_logits=bad)


def test_sample_weight_with_a_unit_axis_weights_rows_as_keras_does():
    labels, logits = random_case((6,), 4)
    weights = np.arange(1.0, 7.0, dtype="float32")
    expected = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
        labels, logits, sample_weight=weights[:, None]
    )
    for loss in (kas.ASSoftmaxLoss(1.0), kas.TemperatureSoftmaxLoss(1.0)):
        got = loss(labels, logits, sample_weight=weights[:, None])
        np.testing.assert_allclose(to_numpy(got), to_numpy(expected), 1e-5)


def test_sample_weight_of_another_shape_names_both_shapes():
    labels, logits = random_case((2,), 3)
    with pytest.raises(ValueError, match=r"\(2,\).*sample_weight.shape=\(3,\)"):
        kas.ASSoftmaxLoss()(labels, logits, sample_weight=np.ones(3))
    tokens, token_logits = random_case((1, 2), 3)
    # [batch] weights of another batch size would broadcast over the tokens.
    with pytest.raises(ValueError, match=r"\(1,\) \(one per sample\)"):
        kas.ASSoftmaxLoss()(tokens, token_logits, sample_weight=np.ones(2))
    with pytest.raises(ValueError, match="sample_weight"):
        kas.MultiLabelASSoftmaxLoss()(
            np.eye(3)[:2], logits, sample_weight=np.ones((2, 3))
        )


def test_categorical_labels_must_be_one_hot():
    _, logits = random_case((3,), 3)
    loss = kas.ASSoftmaxLoss(label_mode="categorical", reduction=None)
    jit = compiled(lambda y, x: loss(y, x))
    for bad in ([[0.5, 0.5, 0.0]], [[0.0, 0.0, 0.0]], [[1.0, 1.0, 0.0]]):
        labels = np.concatenate([np.eye(3)[:2], np.array(bad)])
        with pytest.raises(ValueError, match="one-hot"):
            loss(labels, logits)
        if jit is None:
            continue
        # Compiled, nothing is read back: the row has no target, and an
        # infinite loss, as an integer label out of range (not its
        # argmax's loss, nor Keras's 0 for an all-zero row).
        values = to_numpy(jit(labels.astype("float32"), logits))
        np.testing.assert_allclose(
            values[:2], to_numpy(loss(np.eye(3)[:2], logits[:2])), rtol=1e-6
        )
        assert values[2] == np.inf


@pytest.mark.parametrize("first", ["fit", "evaluate"])
def test_one_hot_labels_pass_keras_building_the_loss(first):
    # Keras builds a model's loss on placeholders first; on PyTorch they
    # are tensors of ones, which the one-hot check must not read. Eager
    # steps check the real labels.
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])
    loss = kas.ASSoftmaxLoss(label_mode="categorical")
    model.compile("sgd", loss, run_eagerly=True)
    x = RNG.standard_normal((16, 6)).astype("float32")
    y = np.eye(4, dtype="float32")[RNG.integers(0, 4, 16)]
    getattr(model, first)(x, y, verbose=0)
    with pytest.raises(ValueError, match="one-hot"):
        model.evaluate(x, 2 * y, verbose=0)


def test_labels_of_another_shape_with_ignore_class_name_both_shapes():
    labels, logits = random_case((2, 5), 3)
    with pytest.raises(ValueError, match=r"\(2, 5\).*y_true.shape=\(2, 4\)"):
        kas.ASSoftmaxLoss(ignore_class=-1)(labels[:, :4], logits)


def test_multilabel_as_loss_carries_nan_logits():
    labels = np.array([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]], "float32")
    logits = np.array([[np.nan, 0.0, 0.0], [5.0, -5.0, -5.0]], "float32")
    values = to_numpy(
        kas.MultiLabelASSoftmaxLoss(0.05, reduction=None)(labels, logits)
    )
    assert np.isnan(values[0]) and values[1] == 0.0, values
    values = to_numpy(
        kas.MultiLabelASSoftmaxLoss(1.0, reduction=None)(labels, logits)
    )
    assert np.isnan(values[0]) and np.isfinite(values[1]), values


_NAN_LOGITS = np.array(
    [[2.0, np.nan, 0.0, 1.0], [np.nan, 1.0, 0.0, 1.0], [3.0, 0.0, 0.0, 0.0]],
    "float32",
)


@pytest.mark.parametrize(
    "loss",
    [
        lambda y, x: kas.as_softmax_cross_entropy(y, x, delta=0.3),
        lambda y, x: kas.as_softmax_cross_entropy(y, x, delta=0.0),
        lambda y, x: kas.sparse_softmax_cross_entropy(y, x, k=2),
        lambda y, x: kas.am_softmax_cross_entropy(y, x),
        lambda y, x: kas.sparsemax_loss(y, x),
        lambda y, x: kas.multilabel_as_softmax_cross_entropy(
            ops.one_hot(y, 4), x, delta=0.05
        ),
        lambda y, x: kas.multilabel_categorical_crossentropy(
            ops.one_hot(y, 4), x
        ),
    ],
    ids=["as", "as_delta0", "sparse", "am", "sparsemax", "ml_as", "mlce"],
)
def test_a_nan_logit_gives_its_row_nan_eager_and_compiled(loss):
    # As softmax cross entropy does: `TerminateOnNaN` sees it, and the row
    # is not counted as masked. TensorFlow's XLA row max skips NaN, which
    # gave a masked row's 0.0 there.
    labels = np.array([0, 1, 0], "int32")
    runs = [loss, compiled(loss)] if compiled(loss) else [loss]
    if BACKEND == "tensorflow":
        import tensorflow as tf

        if release(tf.__version__) < (2, 21):
            # XLA's fast min and max, the CPU default before 2.21, clip
            # NaN to a bound (README; XLA_FLAGS restores NaN there).
            runs = [loss]
    for run in runs:
        values = to_numpy(run(labels, _NAN_LOGITS))
        assert np.isnan(values[:2]).all() and np.isfinite(values[2]), values


@pytest.mark.parametrize("delta", [0.0, 1e-9])
def test_a_near_tie_that_keeps_only_the_target_is_exactly_zero(delta):
    # Both exponentials round to 1.0, so only the target is kept, but
    # `log(e_t) - (o_t - max)` is a rounding, 2e-8, not 0.
    logits = np.array([[2e-8, 0.0], [0.0, 2e-8]], "float32")
    labels = np.array([1, 0])
    for run in [None, compiled]:
        fn = lambda x: kas.as_softmax_cross_entropy(labels, x, delta=delta)  # noqa: E731
        if run is not None:
            fn = run(fn)
            if fn is None:
                continue
        values = to_numpy(fn(logits))
        assert np.all(values == 0.0), values
    _, grad = value_and_grad(
        lambda x: kas.as_softmax_cross_entropy(labels, x, delta=delta), logits
    )
    assert np.all(grad == 0.0), grad


def test_logits_without_classes_are_refused_by_shape():
    labels, _ = random_case((4,), 3)
    with pytest.raises(ValueError, match=r"one class.*shape=\(4, 0\)"):
        kas.ASSoftmaxLoss()(labels, np.zeros((4, 0), "float32"))
    for loss in (
        kas.MultiLabelASSoftmaxLoss(),
        kas.MultiLabelCategoricalCrossentropy(),
    ):
        with pytest.raises(ValueError, match=r"one class.*shape=\(4, 0\)"):
            loss(np.zeros((4, 0)), np.zeros((4, 0), "float32"))


def test_k_larger_than_classes():
    labels, logits = random_case((4,), 5)
    with pytest.raises(ValueError, match=r"k.*<=.*\(5\).*k=9"):
        kas.SparseSoftmaxLoss(k=9)(labels, logits)


def test_shape_mismatch_names_both_shapes():
    labels, logits = random_case((4, 3), 5)
    with pytest.raises(
        ValueError, match=r"y_true.shape=\(4,\).*y_pred.shape=\(4, 3, 5\)"
    ):
        kas.ASSoftmaxLoss()(labels[:, 0], logits)
    with pytest.raises(ValueError, match="one-hot"):
        kas.ASSoftmaxLoss(label_mode="categorical")(
            np.eye(4)[[0, 1, 2, 3]], logits[:, 0]
        )
    with pytest.raises(ValueError, match="multi-hot"):
        kas.MultiLabelASSoftmaxLoss()(np.ones((4, 4)), logits[:, 0])


@pytest.mark.parametrize("classes", [5, 300])  # the two paths to the target
def test_labels_out_of_range_are_reported_eagerly(classes):
    labels, logits = random_case((4,), classes)
    labels[2] = classes
    with pytest.raises(
        ValueError, match=rf"\[0, {classes - 1}\].*\[{classes}\]"
    ):
        kas.ASSoftmaxLoss()(labels, logits)
    labels[2] = -3
    with pytest.raises(ValueError, match="ignore_class=-100"):
        kas.ASSoftmaxLoss(ignore_class=-100)(labels, logits)
    # Compiled, nothing is read back: the row's loss is infinite, as the
    # docstring says, and the others' are as without it; the baselines'
    # too. On TensorFlow also in a graph without XLA, as `fit` runs it on
    # CPUs by default (where a gather refuses an index out of range).
    for per_row, compile_fn in itertools.product(
        (
            kas.ASSoftmaxLoss(reduction=None),
            kas.SparseSoftmaxLoss(k=2, reduction=None),
            kas.AMSoftmaxLoss(reduction=None),
            kas.TemperatureSoftmaxLoss(reduction=None),
            kas.SparsemaxLoss(reduction=None),
            kas.Entmax15Loss(reduction=None),
        ),
        compilers(),
    ):
        jit = compile_fn(lambda y, x, loss=per_row: loss(y, x))
        if jit is None:
            break
        for bad in (classes, -1):
            labels[2] = bad
            got = to_numpy(jit(labels, logits))
            assert np.isposinf(got[2]), (per_row, got)
        labels[2] = 0
        expected = to_numpy(per_row(labels, logits))
        np.testing.assert_allclose(
            np.delete(got, 2), np.delete(expected, 2), rtol=1e-5, atol=1e-6
        )


def test_half_precision_labels_with_many_classes_are_refused():
    labels, logits = random_case((4,), 3000)
    with pytest.raises(ValueError, match="float16"):
        kas.ASSoftmaxLoss(dtype="float16")(labels, logits)


EMPTY_CASES = [
    (lambda **kw: kas.ASSoftmaxLoss(0.3, ignore_class=-1, **kw), (0,), 5),
    (lambda **kw: kas.ASSoftmaxLoss(0.3, ignore_class=-1, **kw), (0, 3), 5),
    (lambda **kw: kas.ASSoftmaxLoss(0.3, **kw), (0,), 300),
    (lambda **kw: kas.SparseSoftmaxLoss(k=2, **kw), (0,), 5),
    (lambda **kw: kas.AMSoftmaxLoss(**kw), (0, 3), 5),
    (lambda **kw: kas.TemperatureSoftmaxLoss(**kw), (0,), 5),
    (lambda **kw: kas.SparsemaxLoss(**kw), (0, 3), 5),
    (lambda **kw: kas.Entmax15Loss(**kw), (0,), 5),
    (lambda **kw: kas.MultiLabelASSoftmaxLoss(**kw), (0,), 5),
    (lambda **kw: kas.MultiLabelCategoricalCrossentropy(**kw), (0,), 5),
]


@pytest.mark.parametrize("case", range(len(EMPTY_CASES)))
def test_empty_batch_gives_empty_rows_and_zero_loss(case):
    make, shape, num_classes = EMPTY_CASES[case]
    logits = np.zeros(shape + (num_classes,), "float32")
    multilabel = "MultiLabel" in type(make()).__name__
    labels = np.zeros(logits.shape if multilabel else shape, "int32")
    per_row = make(reduction=None)
    assert to_numpy(per_row(labels, logits)).shape == shape
    _, grad = value_and_grad(lambda x: per_row(labels, x), logits)
    assert grad.shape == logits.shape
    for reduction in ("sum_over_batch_size", "sum", "mean"):
        loss = make(reduction=reduction)
        got = to_numpy(loss(labels, logits))
        assert got.shape == () and got == 0.0
        weights = np.ones((0,), "float32")
        got = to_numpy(loss(labels, logits, sample_weight=weights))
        assert got.shape == () and got == 0.0
        jit = compiled(lambda y, x, loss=loss: loss(y, x))
        if jit is not None:
            assert to_numpy(jit(labels, logits)) == 0.0


@pytest.mark.parametrize("bad", [0.5, 2.0, -1.0, np.nan])
def test_multilabel_targets_outside_zero_one_are_refused(bad):
    y = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], "float32")
    y[1, 2] = bad
    logits = np.zeros((2, 3), "float32")
    for loss in (
        kas.MultiLabelASSoftmaxLoss(),
        kas.MultiLabelCategoricalCrossentropy(),
        kas.multilabel_categorical_crossentropy,
        kas.multilabel_as_softmax_cross_entropy,
    ):
        with pytest.raises(
            ValueError, match=rf"multi-hot.*other than 0 and 1.*\[{bad}\]"
        ):
            loss(y, logits)
    # Compiled, nothing is read back: the row's loss is infinite, as a
    # one-hot row that is not one (not the loss of its labels rounded to 0
    # or 1), and the other rows' as without it. On TensorFlow also in a
    # graph without XLA, as `fit` runs it on CPUs by default.
    for per_row, compile_fn in itertools.product(
        (
            kas.MultiLabelASSoftmaxLoss(0.3, reduction=None),
            kas.MultiLabelCategoricalCrossentropy(reduction=None),
        ),
        compilers(),
    ):
        jit = compile_fn(lambda a, b, loss=per_row: loss(a, b))
        if jit is None:
            continue
        values = to_numpy(jit(y, logits))
        assert values[1] == np.inf
        np.testing.assert_allclose(
            values[0], to_numpy(per_row(y[:1], logits[:1]))[0], rtol=1e-6
        )
    # In `fit`, the log shows it, and the step still trains on the others:
    # the row's gradient is 0, not NaN, also at extreme logits and deltas.
    # PyTorch's eager step refuses it.
    x = np.array([[1.0, 0.0, 0.0], [0.0, 1e4, 0.0]], "float32")
    for loss in (
        kas.MultiLabelASSoftmaxLoss(0.0),
        kas.MultiLabelASSoftmaxLoss(0.3),
        kas.MultiLabelASSoftmaxLoss(1.0),
        kas.MultiLabelCategoricalCrossentropy(),
    ):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3)])
        # Row 0's positive is its weakest class (never masked), row 1's
        # logits are +-1e4.
        kernel = np.zeros((3, 3), "float32")
        kernel[1, 1:] = [1.0, -1.0]
        model.layers[0].kernel.assign(kernel)
        model.layers[0].bias.assign([-1.0, 0.0, 1.0])
        model.compile("sgd", loss)
        if BACKEND == "torch":
            with pytest.raises(ValueError, match="multi-hot"):
                model.fit(x, y, verbose=0)
            continue
        before = to_numpy(model.layers[0].kernel)
        history = model.fit(x, y, batch_size=2, verbose=0)
        assert history.history["loss"] == [np.inf]
        after = to_numpy(model.layers[0].kernel)
        assert np.isfinite(after).all() and not np.allclose(after, before)


@pytest.mark.parametrize("bad", [-0.2, 1.5])
def test_from_logits_false_refuses_non_probabilities(bad):
    labels, logits = random_case((4,), 3)
    probs = to_numpy(ops.softmax(logits))
    probs[1, 2] = bad
    for make in (
        kas.ASSoftmaxLoss,
        kas.SparseSoftmaxLoss,
        kas.AMSoftmaxLoss,
        kas.TemperatureSoftmaxLoss,
    ):
        loss = (
            make(from_logits=False)
            if make is not kas.SparseSoftmaxLoss
            else (make(k=2, from_logits=False))
        )
        with pytest.raises(ValueError, match=rf"probabilities.*\[{bad}\]"):
            loss(labels, probs)
    with pytest.raises(ValueError, match="from_logits=False"):
        kas.as_softmax_cross_entropy(labels, probs, from_logits=False)
    probs[1, 2] = 1.0  # the bounds themselves are probabilities
    kas.ASSoftmaxLoss(from_logits=False)(labels, probs)


def test_non_integral_float_labels_are_refused():
    labels, logits = random_case((4,), 5)
    floats = labels.astype("float32")
    expected = to_numpy(kas.ASSoftmaxLoss(reduction=None)(labels, logits))
    # Keras casts labels to the loss dtype: integral floats are labels.
    got = to_numpy(kas.ASSoftmaxLoss(reduction=None)(floats, logits))
    np.testing.assert_array_equal(got, expected)
    floats[2] = 0.5
    for loss in (kas.ASSoftmaxLoss(), kas.SparsemaxLoss(ignore_class=-1)):
        with pytest.raises(ValueError, match=r"integer labels.*\[0.5\]"):
            loss(floats, logits)
    with pytest.raises(ValueError, match="integer labels"):
        kas.as_softmax_cross_entropy(floats, logits)


def test_masked_rows_reads_the_mask_of_any_keras_loss():
    labels = np.array([[0, 1, -1]])
    logits = np.array([[[9.0, 0.0], [0.0, 0.1], [9.0, 0.0]]], "float32")
    for loss in (
        kas.ASSoftmaxLoss(0.3, ignore_class=-1),
        keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=-1
        ),
        # `ignore_class` only in the function's keyword arguments, where
        # Keras's own losses keep it after 3.15.
        LossFunctionWrapper(
            keras.losses.sparse_categorical_crossentropy,
            from_logits=True,
            ignore_class=-1,
        ),
    ):
        masked, counted = kas.masked_rows(loss, labels, logits)
        np.testing.assert_array_equal(to_numpy(counted), [[True, True, False]])
    np.testing.assert_array_equal(to_numpy(masked), [[False, False, False]])
    masked, _ = kas.masked_rows(
        kas.ASSoftmaxLoss(0.3, ignore_class=-1), labels, logits
    )
    np.testing.assert_array_equal(to_numpy(masked), [[True, False, False]])


# ------------------------------------------------------------ serialization

ALL_LOSSES = [
    kas.ASSoftmaxLoss(delta=0.2, ignore_class=-1, reduction="sum", name="as"),
    kas.MultiLabelASSoftmaxLoss(delta=0.1),
    kas.MultiLabelCategoricalCrossentropy(),
    kas.SparseSoftmaxLoss(k=4, label_mode="categorical"),
    kas.AMSoftmaxLoss(scale=8.0, margin=0.35),
    kas.TemperatureSoftmaxLoss(temperature=0.5, from_logits=False),
    kas.SparsemaxLoss(ignore_class=-1),
    kas.Entmax15Loss(),
]


@pytest.mark.parametrize(
    "loss", ALL_LOSSES, ids=lambda loss: type(loss).__name__
)
def test_config_round_trip(loss):
    config = loss.get_config()
    json.dumps(config)
    clone = type(loss).from_config(config)
    assert clone.get_config() == config
    restored = keras.losses.deserialize(keras.losses.serialize(loss))
    assert type(restored) is type(loss) and restored.get_config() == config


@pytest.mark.parametrize(
    "loss", ALL_LOSSES, ids=lambda loss: type(loss).__name__
)
def test_config_lists_exactly_the_constructor_arguments(loss):
    params = inspect.signature(type(loss).__init__).parameters
    assert set(loss.get_config()) == set(params) - {"self"}


def test_masked_ratio_metric_counts_only_counted_rows():
    loss = kas.ASSoftmaxLoss(0.3, ignore_class=-1)
    metric = kas.MaskedRatio(loss)
    labels = np.array([[0, 1, -1], [1, -1, -1]])
    logits = np.zeros((2, 3, 2), "float32")
    logits[0, 0, 0] = 9.0  # masked
    logits[0, 1, 0] = 9.0  # wrong and confident: not masked
    logits[1, 0, 1] = 9.0  # masked, but its sample has weight 0
    logits[:, 2] = [9.0, 0.0]  # ignored positions, all "easy"
    metric.update_state(labels, logits, sample_weight=np.array([1.0, 0.0]))
    assert float(metric.result()) == 0.5
    loss.delta.assign(0.0)
    metric.reset_state()
    metric.update_state(labels, logits)
    assert float(metric.result()) == pytest.approx(2 / 3)
    clone = kas.MaskedRatio.from_config(metric.get_config())
    assert clone.loss.ignore_class == -1


def _tiny_model(num_classes=4):
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(hidden))


def test_keras_file_round_trip_in_fresh_process(tmp_path):
    loss = kas.ASSoftmaxLoss(delta=0.25, ignore_class=-1)
    model = _tiny_model()
    model.compile(optimizer="adam", loss=loss, metrics=[kas.MaskedRatio(loss)])
    x = np.random.default_rng(0).standard_normal((32, 6)).astype("float32")
    y = np.random.default_rng(0).integers(0, 4, size=(32,))
    model.fit(x, y, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    expected = model.evaluate(x, y, verbose=0, return_dict=True)

    loaded = keras.saving.load_model(path)
    assert loaded.loss.get_config() == loss.get_config()
    got = loaded.evaluate(x, y, verbose=0, return_dict=True)
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)

    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    script = f"""
import json, numpy as np, keras
import keras_as_softmax  # registers the classes
m = keras.saving.load_model({path!r})
x = np.load({str(tmp_path / "x.npy")!r})
y = np.load({str(tmp_path / "y.npy")!r})
r = m.evaluate(x, y, verbose=0, return_dict=True)
print(json.dumps({{"loss": r["loss"], "delta": m.loss.get_config()["delta"],
                  "cls": type(m.loss).__name__}}))
"""
    env = dict(os.environ, KERAS_BACKEND=BACKEND)
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["cls"] == "ASSoftmaxLoss"
    assert result["delta"] == pytest.approx(0.25)
    np.testing.assert_allclose(result["loss"], expected["loss"], rtol=1e-5)


def test_sparsemax_and_entmax15_take_arrays():
    x = np.array([[1.0, 0.5, 0.0]], "float32")
    np.testing.assert_allclose(to_numpy(kas.sparsemax(x)), [[0.75, 0.25, 0]])
    np.testing.assert_allclose(to_numpy(kas.entmax15(x)).sum(), 1.0, 1e-6)


def test_infinite_logits_give_the_same_finite_loss_compiled():
    # Infinities clip to +-1e30; compiled, the scaled logits must not be
    # rounded apart, which overflowed `exp(o - max)` to inf.
    logits = np.array(
        [[2.0, np.inf, 0.0], [np.inf, 1.0, 0.0], [-np.inf, -np.inf, -np.inf]],
        "float32",
    )
    labels = np.array([0, 0, 0])
    for fn in (
        lambda y, x: kas.am_softmax_cross_entropy(y, x, scale=10.0),
        lambda y, x: kas.temperature_softmax_cross_entropy(y, x, 0.25),
    ):
        eager = to_numpy(fn(labels, logits))
        assert np.all(np.isfinite(eager)), eager
        if compiled(fn) is not None:
            np.testing.assert_allclose(
                to_numpy(compiled(fn)(labels, logits)), eager, rtol=1e-6
            )
