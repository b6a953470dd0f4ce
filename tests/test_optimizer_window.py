"""`AccumulatingOptimizer`'s window without a model: two variables (one
float32 matrix, one float64 vector, so the window's sums take two
buffers), SGD as the inner optimizer, and exact numbers.

`tests/test_accumulation.py` covers the window's mean on one variable
(`apply` and, on JAX, `stateless_apply` with gradients), the paper's rule,
weight penalties and the optimizer's config; here: a window of several
variables that moves them by `learning_rate` times its mean only once
full, `accumulate` then `apply(None)` (the filtered steps' path), a
window that holds no gradient, and the pure forms `stateless_window`,
`stateless_accumulate`, `stateless_with_window` and `stateless_apply`
against the stateful ones.
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_as_softmax as kas
from tests.backend_utils import BACKEND
from tests.backend_utils import run_json_script

LR = 0.5
DTYPES = ("float32", "float64")
START = (np.arange(6.0).reshape(2, 3), np.array([1.0, -2.0, 4.0]))


def make_variables():
    return [
        keras.Variable(value, dtype=dtype, name=f"v{i}")
        for i, (value, dtype) in enumerate(zip(START, DTYPES))
    ]


def make_optimizer(variables, rule, momentum=0.0):
    optimizer = kas.AccumulatingOptimizer(
        keras.optimizers.SGD(learning_rate=LR, momentum=momentum),
        steps_rule=rule,
    )
    optimizer.build(variables)
    return optimizer


def micro_batch(i):
    """Micro-batch `i`'s gradients: small integers, so that a window's
    mean over 1, 2 or 4 micro-batches, times `LR`, is exact."""
    rng = np.random.default_rng(i)
    return [
        rng.integers(-4, 5, np.shape(value)).astype(dtype)
        for value, dtype in zip(START, DTYPES)
    ]


# Counted and masked rows of micro-batch `i`: AdaptiveSteps(0.5, 3) grows
# the window by one at the end of each (all rows masked).
ROWS, MASKED = 8.0, 8.0


def values(variables):
    return [ops.convert_to_numpy(v) for v in variables]


def counts(optimizer):
    """`[micro-batches, rows, masked rows, steps, has_grads]`."""
    return ops.convert_to_numpy(optimizer.window_counts).tolist()


def iterations(optimizer):
    return int(ops.convert_to_numpy(optimizer.iterations))


def assert_values_equal(actual, expected):
    for a, e, dtype in zip(actual, expected, DTYPES):
        assert a.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(a, np.asarray(e, dtype))


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_a_full_window_moves_the_variables_by_lr_times_its_mean(steps):
    """Each variable moves by `LR` times its gradients' mean over the
    window's `steps` micro-batches when the window fills, and not before;
    the counts follow each micro-batch and reset with the update."""
    variables = make_variables()
    optimizer = make_optimizer(variables, kas.FixedSteps(steps))
    assert counts(optimizer) == [0, 0, 0, steps, 0]
    expected = [np.array(v) for v in START]
    window = []
    for i in range(2 * steps):
        grads = micro_batch(i)
        optimizer.apply(grads, variables, rows=ROWS, masked_rows=i)
        window.append(grads)
        if len(window) == steps:
            for j, e in enumerate(expected):
                e -= LR * np.mean([g[j] for g in window], axis=0)
            window = []
            assert counts(optimizer) == [0, 0, 0, steps, 0]
        else:
            masked = sum(range(i + 1 - len(window), i + 1))
            assert counts(optimizer) == [
                len(window),
                ROWS * len(window),
                masked,
                steps,
                1,
            ]
        assert_values_equal(values(variables), expected)
        assert iterations(optimizer) == (i + 1) // steps
    # The update really moved them: the comparison above is not trivial.
    assert not np.array_equal(expected[0], START[0])


RULES = {
    "fixed": lambda: kas.FixedSteps(2),
    "adaptive": lambda: kas.AdaptiveSteps(lam=0.5, max_steps=3),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_accumulate_then_apply_none_is_apply_with_the_gradients(rule):
    """A filtered step adds a pass's gradients where the pass runs
    (`accumulate`), then counts the micro-batch (`apply(None, ...)`): the
    same updates, counts and window lengths as `apply(grads, ...)`, with
    momentum, which would show an update too many."""
    plain, split = make_variables(), make_variables()
    plain_opt = make_optimizer(plain, RULES[rule](), momentum=0.5)
    split_opt = make_optimizer(split, RULES[rule](), momentum=0.5)
    for i in range(9):
        grads = micro_batch(i)
        plain_opt.apply(grads, plain, rows=ROWS, masked_rows=MASKED)
        split_opt.accumulate(grads)
        split_opt.apply(None, split, rows=ROWS, masked_rows=MASKED)
        assert_values_equal(values(split), values(plain))
        assert counts(split_opt) == counts(plain_opt)
        assert iterations(split_opt) == iterations(plain_opt)
    # Windows of 2 micro-batches; AdaptiveSteps: of 1, 2, 3, then 3.
    assert iterations(plain_opt) == {"fixed": 4, "adaptive": 4}[rule]
    assert counts(plain_opt)[3] == {"fixed": 2, "adaptive": 3}[rule]


def test_a_window_without_a_gradient_does_not_update():
    """Micro-batches without a training pass (`apply(None)`, nothing
    accumulated) count, but a window that holds no gradient stays open
    past its length: no update, which SGD's momentum would make visible.
    The next gradient ends it, its mean taken over all its micro-batches."""
    variables = make_variables()
    optimizer = make_optimizer(variables, kas.FixedSteps(2), momentum=0.5)
    g0, g1, g2 = micro_batch(0), micro_batch(1), micro_batch(2)
    optimizer.apply(g0, variables, rows=ROWS)
    optimizer.apply(g1, variables, rows=ROWS)
    after_first = values(variables)
    assert iterations(optimizer) == 1
    for n in range(1, 4):
        optimizer.apply(None, variables, rows=ROWS, masked_rows=MASKED)
        assert_values_equal(values(variables), after_first)
        assert iterations(optimizer) == 1
        assert counts(optimizer) == [n, n * ROWS, n * MASKED, 2, 0]
    optimizer.apply(g2, variables, rows=ROWS)
    assert iterations(optimizer) == 2
    assert counts(optimizer) == [0, 0, 0, 2, 0]
    # SGD with momentum 0.5: velocity v = 0.5 v - LR * g, w += v, where
    # g is each window's mean (the second over 4 micro-batches).
    for j, dtype in enumerate(DTYPES):
        v1 = -LR * (g0[j] + g1[j]) / 2
        v2 = 0.5 * v1 - LR * g2[j] / 4
        expected = START[j] + v1 + v2
        np.testing.assert_array_equal(
            values(variables)[j], expected.astype(dtype)
        )


def _zero_grads():
    return [np.zeros(np.shape(v), dtype) for v, dtype in zip(START, DTYPES)]


def test_zeros_from_no_training_pass_do_not_end_a_window_on_one_device():
    """`apply(zeros, from_pass=False)`: zeros that stand for no training
    pass count as no gradient, as `apply`'s docstring says."""
    variables = make_variables()
    optimizer = make_optimizer(variables, kas.FixedSteps(2), momentum=0.5)
    for _ in range(3):
        optimizer.apply(_zero_grads(), variables, rows=ROWS, from_pass=False)
    assert iterations(optimizer) == 0
    assert counts(optimizer) == [3, 3 * ROWS, 0, 2, 0]


MIRRORED_FROM_PASS = """
import json
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)
import keras
import numpy as np

import keras_as_softmax as kas

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def run(from_pass_of_zeros):
    with strategy.scope():
        variable = keras.Variable(np.zeros(2, "float32"))
        optimizer = kas.AccumulatingOptimizer(
            keras.optimizers.SGD(0.5, momentum=0.5), kas.FixedSteps(2)
        )
        optimizer.build([variable])

    @tf.function
    def step(grad, from_pass):
        def replica():
            # Each replica's half: the replicas' sum is `grad`.
            optimizer.apply(
                [grad / 2], [variable], rows=8.0, from_pass=from_pass
            )

        strategy.run(replica)

    seen = []
    zeros = tf.zeros(2)
    for _ in range(3):
        step(zeros, tf.constant(from_pass_of_zeros))
        seen.append(int(optimizer.iterations.numpy()))
    step(tf.constant([2.0, -4.0]), tf.constant(True))
    seen.append(int(optimizer.iterations.numpy()))
    return seen, variable.numpy().tolist()


print(json.dumps({"no_pass": run(False), "pass": run(True)}))
"""


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute")
def test_zeros_from_no_training_pass_do_not_end_a_window_on_replicas():
    """Under `MirroredStrategy` (2 CPUs), replicas all-reduce zeros where
    no training pass ran: with `from_pass=False` they count as micro-batches
    without a gradient, the window stays open, and the first gradient ends
    it with its mean over all 4; zeros from a pass end windows as usual."""
    result = run_json_script(MIRRORED_FROM_PASS)
    no_pass_iterations, no_pass_value = result["no_pass"]
    assert no_pass_iterations == [0, 0, 0, 1]
    assert no_pass_value == [-0.25, 0.5]  # -0.5 * [2, -4] / 4
    pass_iterations, pass_value = result["pass"]
    # Windows [0, 0] and [0, g]: two updates, the second by [2, -4] / 2.
    assert pass_iterations == [0, 1, 1, 2]
    assert pass_value == [-0.5, 1.0]


# ------------------------------------------------------------- stateless


def optimizer_values(optimizer):
    return [v.value for v in optimizer.variables]


def test_stateless_window_and_with_window_round_trip():
    """`stateless_window` takes the window's values (its sums, then its
    counts) out of the optimizer's, in the order of `variables`;
    `stateless_with_window` puts a window back, leaving the inner
    optimizer's values as they were; `stateless_accumulate` adds
    gradients to the sums without counting a micro-batch."""
    variables = make_variables()
    optimizer = make_optimizer(variables, kas.FixedSteps(3))
    state = optimizer_values(optimizer)
    window = optimizer.stateless_window(state)
    # One buffer of sums per dtype, then the counts.
    assert len(window) == len(optimizer.grad_sums) + 1 == len(DTYPES) + 1
    for got, variable in zip(
        window, [*optimizer.grad_sums, optimizer.window_counts]
    ):
        assert got is variable.value
    back = optimizer.stateless_with_window(state, window)
    assert len(back) == len(state)
    assert all(a is b for a, b in zip(back, state))

    g0, g1 = micro_batch(0), micro_batch(1)
    grads = [ops.convert_to_tensor(g) for g in g0]
    window = optimizer.stateless_accumulate(window, grads)
    window = optimizer.stateless_accumulate(
        window, [ops.convert_to_tensor(g) for g in g1]
    )
    assert ops.convert_to_numpy(window[-1]).tolist() == [0, 0, 0, 3, 1]
    # The sums hold g0 + g1, however the buffers lay them out.
    for dtype in DTYPES:
        buffers = [
            ops.convert_to_numpy(s)
            for s in window[:-1]
            if ops.convert_to_numpy(s).dtype == np.dtype(dtype)
        ]
        total = sum(
            a.sum() + b.sum() for a, b, d in zip(g0, g1, DTYPES) if d == dtype
        )
        assert sum(b.sum() for b in buffers) == total
    new = optimizer.stateless_with_window(state, window)
    assert len(new) == len(state)
    assert all(a is b for a, b in zip(new, window))
    n = len(window)
    assert all(a is b for a, b in zip(new[n:], state[n:]))  # inner's
    assert all(a is b for a, b in zip(optimizer.stateless_window(new), window))
    # Nothing was assigned: the optimizer's variables are as they were.
    assert counts(optimizer) == [0, 0, 0, 3, 0]


def _stateless_step(optimizer):
    """The filtered step's use of the pure forms: the pass's gradients
    added to the window, then the micro-batch counted with none."""

    def step(state, trainable, grads, rows, masked_rows):
        window = optimizer.stateless_window(state)
        window = optimizer.stateless_accumulate(window, grads)
        state = optimizer.stateless_with_window(state, window)
        return optimizer.stateless_apply(
            state, None, trainable, rows=rows, masked_rows=masked_rows
        )

    if BACKEND == "jax":
        import jax

        return jax.jit(step)
    return step


@pytest.mark.skipif(
    BACKEND == "tensorflow",
    reason="Keras's TensorFlow optimizers refuse `stateless_apply` (it is "
    "incompatible with tf.distribute): the inner SGD raises",
)
@pytest.mark.parametrize("rule", list(RULES))
def test_stateless_accumulate_then_apply_none_is_the_stateful_path(rule):
    """`stateless_accumulate` + `stateless_apply(grads=None)` (compiled
    with `jax.jit` on JAX, as a pure step) gives the values, counts and
    iterations of `accumulate` + `apply(None)`."""
    stateful, pure = make_variables(), make_variables()
    stateful_opt = make_optimizer(stateful, RULES[rule](), momentum=0.5)
    pure_opt = make_optimizer(pure, RULES[rule](), momentum=0.5)
    step = _stateless_step(pure_opt)
    # Copies: on PyTorch, Keras's own SGD updates the weights and momenta
    # it is given in place, which would be the variables' own tensors.
    state = [ops.copy(value) for value in optimizer_values(pure_opt)]
    trainable = [ops.copy(v.value) for v in pure]
    n = len(pure_opt.grad_sums)
    for i in range(9):
        grads = micro_batch(i)
        stateful_opt.accumulate(grads)
        stateful_opt.apply(None, stateful, rows=ROWS, masked_rows=MASKED)
        trainable, state = step(
            state,
            trainable,
            [ops.convert_to_tensor(g) for g in grads],
            ops.convert_to_tensor(ROWS),
            ops.convert_to_tensor(MASKED),
        )
        assert_values_equal(
            [ops.convert_to_numpy(t) for t in trainable], values(stateful)
        )
        assert ops.convert_to_numpy(state[n]).tolist() == counts(stateful_opt)
        inner = dict(zip([v.path for v in pure_opt.variables], state))
        iteration = inner[pure_opt.iterations.path]
        assert int(ops.convert_to_numpy(iteration)) == iterations(stateful_opt)
    assert iterations(stateful_opt) == 4
    # The pure step assigned no variable.
    assert_values_equal(values(pure), START)
    assert counts(pure_opt)[:3] == [0, 0, 0]
    assert iterations(pure_opt) == 0
    for variable in pure_opt.inner_optimizer.variables:
        if "momentum" in variable.path:
            np.testing.assert_array_equal(ops.convert_to_numpy(variable), 0)
