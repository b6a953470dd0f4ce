"""The accumulation core and the accumulating optimizer, without a model."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_as_softmax as kas
from keras_as_softmax.training import accumulation
from tests.backend_utils import BACKEND


def numpy(state):
    return [ops.convert_to_numpy(t) for t in state.grad_sum], [
        float(ops.convert_to_numpy(t))
        for t in (
            state.micro_batches,
            state.rows,
            state.masked_rows,
            state.steps,
            state.has_grads,
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
    assert counts == [2.0, 16.0, 8.0, 2.0, 1.0]
    assert bool(ops.convert_to_numpy(accumulation.is_due(state)))


def test_add_without_gradients_counts_only():
    state = accumulation.init([np.ones(3, "float32")], steps=2)
    state = accumulation.add(state, [np.ones(3, "float32")], 4, 1)
    state = accumulation.add(state, None, 4, 4)  # no training pass
    grads, counts = numpy(state)
    np.testing.assert_allclose(grads[0], 1.0)
    assert counts == [2.0, 8.0, 5.0, 2.0, 1.0]


def test_finish_window_takes_the_mean_and_follows_the_rule():
    state = accumulation.init([np.zeros(2, "float32")], steps=2)
    state = accumulation.add(state, [np.array([2.0, 4.0], "float32")], 10, 9)
    state = accumulation.add(state, [np.array([4.0, 0.0], "float32")], 10, 9)
    rule = kas.AdaptiveSteps(lam=0.5, max_steps=4)
    mean, fresh = accumulation.finish_window(state, rule)
    np.testing.assert_allclose(ops.convert_to_numpy(mean[0]), [3.0, 2.0])
    _, counts = numpy(fresh)
    # 0.5 * 20 / 2 = 5 > 2: grows by one. The sums are left in place and
    # marked stale: the next window's first gradients replace them, and a
    # window without gradients has a zero mean.
    assert counts == [0.0, 0.0, 0.0, 3.0, 0.0]
    np.testing.assert_array_equal(
        ops.convert_to_numpy(accumulation.window_mean(fresh)[0]), 0.0
    )
    after = accumulation.add(fresh, [np.array([1.0, 1.0], "float32")], 1, 0)
    np.testing.assert_allclose(numpy(after)[0][0], [1.0, 1.0])
    # Several replicas: the optimizer adds their means up again.
    mean, _ = accumulation.finish_window(state, rule, divisor=2)
    np.testing.assert_allclose(ops.convert_to_numpy(mean[0]), [1.5, 1.0])


def test_a_rule_that_returns_no_integer_scalar_is_refused_by_name():
    state = accumulation.init([np.zeros(2, "float32")], steps=2)
    for good in (3, np.int64(3), ops.convert_to_tensor(3)):
        _, fresh = accumulation.finish_window(state, lambda *a, r=good: r)
        assert numpy(fresh)[1][3] == 3.0
    for bad in (2.5, ops.convert_to_tensor(2.0), None, "x", [2]):
        with pytest.raises(ValueError, match="integer scalar.*Received"):
            accumulation.finish_window(state, lambda *a, r=bad: r)


def test_rule_never_decreases_grows_by_one_and_stops_at_the_cap():
    rule = accumulation.next_accumulation_steps
    value = lambda *a: int(ops.convert_to_numpy(rule(*a)))  # noqa: E731
    assert value(3, 10.0, 0.0, 0.5, 4) == 3  # proposal 1 < 3: stays
    assert value(1, 10.0, 9.0, 0.5, 4) == 2  # proposal 5: one at a time
    assert value(4, 10.0, 10.0, 0.5, 4) == 4  # all masked, at the cap
    assert value(2, 0.0, 0.0, 0.5, 4) == 2  # nothing counted: unchanged
    assert value(1, 10.0, 10.0, 0.5, 4) == 2  # all masked proposes growth


def test_rules_are_plug_ins():
    assert accumulation.as_rule(3).initial_steps == 3
    assert int(accumulation.as_rule(3)(3, 10.0, 10.0)) == 3
    adaptive = kas.AdaptiveSteps(0.5, 4)
    assert int(ops.convert_to_numpy(adaptive(1, 10.0, 9.0))) == 2
    assert kas.AdaptiveSteps.from_config(adaptive.get_config()).lam == 0.5
    with pytest.raises(ValueError, match="steps_rule.*'four'"):
        accumulation.as_rule("four")
    with pytest.raises(ValueError, match="`steps_rule`.*steps_rule=0"):
        accumulation.as_rule(0)
    assert accumulation.as_rule(np.int64(2)).initial_steps == 2
    with pytest.raises(ValueError, match="`steps_rule`.*steps_rule=True"):
        accumulation.as_rule(True)
    with pytest.raises(ValueError, match="lam"):
        kas.AdaptiveSteps(lam=0.0)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        kas.AccumulatingOptimizer(
            keras.optimizers.SGD(gradient_accumulation_steps=2), 2
        )


# ------------------------------------------------- the accumulating optimizer


def window_run(
    rule,
    grads,
    counts,
    stateless,
    start=(0.0, 0.0),
    regularizer=None,
    loss_scale=None,
    **kwargs,
):
    """Applies `grads` (one list per micro-batch) with SGD(1) under an
    `AccumulatingOptimizer(rule, **kwargs)` to a variable at `start` with
    `regularizer`: its values after each call, and the optimizer's
    iterations and window length at the end. With `loss_scale`, SGD runs
    in a `LossScaleOptimizer` and the gradients are scaled as it expects."""
    variable = keras.Variable(np.asarray(start, "float32"))
    variable.regularizer = regularizer
    inner = keras.optimizers.SGD(1.0)
    if loss_scale:
        inner = keras.optimizers.LossScaleOptimizer(inner, loss_scale)
        grads = [
            None if g is None else np.multiply(g, loss_scale) for g in grads
        ]
    optimizer = kas.AccumulatingOptimizer(inner, steps_rule=rule, **kwargs)
    optimizer.build([variable])
    values = []
    for g, (rows, masked) in zip(grads, counts):
        g = None if g is None else [np.asarray(g, "float32")]
        if stateless:
            new, state = optimizer.stateless_apply(
                [v.value for v in optimizer.variables],
                g,
                [variable.value],
                rows=rows,
                masked_rows=masked,
            )
            variable.assign(new[0])
            for v, value in zip(optimizer.variables, state):
                v.assign(value)
        else:
            optimizer.apply(g, [variable], rows=rows, masked_rows=masked)
        values.append(ops.convert_to_numpy(variable).tolist())
    steps = int(ops.convert_to_numpy(optimizer.accumulation_steps))
    return values, int(ops.convert_to_numpy(optimizer.iterations)), steps


@pytest.mark.parametrize("stateless", [False, True])
def test_optimizer_applies_the_window_mean_when_due(stateless):
    if stateless and BACKEND != "jax":
        pytest.skip("stateless_apply serves JAX's pure steps")
    grads = [[2.0, 0.0], [4.0, 2.0], [1.0, 1.0], [3.0, 3.0]]
    counts = [(10, 0)] * 4
    values, iterations, steps = window_run(2, grads, counts, stateless)
    # Two micro-batches per update: the mean of each pair, applied once.
    assert values == [[0, 0], [-3, -1], [-3, -1], [-5, -3]]
    assert iterations == 2 and steps == 2


@pytest.mark.parametrize(
    "regularize_weights, loss_scale", [(False, None), (True, None), (True, 8.0)]
)
@pytest.mark.parametrize("stateless", [False, True])
def test_regularize_weights_adds_the_penalty_gradient_once_per_update(
    stateless, regularize_weights, loss_scale
):
    if stateless and BACKEND != "jax":
        pytest.skip("stateless_apply serves JAX's pure steps")
    grads = [[2.0, 0.0], [4.0, 2.0], [1.0, 1.0], [3.0, 3.0]]
    values, iterations, _ = window_run(
        2,
        grads,
        [(10, 0)] * 4,
        stateless,
        start=(2.0, -4.0),
        regularizer=keras.regularizers.L2(0.25),
        loss_scale=loss_scale,
        regularize_weights=regularize_weights,
    )
    if regularize_weights:
        # Each update: the window's mean plus L2's gradient, 0.5 * w, once.
        # [2, -4] - ([3, 1] + [1, -2]), then [-2, -3] - ([2, 2] + [-1, -1.5])
        expected = [[2, -4], [-2, -3], [-2, -3], [-3, -3.5]]
    else:
        # The micro-batch gradients are taken to hold the penalty.
        expected = [[2, -4], [-1, -5], [-1, -5], [-3, -7]]
    np.testing.assert_allclose(values, expected, rtol=1e-6)
    assert iterations == 2


@pytest.mark.parametrize("stateless", [False, True])
def test_a_window_without_gradients_stays_open_and_reuses_no_stale_sums(
    stateless,
):
    if stateless and BACKEND != "jax":
        pytest.skip("stateless_apply serves JAX's pure steps")
    # The first window's sums stay in place after its update. The second
    # window's first two micro-batches had no training pass (`grads=None`):
    # no update (it would move the weights by momentum alone), the window
    # stays open, and its first gradients replace the stale sums. Its mean
    # is over its three micro-batches.
    grads = [[2.0, 0.0], [4.0, 2.0], None, None, [1.0, 1.0], [1.0, 3.0]]
    values, iterations, _ = window_run(2, grads, [(4, 4)] * 6, stateless)
    third = [-3 - 1 / 3, -1 - 1 / 3]
    expected = [[0, 0], [-3, -1], [-3, -1], [-3, -1], third, third]
    np.testing.assert_allclose(values, expected, rtol=1e-6)
    assert iterations == 2


@pytest.mark.parametrize("stateless", [False, True])
def test_optimizer_follows_the_paper_rule(stateless):
    if stateless and BACKEND != "jax":
        pytest.skip("stateless_apply serves JAX's pure steps")
    # Every row masked: the window grows by one per update, up to the cap.
    rule = kas.AdaptiveSteps(lam=0.5, max_steps=3)
    grads = [[1.0, 1.0]] * 6
    values, iterations, steps = window_run(rule, grads, [(8, 8)] * 6, stateless)
    # Windows of 1, 2 and 3 micro-batches.
    assert [v[0] for v in values] == [-1, -1, -2, -2, -2, -3]
    assert iterations == 3 and steps == 3


def test_a_rule_below_one_micro_batch_counts_as_one():
    # A user's callable that returns 0 or less: every call still updates.
    grads = [[1.0, 1.0]] * 3
    for result in (0, -3):
        rule = lambda steps, rows, masked: result  # noqa: B023, E731
        values, iterations, steps = window_run(rule, grads, [(8, 0)] * 3, 0)
        assert [v[0] for v in values] == [-1, -2, -3]
        assert iterations == 3 and steps == 1


def test_optimizer_round_trips_and_forwards_to_the_inner():
    inner = keras.optimizers.AdamW(learning_rate=0.01)
    optimizer = kas.AccumulatingOptimizer(
        inner, kas.AdaptiveSteps(1.0, 2), regularize_weights=True
    )
    assert float(ops.convert_to_numpy(optimizer.learning_rate)) == (
        pytest.approx(0.01)
    )
    config = keras.saving.serialize_keras_object(optimizer)
    restored = keras.saving.deserialize_keras_object(config)
    assert isinstance(restored.inner_optimizer, keras.optimizers.AdamW)
    assert restored.steps_rule.get_config() == {"lam": 1.0, "max_steps": 2}
    assert restored.regularize_weights
    with pytest.raises(ValueError, match="inner_optimizer"):
        kas.AccumulatingOptimizer("adam")


def test_a_model_saved_before_its_first_step_loads_and_trains(tmp_path):
    # Unbuilt, the window has no sums: its variables are the inner
    # optimizer's, as a Keras optimizer's are before its first step.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(
        optimizer=kas.AccumulatingOptimizer(keras.optimizers.Adam(0.1), 2),
        loss="mse",
    )
    assert len(model.optimizer.variables) == len(
        model.optimizer.inner_optimizer.variables
    )
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 2), "float32")
    for m in (model, loaded):
        m.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert int(ops.convert_to_numpy(loaded.optimizer.iterations)) == 1
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize(
    "argument",
    ["learning_rate", "clipnorm", "global_clipnorm", "weight_decay", "use_ema"],
)
def test_optimizer_refuses_update_arguments_meant_for_the_inner(argument):
    # Set on the wrapper, they would act on nothing.
    with pytest.raises(ValueError, match=f"set {argument} on it"):
        kas.AccumulatingOptimizer(keras.optimizers.SGD(), **{argument: 1.0})


@pytest.mark.parametrize("stateless", [False, True])
def test_gradients_for_other_variables_than_built_for_are_refused(stateless):
    # A layer frozen after `compile`: the step's gradients no longer match
    # the window's sums, one for one.
    variables = [keras.Variable(np.ones(n, "float32")) for n in (2, 3)]
    optimizer = kas.AccumulatingOptimizer(keras.optimizers.SGD(), 2)
    optimizer.build(variables)
    grads = [np.zeros(2, "float32")]
    with pytest.raises(ValueError, match="for the 2 trainable.*Received: 1"):
        if stateless:
            optimizer.stateless_apply(
                [v.value for v in optimizer.variables], grads, variables[:1]
            )
        else:
            optimizer.apply(grads, variables[:1])


@pytest.mark.parametrize("loss_scale", [False, True])
def test_exclude_from_weight_decay_reaches_the_optimizer_that_decays(
    loss_scale,
):
    kernel = keras.Variable(np.ones(2, "float32"), name="kernel")
    bias = keras.Variable(np.ones(2, "float32"), name="bias")
    inner = keras.optimizers.AdamW(0.1, weight_decay=1.0)
    if loss_scale:
        inner = keras.optimizers.LossScaleOptimizer(inner, 1.0)
    optimizer = kas.AccumulatingOptimizer(inner)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    optimizer.apply([np.zeros(2, "float32")] * 2, [kernel, bias])
    # AdamW decays `variable -= variable * weight_decay * learning_rate`.
    np.testing.assert_allclose(ops.convert_to_numpy(kernel), 0.9)
    np.testing.assert_allclose(ops.convert_to_numpy(bias), 1.0)
