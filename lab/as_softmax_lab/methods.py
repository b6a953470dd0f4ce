"""The training methods the lab compares, and what each one builds.

A `Method` names a loss (softmax cross entropy, AS-Softmax, or one of the
paper's baselines) and whether the model is wrapped in `ASSpeed` (with
which sample filters). `make_loss` and `wrap_model` turn a method into the
objects a run trains with: they are the only place where the harness
builds losses, `ASSpeed` and its sample filters.

`METHODS` holds softmax, AS-Softmax and the AS-Speed variants (what the
demo, notebooks and `benchmarks/as_speed.py` compare); `BASELINE_METHODS`
holds the other losses of the paper's Table 2 (`benchmarks/paper_tables.py`
runs them). `get_method` and `run` take a name from either.
"""

import dataclasses
import inspect

import keras
from keras import ops

from keras_as_softmax import ASSpeed
from keras_as_softmax import filters
from keras_as_softmax.losses import AMSoftmaxLoss
from keras_as_softmax.losses import ASSoftmaxLoss
from keras_as_softmax.losses import Entmax15Loss
from keras_as_softmax.losses import MultiLabelASSoftmaxLoss
from keras_as_softmax.losses import MultiLabelCategoricalCrossentropy
from keras_as_softmax.losses import SparsemaxLoss
from keras_as_softmax.losses import SparseSoftmaxLoss
from keras_as_softmax.losses import TemperatureSoftmaxLoss

TASKS = ("multiclass", "multilabel", "tokens")
IGNORE_CLASS = -1
DEFAULT_DELTA = {"multiclass": 0.3, "multilabel": 0.05, "tokens": 0.3}
METRIC_NAMES = {
    "multiclass": "accuracy",
    "multilabel": "micro_f1",
    "tokens": "entity_f1",
}

# Per task, the setting that the demo and `benchmarks/as_speed.py` run
# beside softmax, as a `parse_method` spec: on multi-class, the one measured
# to reach softmax's accuracy soonest (benchmarks/RESULTS.md). Tokens take
# the same, which reached the target later than softmax (one seed: a
# sentence skips only once all its tokens are masked); multi-label (no
# `classes="all"` there) the AS loss with `SkipMasked()`, not measured to a
# target yet.
RECOMMENDED = {
    "multiclass": "softmax_skip/learning_rate=2e-4/delta=0.5",
    "multilabel": "as_skip/learning_rate=2e-4",
    "tokens": "softmax_skip/learning_rate=2e-4/delta=0.5",
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
        infobatch: with the `filters.InfoBatch` filter (and no
            accumulation): prune below-mean-loss samples at random, the
            baseline the filters are measured against.
        baseline: for the methods of `BASELINE_METHODS`, the baseline loss
            (a `BASELINE_LOSSES` key); `None` for softmax and the AS
            methods.
        classes: the AS loss's `classes`: `"kept"` (AS-Softmax) or
            `"all"` (softmax cross entropy on the rows not masked).
    """

    name: str
    as_loss: bool
    as_speed: bool
    description: str
    skip_masked: bool = False
    skip_stale: bool = False
    infobatch: bool = False
    selective_backprop: bool = False
    baseline: str | None = None
    classes: str = "kept"

    @property
    def sample_ids(self):
        """Whether its batches carry sample ids (a last-seen filter)."""
        return self.skip_stale or self.infobatch


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
    "softmax_skip": Method(
        "softmax_skip",
        True,
        True,
        "softmax cross entropy on the samples AS-Softmax has not masked, "
        "training passes only on those (AS-Speed + SkipMasked)",
        skip_masked=True,
        classes="all",
    ),
    "softmax_infobatch": Method(
        "softmax_infobatch",
        False,
        True,
        "softmax + InfoBatch: below-mean-loss samples pruned with "
        "probability 0.5, kept ones weighted 2, all in the last 12.5%",
        infobatch=True,
    ),
    "softmax_selective_backprop": Method(
        "softmax_selective_backprop",
        False,
        True,
        "softmax + Selective-Backprop: half of each batch trained, drawn "
        "by loss rank, kept ones weighted 2",
        selective_backprop=True,
    ),
}


class LabelSmoothingLoss(keras.losses.Loss):
    """Cross entropy with label smoothing, on integer labels and logits.

    Keras's `categorical_crossentropy(..., label_smoothing=eps)` on the
    one-hot labels: the target gets `1 - eps + eps / C`, every other class
    `eps / C` (the paper's Label-Smoothing gives the others
    `eps / (C - 1)`).

    Args:
        label_smoothing: `eps` in [0, 1). Defaults to `0.1`.
        name: defaults to `"label_smoothing_crossentropy"`.
    """

    def __init__(
        self, label_smoothing=0.1, name="label_smoothing_crossentropy"
    ):
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(
                "Expected `label_smoothing` in [0, 1). "
                f"Received: label_smoothing={label_smoothing!r}"
            )
        super().__init__(name=name)
        self.label_smoothing = float(label_smoothing)

    def call(self, y_true, y_pred):
        onehot = ops.one_hot(ops.cast(y_true, "int32"), ops.shape(y_pred)[-1])
        return keras.losses.categorical_crossentropy(
            onehot,
            y_pred,
            from_logits=True,
            label_smoothing=self.label_smoothing,
        )

    def get_config(self):
        return {"label_smoothing": self.label_smoothing, "name": self.name}


def _label_smoothing(task, label_smoothing=0.1):
    return LabelSmoothingLoss(label_smoothing)


def _binary_cross_entropy(task):
    return keras.losses.BinaryCrossentropy(from_logits=True)


def _multiclass(loss_class):
    def build(task, **kwargs):
        ignore = IGNORE_CLASS if task == "tokens" else None
        return loss_class(ignore_class=ignore, **kwargs)

    return build


# name: (the tasks it applies to, builder(task, **hyper_parameters)).
BASELINE_LOSSES = {
    "label_smoothing": (("multiclass",), _label_smoothing),
    "t_softmax": (
        ("multiclass", "tokens"),
        _multiclass(TemperatureSoftmaxLoss),
    ),
    "am_softmax": (("multiclass", "tokens"), _multiclass(AMSoftmaxLoss)),
    "sparsemax": (("multiclass", "tokens"), _multiclass(SparsemaxLoss)),
    "entmax15": (("multiclass", "tokens"), _multiclass(Entmax15Loss)),
    "sparse_softmax": (
        ("multiclass", "tokens"),
        _multiclass(SparseSoftmaxLoss),
    ),
    "bce": (("multilabel",), _binary_cross_entropy),
}

BASELINE_METHODS = {
    name: Method(name, False, False, description, baseline=name)
    for name, description in (
        ("label_smoothing", "softmax cross entropy with label smoothing"),
        ("t_softmax", "softmax cross entropy of logits / temperature"),
        ("am_softmax", "additive-margin softmax (scale s, margin m)"),
        ("sparsemax", "Sparsemax loss"),
        ("entmax15", "1.5-Entmax loss"),
        ("sparse_softmax", "Sparse-Softmax: cross entropy over the top k"),
        ("bce", "binary cross entropy per class (sigmoid)"),
    )
}


def make_loss(method, task, delta=None, **hyper_parameters):
    """The training loss of `method` for `task`.

    Args:
        method: a `METHODS` key or `Method`.
        task: one of `TASKS`.
        delta: the AS-Softmax margin. Defaults to `DEFAULT_DELTA[task]`.
        **hyper_parameters: for a baseline method, the arguments of its
            loss (e.g. `temperature=0.5` for `"t_softmax"`, `k=10` for
            `"sparse_softmax"`, `label_smoothing=0.1`); the loss's own
            defaults otherwise. Other methods take none.

    Returns:
        A `keras.losses.Loss`: for softmax,
        `SparseCategoricalCrossentropy(from_logits=True)` (with
        `ignore_class=-1` for tokens) or `MultiLabelCategoricalCrossentropy`;
        for the AS methods, `ASSoftmaxLoss(delta, classes=...)` or
        `MultiLabelASSoftmaxLoss(delta)`; for a baseline, its loss (label
        smoothing is Keras's, on one-hot labels; `"bce"` is
        `BinaryCrossentropy(from_logits=True)`).
    """
    method = get_method(method)
    check_task(task)
    if method.baseline is not None:
        tasks, build = BASELINE_LOSSES[method.baseline]
        if task not in tasks:
            raise ValueError(
                f"The {method.name!r} baseline applies to tasks {tasks}. "
                f"Received: task={task!r}"
            )
        return build(task, **hyper_parameters)
    if hyper_parameters:
        raise ValueError(
            f"Method {method.name!r} takes no loss hyper-parameters other "
            f"than `delta`. Received: {sorted(hyper_parameters)}"
        )
    delta = DEFAULT_DELTA[task] if delta is None else delta
    ignore = IGNORE_CLASS if task == "tokens" else None
    if task == "multilabel":
        if method.classes != "kept":
            raise ValueError(
                f"Method {method.name!r} applies to the multi-class and "
                f"token tasks. Received: task={task!r}"
            )
        return (
            MultiLabelASSoftmaxLoss(delta)
            if method.as_loss
            else MultiLabelCategoricalCrossentropy()
        )
    if method.as_loss:
        return ASSoftmaxLoss(delta, ignore_class=ignore, classes=method.classes)
    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=ignore
    )


def get_method(method):
    if isinstance(method, Method):
        return method
    if method in METHODS:
        return METHODS[method]
    if method in BASELINE_METHODS:
        return BASELINE_METHODS[method]
    raise ValueError(
        f"Expected `method` in {tuple(METHODS) + tuple(BASELINE_METHODS)}. "
        f"Received: method={method!r}"
    )


def check_task(task):
    if task not in TASKS:
        raise ValueError(f"Expected `task` in {TASKS}. Received: task={task!r}")


def wrap_model(
    method,
    model,
    num_samples,
    lam=0.5,
    max_steps=5,
    revisit=0.5,
    seed=0,
    filter_options=None,
):
    """Wraps `model` for training with `method`.

    Args:
        method: a `METHODS` key or `Method`.
        model: the classifier (a `keras.Model` returning logits).
        num_samples: the number of training samples (ids of the
            last-seen filters).
        lam, max_steps: `ASSpeed`'s lambda and cap `s`.
        revisit: `SkipMaskedLastSeen`'s revisit probability.
        seed: seeds the revisit draws.
        filter_options: optional dict of filter arguments (e.g.
            `{"anneal_fraction": 0.125}`); each filter takes the ones its
            constructor accepts. A key prefixed `last_seen.` or
            `skip_masked.` goes to that filter alone (e.g.
            `{"last_seen.anneal_fraction": 0.125}`). A key no filter of
            `method` accepts is a `ValueError`.

    Returns:
        `model` wrapped in `ASSpeed` with the method's filters for the
        AS-Speed methods, as it is otherwise.
    """
    method = get_method(method)
    options = dict(filter_options or {})
    if not method.as_speed:
        if options:
            raise ValueError(
                f"Method {method.name!r} trains without filters. Received: "
                f"filter_options={options}"
            )
        return model
    # (prefix, class, positional args, keyword args)
    filter_args = []
    if method.infobatch:
        filter_args.append(
            ("last_seen", filters.InfoBatch, (num_samples,), {"seed": seed})
        )
        max_steps = 1  # a loss without masked rows: one batch per update
    if method.skip_stale:
        filter_args.append(
            (
                "last_seen",
                filters.SkipMaskedLastSeen,
                (num_samples,),
                {"revisit": revisit, "seed": seed},
            )
        )
    if method.skip_masked:
        filter_args.append(("skip_masked", filters.SkipMasked, (), {}))
    if method.selective_backprop:
        filter_args.append(
            (
                "selective_backprop",
                filters.SelectiveBackprop,
                (),
                {"seed": seed},
            )
        )
        max_steps = 1  # a loss without masked rows: one batch per update
    sample_filter = []
    unused = set(options)
    for prefix, cls, args, kwargs in filter_args:
        accepted = inspect.signature(cls).parameters
        mine = {}
        for key, value in options.items():
            own, dot, name = key.rpartition(".")
            if name in accepted and (not dot or own == prefix):
                mine[name] = value
                unused.discard(key)
        sample_filter.append(cls(*args, **{**kwargs, **mine}))
    if unused:
        names = [cls.__name__ for _, cls, _, _ in filter_args]
        raise ValueError(
            f"Expected arguments of the filters {names}. Received: "
            f"{sorted(unused)} for method {method.name!r}"
        )
    return ASSpeed(
        model, lam=lam, max_steps=max_steps, sample_filter=sample_filter
    )


RUN_SETTINGS = (
    "lam",
    "max_steps",
    "revisit",
    "learning_rate",
    "delta",
    "epochs",
)


def parse_method(spec):
    """A method with settings of its own, `"name/key=value/..."`, as
    `(name, run settings, filter options)`.

    Run settings are `RUN_SETTINGS`, arguments of `run`; any other key is
    a filter argument (`wrap_model`'s `filter_options`), such as
    `anneal_fraction` or `skip_masked.score_margin`.

    Example:

    >>> parse_method("as_skip/learning_rate=2e-4/score_margin=0.1")
    ('as_skip', {'learning_rate': 0.0002}, {'score_margin': 0.1})
    """
    name, *settings = spec.split("/")
    run_settings, filter_options = {}, {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep:
            raise ValueError(
                f"Expected `key=value` after the method name. Received: "
                f"{setting!r} in {spec!r}"
            )
        argument = key.rpartition(".")[2]
        if argument in (
            "max_steps",
            "epochs",
            "warmup_epochs",
            "max_skipped_epochs",
        ):
            value = int(value)
        elif argument == "score_training":
            value = {"true": True, "false": False}[value.lower()]
        else:
            value = float(value)
        target = run_settings if key in RUN_SETTINGS else filter_options
        target[key] = value
    return name, run_settings, filter_options
