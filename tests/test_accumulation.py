"""The accumulation core, without a model."""

import numpy as np
from keras import ops

from keras_as_softmax.training import accumulation


def numpy(state):
    return [ops.convert_to_numpy(t) for t in state.grad_sum], [
        float(ops.convert_to_numpy(t))
        for t in (
            state.micro_batches,
            state.rows,
            state.masked_rows,
            state.steps,
        )
    ]


def test_add_sums_gradients_and_counts():
    state = accumulation.init(
        [np.zeros((2, 3), "float32"), np.zeros(3, "float32")], steps=2
    )
    g1 = [np.ones((2, 3), "float32"), np.arange(3, dtype="float32")]
    g2 = [2 * np.ones((2, 3), "float32"), np.ones(3, "float32")]
    state = accumulation.add(state, g1, 8, 2)
    assert not bool(ops.convert_to_numpy(accumulation.is_due(state)))
    state = accumulation.add(state, g2, 8, 6)
    grads, counts = numpy(state)
    np.testing.assert_allclose(grads[0], 3.0)
    np.testing.assert_allclose(grads[1], [1.0, 2.0, 3.0])
    assert counts == [2.0, 16.0, 8.0, 2.0]
    assert bool(ops.convert_to_numpy(accumulation.is_due(state)))


def test_add_without_gradients_counts_only():
    state = accumulation.init([np.ones(3, "float32")], steps=2)
    state = accumulation.add(state, [np.ones(3, "float32")], 4, 1)
    state = accumulation.add(state, None, 4, 4)  # no training pass
    grads, counts = numpy(state)
    np.testing.assert_allclose(grads[0], 1.0)
    assert counts == [2.0, 8.0, 5.0, 2.0]


def test_finish_window_takes_the_mean_and_follows_the_rule():
    state = accumulation.init([np.zeros(2, "float32")], steps=2)
    state = accumulation.add(state, [np.array([2.0, 4.0], "float32")], 10, 9)
    state = accumulation.add(state, [np.array([4.0, 0.0], "float32")], 10, 9)
    mean, fresh = accumulation.finish_window(state, lam=0.5, max_steps=4)
    np.testing.assert_allclose(ops.convert_to_numpy(mean[0]), [3.0, 2.0])
    grads, counts = numpy(fresh)
    np.testing.assert_array_equal(grads[0], 0.0)
    # 0.5 * 20 / 2 = 5 > 2: grows by one.
    assert counts == [0.0, 0.0, 0.0, 3.0]
    # Several replicas: the optimizer adds their means up again.
    mean, _ = accumulation.finish_window(state, 0.5, 4, divisor=2)
    np.testing.assert_allclose(ops.convert_to_numpy(mean[0]), [1.5, 1.0])


def test_rule_never_decreases_grows_by_one_and_stops_at_the_cap():
    rule = accumulation.next_accumulation_steps
    value = lambda *a: int(ops.convert_to_numpy(rule(*a)))  # noqa: E731
    assert value(3, 10.0, 0.0, 0.5, 4) == 3  # proposal 1 < 3: stays
    assert value(1, 10.0, 9.0, 0.5, 4) == 2  # proposal 5: one at a time
    assert value(4, 10.0, 10.0, 0.5, 4) == 4  # all masked, at the cap
    assert value(2, 0.0, 0.0, 0.5, 4) == 2  # nothing counted: unchanged
    assert value(1, 10.0, 10.0, 0.5, 4) == 2  # all masked proposes growth
