"""The multi-label losses' fused formulation against the spec (section 2).

The losses are written for XLA (per-side copies of the logits, masks as
thresholds on the logits and as arithmetic inside the row sums, a
written-out gradient). These tests pin what that must not change: values
and gradients equal the NumPy reference, masked rows give exactly 0.0,
infinite and huge logits stay finite, eager equals compiled. No timings.
"""

import numpy as np
import pytest

import keras_as_softmax as kas
from tests import reference
from tests.backend_utils import compiled
from tests.backend_utils import to_numpy
from tests.backend_utils import value_and_grad

pytestmark = pytest.mark.multibackend

LIMIT = 1e30  # logits are clipped to +-1e30


def _case(rows, num_classes, seed, scale=3.0, positives=0.3):
    rng = np.random.default_rng(seed)
    logits = scale * rng.standard_normal((rows, num_classes))
    labels = (rng.random((rows, num_classes)) < positives).astype("float64")
    labels[0] = 0.0  # a row without positives
    labels[1] = 1.0  # a row without negatives
    return labels, logits


def _reference_grad(labels, logits, delta, eps=1e-6):
    """Central differences of the float64 reference, masks held fixed
    (they are constants for differentiation)."""
    grad = np.zeros_like(logits)
    for idx in np.ndindex(logits.shape):
        up, down = logits.copy(), logits.copy()
        up[idx] += eps
        down[idx] -= eps
        grad[idx] = (
            _fixed_mask_loss(labels, up, logits, delta).sum()
            - _fixed_mask_loss(labels, down, logits, delta).sum()
        ) / (2 * eps)
    return grad


def _fixed_mask_loss(labels, logits, mask_logits, delta):
    """The reference loss at `logits` with the masks of `mask_logits`."""
    out = np.zeros(labels.shape[:-1])
    for idx in np.ndindex(out.shape):
        o, pos = logits[idx], labels[idx] > 0.5
        neg = ~pos
        z_neg, z_pos = neg.copy(), pos.copy()
        if delta is not None:
            m = mask_logits[idx]
            p = np.exp(m - m.max())
            p /= p.sum()
            if pos.any():
                z_neg &= ~(p[pos].min() - p >= delta)
            if neg.any():
                z_pos &= ~(p - p[neg].max() >= delta)
        out[idx] = np.logaddexp.reduce(np.append(o[z_neg], 0.0)) + (
            np.logaddexp.reduce(np.append(-o[z_pos], 0.0))
        )
    return out


@pytest.mark.parametrize("delta", [0.0, 0.02, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("num_classes", [7, 40])
def test_values_and_gradients_match_the_reference(delta, num_classes):
    labels, logits = _case(6, num_classes, seed=num_classes, scale=2.0)
    values, grad = value_and_grad(
        lambda x: kas.multilabel_as_softmax_cross_entropy(labels, x, delta),
        logits,
    )
    np.testing.assert_allclose(
        values, reference.multilabel(labels, logits, delta), rtol=1e-9
    )
    np.testing.assert_allclose(
        grad, _reference_grad(labels, logits, delta), rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize("num_classes", [7, 40])
def test_unmasked_loss_matches_the_reference(num_classes):
    labels, logits = _case(6, num_classes, seed=3 + num_classes)
    values, grad = value_and_grad(
        lambda x: kas.multilabel_categorical_crossentropy(labels, x), logits
    )
    np.testing.assert_allclose(
        values, reference.multilabel(labels, logits), rtol=1e-9
    )
    np.testing.assert_allclose(
        grad, _reference_grad(labels, logits, None), rtol=1e-5, atol=1e-7
    )


def test_delta_one_equals_the_unmasked_loss():
    labels, logits = _case(8, 30, seed=5)
    logits = logits.astype("float32")
    np.testing.assert_allclose(
        to_numpy(kas.multilabel_as_softmax_cross_entropy(labels, logits, 1.0)),
        to_numpy(kas.multilabel_categorical_crossentropy(labels, logits)),
        rtol=1e-6,
    )


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("delta", [0.0, 0.05, 0.3])
def test_masked_rows_are_exactly_zero(dtype, delta):
    # The weakest positive leads the strongest negative by more than delta
    # in every row, at several logit scales (also past exp's range).
    labels = np.array(
        [
            [1.0, 0.0, 0.0, 1.0, 0.0],
            [0.0, 1.0, 0.0, 0.0, 0.0],
            [1.0, 1.0, 0.0, 0.0, 0.0],
            [1.0, 0.0, 0.0, 0.0, 0.0],
        ]
    )
    logits = np.array(
        [
            [9.0, -3.0, -4.0, 9.0, -5.0],
            [-200.0, 300.0, -250.0, -1e4, -260.0],
            [50.0, 50.2, -40.0, -41.0, -39.0],
            [1e30, -1e30, 0.0, 1e29, -5.0],
        ],
        dtype,
    )
    values, grad = value_and_grad(
        lambda x: kas.multilabel_as_softmax_cross_entropy(labels, x, delta),
        logits,
    )
    assert np.all(values == 0.0), values
    assert np.all(grad == 0.0), grad


def test_rows_without_positives_or_negatives_are_never_masked():
    labels = np.array([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    logits = np.array([[-9.0, -8.0, -20.0], [9.0, 8.0, 20.0]])
    values, grad = value_and_grad(
        lambda x: kas.multilabel_as_softmax_cross_entropy(labels, x, 0.3),
        logits,
    )
    np.testing.assert_allclose(
        values, reference.multilabel(labels, logits), rtol=1e-9
    )
    assert np.all(values > 0.0) and np.all(grad != 0.0)


@pytest.mark.parametrize(
    "loss",
    [
        lambda y, x: kas.multilabel_as_softmax_cross_entropy(y, x, 0.05),
        kas.multilabel_categorical_crossentropy,
    ],
    ids=["as_softmax", "unmasked"],
)
def test_infinite_and_huge_logits(loss):
    inf = np.inf
    labels = np.array(
        [
            [1.0, 0.0, 0.0, 0.0],
            [0.0, 1.0, 1.0, 0.0],
            [1.0, 0.0, 1.0, 0.0],
            [0.0, 0.0, 1.0, 1.0],
        ],
        "float32",
    )
    logits = np.array(
        [
            [-inf, -inf, -inf, -inf],  # every logit clipped to -1e30
            [inf, -inf, 3.0, 1e35],
            [500.0, 300.0, -1e4, 2.0],
            [-inf, 80.0, 90.0, -3.0],
        ],
        "float32",
    )
    values, grad = value_and_grad(lambda x: loss(labels, x), logits)
    assert np.all(np.isfinite(values)) and np.all(np.isfinite(grad))
    clipped = np.clip(logits.astype("float64"), -LIMIT, LIMIT)
    delta = 0.05 if "as_softmax" in str(loss) else None
    expected = reference.multilabel(labels, clipped, delta)
    np.testing.assert_allclose(values, expected, rtol=1e-6)


@pytest.mark.parametrize("delta", [0.0, 0.05, 0.35])
def test_compiled_equals_eager(delta):
    labels, logits = _case(16, 50, seed=11)
    labels, logits = labels.astype("float32"), logits.astype("float32")

    def loss(y, x):
        return kas.multilabel_as_softmax_cross_entropy(y, x, delta)

    if compiled(loss) is None:
        pytest.skip("no XLA compilation on this backend")
    np.testing.assert_allclose(
        to_numpy(compiled(loss)(labels, logits)),
        to_numpy(loss(labels, logits)),
        rtol=1e-6,
        atol=1e-6,
    )
