"""AS-Speed's accumulation core: the window's state, pure functions of it,
and the rules that set the window's length.

Written after optax's `MultiSteps` (`optax/transforms/_accumulation.py`):
the state is a `NamedTuple` of tensors, every function takes a state and
returns a new one, in `keras.ops` only, and the window's length is a
plug-in rule, an int or a callable, as optax's `every_k_schedule`.
`keras_as_softmax.AccumulatingOptimizer` holds the state in its variables
and calls these functions:

```
state = accumulation.init(model.trainable_variables)
state = accumulation.add(state, grads, rows, masked_rows)
if accumulation.is_due(state):  # a compiled conditional in the optimizer
    mean_grads, state = accumulation.finish_window(state, rule)
    optimizer.apply(mean_grads)
```
"""

import numbers
from typing import NamedTuple

import keras
from keras import ops

from keras_as_softmax._validation import check_int
from keras_as_softmax._validation import check_positive


class AccumulationState(NamedTuple):
    """The state of one accumulation window.

    Attributes:
        grad_sum: one tensor per trainable variable, the sum of the
            gradients of the micro-batches added in the window.
        micro_batches: int32 scalar, micro-batches added in the window.
        rows: float32 scalar, rows counted in the window (`N_all`:
            samples, or tokens that are not ignored, with nonzero weight).
        masked_rows: float32 scalar, counted rows whose loss was exactly 0
            (`N_masked`).
        steps: int32 scalar, micro-batches per optimizer update (`k`).
        has_grads: bool scalar, whether `grad_sum` holds gradients of this
            window. A window that ends leaves its sums in place and clears
            the flag; the next window's first gradients overwrite them.
            Resetting sums the size of the model would cost a pass over
            them at every update, and a compiled conditional that returns
            them unchanged copies them.
    """

    grad_sum: list
    micro_batches: object
    rows: object
    masked_rows: object
    steps: object
    has_grads: object


def init(variables, steps=1):
    """A fresh state for `variables` (zero sums, `steps` micro-batches)."""
    return AccumulationState(
        grad_sum=[ops.zeros(v.shape, v.dtype) for v in variables],
        micro_batches=ops.zeros((), "int32"),
        rows=ops.zeros((), "float32"),
        masked_rows=ops.zeros((), "float32"),
        steps=ops.convert_to_tensor(steps, "int32"),
        has_grads=ops.zeros((), "bool"),
    )


def add_gradients(state, grads):
    """Adds `grads` (one tensor, or `None` for none, per variable) to the
    window's sums, without counting a micro-batch.

    The window's first gradients replace what the sums hold: a selection
    that XLA fuses into the addition, so it costs what `sum + grad` does.
    """
    grad_sum = []
    for total, grad in zip(state.grad_sum, grads):
        grad = ops.zeros_like(total) if grad is None else grad
        grad = ops.cast(grad, total.dtype)
        grad_sum.append(ops.where(state.has_grads, total + grad, grad))
    return state._replace(grad_sum=grad_sum, has_grads=ops.ones((), "bool"))


def add(state, grads, rows, masked_rows, from_pass=True):
    """Adds one micro-batch: its gradients and its row counts.

    `grads=None` adds the counts only, for a trainer that added the
    gradients to the sums already (`add_gradients`), or had none to add.
    `from_pass` (a bool scalar) false says that `grads` are zeros standing
    for no training pass: they count as no gradient (`is_due`).
    """
    if grads is not None:
        had = state.has_grads
        state = add_gradients(state, grads)
        state = state._replace(has_grads=ops.logical_or(had, from_pass))
    return state._replace(
        micro_batches=state.micro_batches + 1,
        rows=state.rows + ops.cast(rows, "float32"),
        masked_rows=state.masked_rows + ops.cast(masked_rows, "float32"),
    )


def is_due(state):
    """Whether the window holds `steps` micro-batches and a gradient (a
    bool scalar).

    A micro-batch brings no gradient when a sample filter ran no training
    pass on it (its rows were skipped, or wait in the filter's queue). An
    update from such a window alone would move the weights by the inner
    optimizer's momentum and weight decay, with nothing learned, once per
    window: so the window stays open until a pass adds its gradients.
    """
    return ops.logical_and(
        ops.greater_equal(state.micro_batches, state.steps), state.has_grads
    )


def window_mean(state, divisor=1):
    """The mean of the window's gradients: over its micro-batches (times
    `divisor`, the number of replicas whose sums an optimizer adds up
    again), so an update has the scale of one plain batch however many
    micro-batches it spans."""
    n = ops.cast(ops.maximum(state.micro_batches, 1) * divisor, "float32")
    return [
        ops.where(
            state.has_grads,
            ops.cast(s / ops.cast(n, s.dtype), s.dtype),
            ops.zeros_like(s),
        )
        for s in state.grad_sum
    ]


def end_window_where(due, state, rule):
    """The state with the window ended where the bool scalar `due` holds:
    counts reset, sums marked as holding no gradients of the new window,
    and `steps` set by `rule(steps, rows, masked_rows)` (at least 1); as
    it was elsewhere. Arithmetic selection on scalars: the sums are not
    touched, so a compiled step neither rewrites nor copies them."""
    steps = _integer_scalar(rule(state.steps, state.rows, state.masked_rows))
    steps = ops.maximum(ops.cast(steps, "int32"), 1)
    return state._replace(
        micro_batches=ops.where(due, 0, state.micro_batches),
        rows=ops.where(due, 0.0, state.rows),
        masked_rows=ops.where(due, 0.0, state.masked_rows),
        steps=ops.where(due, steps, state.steps),
        has_grads=ops.logical_and(ops.logical_not(due), state.has_grads),
    )


def _integer_scalar(steps):
    """A rule's result, refused unless an integer scalar: a float would be
    truncated, and anything else fail deep in the step."""
    if isinstance(steps, int) and not isinstance(steps, bool):
        return steps
    if len(getattr(steps, "shape", [None])) or "int" not in str(
        getattr(steps, "dtype", None)
    ):
        raise ValueError(
            "Expected `steps_rule` to return an integer scalar, the next "
            f"window's length. Received: {steps!r}"
        )
    return steps


def finish_window(state, rule, divisor=1):
    """The window's mean gradients, and the state of the next window.

    Returns:
        `(mean_grads, state)`: `window_mean(state, divisor)`, and `state`
        with its counts reset, its sums marked stale (`has_grads` false)
        and its `steps` set by `rule(steps, rows, masked_rows)`.
    """
    return window_mean(state, divisor), end_window_where(True, state, rule)


def next_accumulation_steps(steps, n_all, n_masked, lam, max_steps):
    """The AS-Speed rule (paper eq. 19 with its three restrictions).

    ```
    proposal = floor(lam * N_all / (N_all - N_masked) + 0.5)  # float32
    steps'   = steps + 1 if proposal > steps and steps < max_steps else steps
    ```

    The number of accumulated micro-batches never decreases, grows by at
    most one per optimizer update and never exceeds `max_steps`. A window
    with no counted rows keeps the current value; a window with every row
    masked proposes growth.

    Args:
        steps: int32 scalar, the current number of steps.
        n_all: float scalar, counted rows in the last window.
        n_masked: float scalar, masked rows among them.
        lam: the paper's lambda.
        max_steps: the cap `s`.

    Returns:
        int32 scalar, the next number of steps.
    """
    steps = ops.cast(steps, "int32")
    n_all = ops.cast(n_all, "float32")
    n_masked = ops.cast(n_masked, "float32")
    unmasked = n_all - n_masked
    ratio = ops.where(unmasked > 0, n_all / ops.maximum(unmasked, 1.0), 1e9)
    proposal = ops.floor(lam * ratio + 0.5)
    grow = ops.logical_and(
        ops.logical_and(proposal > ops.cast(steps, "float32"), n_all > 0),
        steps < max_steps,
    )
    return ops.where(grow, steps + 1, steps)


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class AdaptiveSteps:
    """The paper's rule (eq. 19): accumulate more micro-batches per update
    as more rows are masked.

    Called at the end of each window with its counts, it returns the next
    window's length, `next_accumulation_steps(steps, rows, masked_rows,
    lam, max_steps)`: `lam * N_all / (N_all - N_masked)` rounded half up,
    never decreasing, growing by at most one, capped at `max_steps`.
    Windows start at one micro-batch.

    Args:
        lam: the paper's lambda (> 0). Defaults to `0.5`.
        max_steps: the cap `s` (int >= 1). Defaults to `4`.
    """

    initial_steps = 1

    def __init__(self, lam=0.5, max_steps=4):
        self.lam = check_positive(lam, "lam")
        self.max_steps = check_int(max_steps, "max_steps", 1)

    def __call__(self, steps, rows, masked_rows):
        return next_accumulation_steps(
            steps, rows, masked_rows, self.lam, self.max_steps
        )

    def get_config(self):
        return {"lam": self.lam, "max_steps": self.max_steps}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        return f"AdaptiveSteps(lam={self.lam!r}, max_steps={self.max_steps!r})"


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class FixedSteps:
    """A window of `steps` micro-batches, always (plain accumulation)."""

    def __init__(self, steps=1):
        self.initial_steps = check_int(steps, "steps", 1)

    def __call__(self, steps, rows, masked_rows):
        return steps

    def get_config(self):
        return {"steps": self.initial_steps}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        return f"FixedSteps({self.initial_steps!r})"


def as_rule(rule):
    """A rule from an int (`FixedSteps`) or a callable `(steps, rows,
    masked_rows) -> steps` (a callable without `initial_steps` starts at
    one micro-batch)."""
    if isinstance(rule, numbers.Integral):
        return FixedSteps(check_int(rule, "steps_rule", 1))
    if not callable(rule):
        raise ValueError(
            "Expected `steps_rule` to be an int >= 1 or a callable "
            "`(steps, rows, masked_rows) -> steps`. "
            f"Received: steps_rule={rule!r}"
        )
    return rule
