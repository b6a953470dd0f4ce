"""The training methods the lab compares, and what each one builds.

A `Method` names a loss (softmax cross entropy or AS-Softmax) and whether
the model is wrapped in `ASSpeed` (with which sample filters). `make_loss`
and `wrap_model` turn a method into the objects a run trains with: they are
the only place where the harness builds losses, `ASSpeed` and
`MaskedSampleSkipper`.
"""

import dataclasses

import keras

from keras_as_softmax import ASSpeed
from keras_as_softmax import filters
from keras_as_softmax.losses import ASSoftmaxLoss
from keras_as_softmax.losses import MultiLabelASSoftmaxLoss
from keras_as_softmax.losses import MultiLabelCategoricalCrossentropy

TASKS = ("multiclass", "multilabel", "tokens")
IGNORE_CLASS = -1
DEFAULT_DELTA = {"multiclass": 0.3, "multilabel": 0.05, "tokens": 0.3}
METRIC_NAMES = {
    "multiclass": "accuracy",
    "multilabel": "micro_f1",
    "tokens": "entity_f1",
}


@dataclasses.dataclass(frozen=True)
class Method:
    """A training method compared by the runner.

    Attributes:
        name: a `METHODS` key.
        as_loss: whether it trains with the AS-Softmax loss.
        as_speed: whether the model is wrapped in `ASSpeed`.
        description: one line for tables.
        skip_masked: with the `filters.SkipMasked` filter: score batches
            and train only on the samples not masked now (beyond the paper).
        skip_stale: with the `filters.SkipMaskedLastSeen` filter: leave out
            the samples that were masked when last seen (beyond the paper).
    """

    name: str
    as_loss: bool
    as_speed: bool
    description: str
    skip_masked: bool = False
    skip_stale: bool = False


METHODS = {
    "softmax": Method("softmax", False, False, "softmax cross entropy"),
    "as_softmax": Method("as_softmax", True, False, "AS-Softmax loss"),
    "as_speed": Method(
        "as_speed", True, True, "AS-Softmax + adaptive accumulation"
    ),
    "as_skip": Method(
        "as_skip",
        True,
        True,
        "AS-Speed + training passes only on samples not masked now",
        skip_masked=True,
    ),
    "as_skip_stale": Method(
        "as_skip_stale",
        True,
        True,
        "AS-Speed + skipping samples masked when last seen",
        skip_stale=True,
    ),
    "as_skip_hybrid": Method(
        "as_skip_hybrid",
        True,
        True,
        "as_skip on the samples not masked when last seen "
        "(plus a revisited fraction)",
        skip_masked=True,
        skip_stale=True,
    ),
}


def make_loss(method, task, delta=None):
    """The training loss of `method` for `task`.

    Args:
        method: a `METHODS` key or `Method`.
        task: one of `TASKS`.
        delta: the AS-Softmax margin. Defaults to `DEFAULT_DELTA[task]`.

    Returns:
        A `keras.losses.Loss`: for softmax,
        `SparseCategoricalCrossentropy(from_logits=True)` (with
        `ignore_class=-1` for tokens) or `MultiLabelCategoricalCrossentropy`;
        for the AS methods, `ASSoftmaxLoss(delta)` or
        `MultiLabelASSoftmaxLoss(delta)`.
    """
    method = get_method(method)
    check_task(task)
    delta = DEFAULT_DELTA[task] if delta is None else delta
    ignore = IGNORE_CLASS if task == "tokens" else None
    if task == "multilabel":
        return (
            MultiLabelASSoftmaxLoss(delta)
            if method.as_loss
            else MultiLabelCategoricalCrossentropy()
        )
    if method.as_loss:
        return ASSoftmaxLoss(delta, ignore_class=ignore)
    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=ignore
    )


def get_method(method):
    if isinstance(method, Method):
        return method
    if method not in METHODS:
        raise ValueError(
            f"Expected `method` in {tuple(METHODS)}. "
            f"Received: method={method!r}"
        )
    return METHODS[method]


def check_task(task):
    if task not in TASKS:
        raise ValueError(f"Expected `task` in {TASKS}. Received: task={task!r}")


def wrap_model(
    method, model, num_samples, lam=0.5, max_steps=5, revisit=0.2, seed=0
):
    """Wraps `model` for training with `method`.

    Args:
        method: a `METHODS` key or `Method`.
        model: the classifier (a `keras.Model` returning logits).
        num_samples: the number of training samples (ids of
            `SkipMaskedLastSeen`).
        lam, max_steps: `ASSpeed`'s lambda and cap `s`.
        revisit: `SkipMaskedLastSeen`'s revisit probability.
        seed: seeds the revisit draws.

    Returns:
        `model` wrapped in `ASSpeed` with the method's filters for the
        AS-Speed methods, as it is otherwise.
    """
    method = get_method(method)
    if not method.as_speed:
        return model
    sample_filter = []
    if method.skip_stale:
        sample_filter.append(
            filters.SkipMaskedLastSeen(num_samples, revisit=revisit, seed=seed)
        )
    if method.skip_masked:
        sample_filter.append(filters.SkipMasked())
    return ASSpeed(
        model, lam=lam, max_steps=max_steps, sample_filter=sample_filter
    )
