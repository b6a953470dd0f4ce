"""`FilterEngine`: the sample filters' state and the filtered step.

`ASSpeed` holds one when it has filters. The engine owns:

* the filters' variables (each filter's `state_spec`, the seeds of their
  draws, the count of drawn batches, the epoch schedule);
* the queues, laid out by a spec that the first `fit` derives from its
  first batch, and that is saved beside the weights;
* the filtered step (`step`), which runs the filters on a drawn batch
  through the backend's passes (a `Hooks`) and keeps their new state.

Its variables are weights of the model that owns it (made by the model's
`add_weight`), so they are saved, restored, distributed and carried
through JAX's pure step as every other model weight.
"""

import functools
import json
from typing import Protocol

import keras
import numpy as np

from keras_as_softmax import filters as filters_lib
from keras_as_softmax.training import _filtering
from keras_as_softmax.training import _layout
from keras_as_softmax.training import _queue
from keras_as_softmax.training._filtering import FilterState

# The queues' layout, stored beside the weights (`save_spec`).
SPEC_KEY = "filter_spec"
# The queues' layout format: 1 (unmarked) had no drawn-batch size per
# row; 2 packed wide leaves beside the others, which 3 keeps apart.
SPEC_FORMAT = 3
# Why a filter refuses batches of other shapes than its first.
ONE_SHAPE = (
    "ASSpeed's sample filters queue rows of one shape, the first batch's: "
    "pad every batch to the same length (for tf.data, `padded_batch` with "
    "fixed `padded_shapes`; ragged inputs to dense ones), or train without "
    "a filter."
)


class Hooks(Protocol):
    """The passes a backend gives the filtered step.

    Each runs behind a conditional on its predicate and returns zeros when
    it is false, so a conditional holds a pass and nothing else.
    """

    def maybe_score(self, pred, x):
        """`(y_pred, penalty)` of a scoring pass over `x` if `pred`."""

    def maybe_train(self, pred, x, y, coefficients):
        """`(grads, y_pred, values, loss)` of a training pass minimising
        `sum(coefficients * values) + penalty` if `pred`; `grads` is `None`
        where the pass adds its gradients to the optimizer's window."""


class FilterEngine:
    """The sample filters of one `ASSpeed` model, their state and step.

    Args:
        filters: the checked list of filters (`filters.base.as_list`).
    """

    def __init__(self, filters):
        self.filters = filters
        self.scoring_filter = next((f for f in filters if f.scores), None)
        self.memory_filter = next((f for f in filters if not f.scores), None)
        self.spec = None

    # ------------------------------------------------------------- variables

    def create_state(self, add_weight):
        """Creates the variables that do not depend on the data, with the
        owner's `add_weight`."""
        new_variable = functools.partial(_new_variable, add_weight)
        # `[epoch, epochs]` of `fit`, written at each epoch's start: a
        # weight, so no step is traced anew for each `fit`.
        self.schedule = new_variable(
            "epoch_schedule", "int32", (2,), keras.initializers.Constant([0, 1])
        )
        self.states = [
            {
                name: new_variable(
                    name, dtype, shape, keras.initializers.Constant(initial)
                )
                for name, (shape, dtype, initial) in f.state_spec().items()
            }
            for f in self.filters
        ]
        self.seeds = self.drawn = None
        if any(f.needs_draws for f in self.filters):
            # A filter's seed, or one from NumPy's global generator, which
            # `keras.utils.set_random_seed` seeds.
            seeds = [
                np.random.randint(2**31 - 1) if f.seed is None else f.seed
                for f in self.filters
            ]
            self.seeds = new_variable(
                "filter_seeds",
                "int32",
                (len(seeds),),
                keras.initializers.Constant(seeds),
            )
            # Batches drawn in all of training: the key of the draws.
            self.drawn = new_variable("drawn_batches", "int32", ())

    def create_queues(self, spec, add_weight):
        """Creates the queues that `spec` lays out (once)."""
        if self.spec is not None:
            return
        new_variable = functools.partial(_new_variable, add_weight)
        size = spec["batch_size"]
        self.batch_size = size
        self.row_tail = tuple(spec["row_tail"])
        self.output_tail = tuple(spec["output_tail"])
        self.output_dtype = spec["output_dtype"]
        leaves = [(tuple(s), d) for s, d in spec["leaves"]]
        self.layout = _layout.Layout(leaves, rows=True)

        def queue(prefix):
            shapes = self.layout.buffer_shapes(2 * size)
            return _queue.RowQueue(
                [
                    new_variable(f"{prefix}_{i}", dtype, shape)
                    for i, (shape, dtype) in enumerate(shapes)
                ],
                new_variable(f"{prefix}_count", "int32", ()),
            )

        two = self.memory_filter is not None and self.scoring_filter
        self.score_queue = queue("score_queue") if two else None
        self.train_queue = queue("train_queue")
        self.spec = spec

    def queue_variables(self):
        """The queues' variables (none before the first `fit`)."""
        if self.spec is None:
            return []
        queues = [q for q in (self.score_queue, self.train_queue) if q]
        return [v for q in queues for v in (*q.buffers, q.count)]

    def variables(self):
        """The variables a filtered step assigns besides the model's."""
        found = [v for states in self.states for v in states.values()]
        if self.drawn is not None:
            found.append(self.drawn)
        return found + self.queue_variables()

    def values(self):
        """The filters' state as values (`FilterState`)."""

        def queue(q):
            if q is None:
                return None
            return _queue.RowQueue([b.value for b in q.buffers], q.count.value)

        return FilterState(
            score_queue=queue(self.score_queue),
            train_queue=queue(self.train_queue),
            states=[
                {name: v.value for name, v in variables.items()}
                for variables in self.states
            ],
        )

    def assign(self, state):
        """Writes a `FilterState` to the variables."""
        pairs = []
        for variables, values in (
            (self.score_queue, state.score_queue),
            (self.train_queue, state.train_queue),
        ):
            if variables is not None:
                pairs += zip(variables.buffers, values.buffers)
                pairs.append((variables.count, values.count))
        for variables, values in zip(self.states, state.states):
            pairs += [(v, values[name]) for name, v in variables.items()]
        for variable, value in pairs:
            # Rows written in place (`_rows.write_rows`) are left as they are.
            if value is not variable.value:
                variable.assign(value)

    def epoch_state(self):
        """`(epoch, epochs)` of the running `fit`, int32 tensors."""
        schedule = self.schedule.value
        return schedule[0], schedule[1]

    def schedule_callback(self, epochs):
        """The callback that writes `[epoch, epochs]` at each epoch's start
        (after `BackupAndRestore` has restored the weights)."""
        return _EpochSchedule(self.schedule, epochs)

    @property
    def score_training(self):
        """Whether the scoring pass runs in training mode."""
        return self.scoring_filter.score_training

    def masked_when_seen(self):
        """Share of the training set masked when last seen, or `None`
        without a memory filter."""
        if self.memory_filter is None:
            return None
        index = self.filters.index(self.memory_filter)
        state = {k: v.value for k, v in self.states[index].items()}
        masked = self.memory_filter.masked_when_seen(state)
        return float(np.mean(keras.ops.convert_to_numpy(masked)))

    # ------------------------------------------------------------------ spec

    def spec_of(self, model, inputs, y):
        """The queues' spec for batches like `(inputs, y)` (arrays) of the
        inner `model`."""
        output = model.compute_output_spec(
            keras.tree.map_structure(
                lambda a: keras.KerasTensor(np.shape(a), dtype_of(a)), inputs
            )
        )
        if isinstance(output, (list, tuple, dict)):
            raise ValueError(
                "ASSpeed's sample filters need a model with one output. "
                f"Received outputs: {output!r}"
            )
        batch = int(np.shape(keras.tree.flatten(inputs)[0])[0])
        row_tail = tuple(output.shape[1:-1])
        leaves = [
            (tuple(np.shape(a)[1:]), dtype_of(a))
            for a in keras.tree.flatten(inputs) + keras.tree.flatten(y)
        ]
        if any(None in shape for shape, _ in leaves):
            raise ValueError(
                f"{ONE_SHAPE} Received inputs and labels of shapes "
                f"{[shape for shape, _ in leaves]} after the batch axis"
            )
        row = (row_tail, "float32")
        leaves += [row, row, ((), "int32"), ((), "float32"), ((), "float32")]
        spec = {
            "format": SPEC_FORMAT,
            "batch_size": batch,
            "row_tail": list(row_tail),
            "output_tail": list(output.shape[1:]),
            "output_dtype": keras.backend.standardize_dtype(output.dtype),
            "leaves": [[list(s), d] for s, d in leaves],
        }
        if self.spec is not None and self.spec != spec:
            raise ValueError(
                "ASSpeed's filter queues were built by the first `fit()` for "
                "its batches; later fits need batches of the same shapes, "
                "or a new wrapper, `ASSpeed(model.inner_model, ...)`, whose "
                "queues start empty. " + spec_difference(self.spec, spec)
            )
        return spec

    def with_empty_queues(self, weights, variables):
        """`weights` of `variables` (a list, or a store keyed `"0"`, `"1"`,
        ...) taken before the first `fit` created the queues (the initial
        weights, to train again from them), with empty queues; any other
        `weights` as they are."""
        if self.spec is None and len(weights) > len(variables):
            raise ValueError(
                "The filters' queues are weights too, built by the first "
                "`fit()` (or by `load_weights`, from the file's layout). "
                f"Expected {len(variables)} weights before they exist. "
                f"Received: {len(weights)}. Fit first, or save and load a "
                "weights file."
            )
        queues = {id(v) for v in self.queue_variables()}
        if not queues or len(weights) != len(variables) - len(queues):
            return weights
        if isinstance(weights, (list, tuple)):
            given = iter(weights)
            return [
                np.zeros(v.shape, v.dtype) if id(v) in queues else next(given)
                for v in variables
            ]
        missing = variables[len(weights) :]
        if {id(v) for v in missing} != queues:
            return weights
        store = {k: weights[k] for k in weights.keys()}
        for i, variable in enumerate(missing, len(weights)):
            store[f"{i}"] = np.zeros(variable.shape, variable.dtype)
        return store

    def save_spec(self, store):
        """Stores the spec beside the weights, so that a weights file loads
        into a new model before its first `fit` creates the queues."""
        if self.spec is not None:
            spec = json.dumps(self.spec).encode()
            store[SPEC_KEY] = np.frombuffer(spec, "uint8")

    def load(self, store, variables, create_queues):
        """`store` (keys `"0"`, `"1"`, ... of `variables`, and the spec)
        ready for Keras to load: the queues created from the spec, or
        empty where the file predates them."""
        if SPEC_KEY not in store.keys():
            return self.with_empty_queues(store, variables)
        old = self.load_spec(store[SPEC_KEY], create_queues)
        store = {k: store[k] for k in store.keys() if k != SPEC_KEY}
        if old:
            store = self.with_drawn_sizes(store, variables)
        return store

    def load_spec(self, stored, create_queues):
        """Creates the queues from a stored spec (`create_queues(spec)`),
        or checks it against theirs. Returns whether the stored rows need
        their drawn-batch size added (`with_drawn_sizes`): format 1."""
        spec = json.loads(bytes(np.asarray(stored, "uint8")).decode())
        old = "format" not in spec
        spec = current_spec(spec)
        if self.spec is None:
            create_queues(spec)
        elif spec != self.spec:
            raise ValueError(
                "These weights hold filter queues built for batches of "
                "other shapes. " + spec_difference(self.spec, spec)
            )
        return old

    def with_drawn_sizes(self, store, variables):
        """`store` (keys `"0"`, `"1"`, ... of `variables`) of a format-1
        file, whose queued rows lack the size of the batch each was drawn
        in: with it, as if every row came from a full batch."""
        buffers = {
            id(b) for b in self.queue_variables() if b.dtype == "float32"
        }
        store = dict(store)
        for i, variable in enumerate(variables):
            if id(variable) in buffers:
                old = np.asarray(store[f"{i}"])
                column = np.full((old.shape[0], 1), self.batch_size, "float32")
                store[f"{i}"] = np.concatenate([old, column], axis=1)
        return store

    # ------------------------------------------------------------------ step

    def checked_row_shapes(self, inputs, y):
        """`(inputs, y)`, whose rows the queues hold in the first batch's
        shapes: a batch of other shapes is refused where its step is
        traced, or on TensorFlow, for a length unknown there
        (`padded_batch`), where it runs."""
        x_leaves = keras.tree.flatten(inputs)
        n_x = len(x_leaves)
        leaves = x_leaves + keras.tree.flatten(y)
        expected = [tuple(s) for s, _ in self.spec["leaves"]][: len(leaves)]
        received = [tuple(leaf.shape[1:]) for leaf in leaves]
        size = self.batch_size
        batch = leaves[0].shape[0]
        too_large = (
            "ASSpeed's sample filters queue rows for passes of the first "
            f"batch's size, {size}: a larger batch would overflow them. "
            "Expected batches of at most the first one's size (arrays: give "
            "`batch_size`). Received a batch of "
        )
        if batch is not None and batch > size:
            raise ValueError(f"{too_large}{batch}")
        tensorflow = keras.backend.backend() == "tensorflow"
        if batch is None and tensorflow:
            # Known as the graph runs, and checked there (an XLA program
            # would skip the check).
            import tensorflow as tf

            tf.debugging.assert_less_equal(
                tf.shape(leaves[0])[0], size, message=too_large
            )
        if any(
            len(r) != len(e) or any(a not in (None, b) for a, b in zip(r, e))
            for r, e in zip(received, expected)
        ):
            raise ValueError(
                f"{ONE_SHAPE} Expected inputs and labels of shapes "
                f"{expected} after the batch axis. Received: {received}"
            )
        if tensorflow and any(None in r for r in received):
            import tensorflow as tf

            leaves = [
                tf.ensure_shape(leaf, (None, *shape))
                for leaf, shape in zip(leaves, expected)
            ]
            inputs = keras.tree.pack_sequence_as(inputs, leaves[:n_x])
            y = keras.tree.pack_sequence_as(y, leaves[n_x:])
        return inputs, y

    def step(
        self,
        loss,
        x,
        y,
        sample_weight,
        hooks,
        stateless_uniform,
        gather=None,
        queue_ops=_queue,
    ):
        """Runs the filters on a drawn batch and keeps their new state.

        Args:
            loss: the compiled loss.
            x, y, sample_weight: the drawn batch (`x` may hold sample ids).
            hooks: the backend's passes (`Hooks`).
            stateless_uniform: the backend's `(size, seed, counter) ->
                float32 [size]` uniform draws.
            gather: under several replicas, all-gathers a replica's rows
                into the global batch, which the filters see on every
                replica.
            queue_ops: how the queues are kept: `_queue`, or the same for
                eager steps.

        Returns:
            `(inputs, output)`: the inputs without sample ids, and the
            `_filtering.StepOutput`.
        """
        inputs, ids = filters_lib.split_sample_ids(x)
        if gather is not None:
            inputs, y, sample_weight, ids = (
                None if t is None else keras.tree.map_structure(gather, t)
                for t in (inputs, y, sample_weight, ids)
            )
        inputs, y = self.checked_row_shapes(inputs, y)

        def draws(index, size):
            # From the filter's seed and the batch's index in training, not
            # a generator's state: the same on every replica and device
            # count, and after a resume.
            if not self.filters[index].needs_draws:
                return None
            seed = self.seeds.value[index]
            return stateless_uniform(size, seed, self.drawn.value)

        output, state = _filtering.filtered_step(
            self,
            loss,
            self.values(),
            inputs,
            y,
            sample_weight,
            ids,
            draws,
            hooks,
            queue_ops=queue_ops,
        )
        self.assign(state)
        if self.drawn is not None:
            self.drawn.assign_add(1)
        return inputs, output

    def batch_for_step(self, x, y, sample_weight):
        """A batch given to `train_on_batch`, checked and ready for a
        filtered step."""
        if self.spec is None:
            raise ValueError(
                "ASSpeed's sample filters keep state shaped by the data and "
                "scheduled by the epochs, which `fit()` builds (or "
                "`load_weights`, from a file). Expected a fitted ASSpeed. "
                "Received: train_on_batch before any fit"
            )
        if keras.backend.backend() == "torch":
            # Keras's torch trainer passes the arrays on as given; the
            # filtered step queues rows as tensors.
            x, y, sample_weight = keras.tree.map_structure(
                lambda a: a if a is None else keras.ops.convert_to_tensor(a),
                (x, y, sample_weight),
            )
        return x, y, sample_weight

    def no_output(self, rows):
        """Zeros in the shape of the model's output for `rows` rows."""
        return keras.ops.zeros((rows, *self.output_tail), self.output_dtype)


class _EpochSchedule(keras.callbacks.Callback):
    def __init__(self, schedule, epochs):
        super().__init__()
        self.schedule = schedule
        self.epochs = int(epochs)

    def on_epoch_begin(self, epoch, logs=None):
        self.schedule.assign(np.array([epoch, self.epochs], "int32"))


def _new_variable(add_weight, name, dtype, shape, initializer="zeros"):
    # Under tf.distribute every replica writes the same all-reduced values,
    # so the first replica's write is the one kept.
    return add_weight(
        shape=shape,
        dtype=dtype,
        initializer=initializer,
        trainable=False,
        aggregation="only_first_replica",
        name=name,
    )


def dtype_of(a):
    """The standardized dtype of an array or tensor."""
    return keras.backend.standardize_dtype(
        a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype
    )


def current_spec(spec):
    """A stored spec in the current format. Format 1 lacks the rows' last
    leaf, the size of the batch each was drawn in; format 2 packed wide
    leaves beside the others, which format 3 keeps in buffers of their own
    (`_layout.Layout`): the same layout if none is wide, else refused."""
    if "format" not in spec:
        spec = {
            **spec,
            "format": 2,
            "leaves": [*spec["leaves"], [[], "float32"]],
        }
    if spec["format"] == 2:
        wide = [
            shape
            for shape, _ in spec["leaves"]
            if _layout.Layout.has_own_buffer(shape)
        ]
        if wide:
            raise ValueError(
                "These weights hold filter queues of format 2, which packed "
                f"rows of shapes {wide} beside the others. Expected queues "
                "of format 3: a row's leaf of "
                f"{_layout.Layout.OWN_BUFFER_WIDTH} values or more in a "
                "buffer of its own. To go on training, load the file with "
                "the release that saved it, save `model.inner_model`'s "
                "weights, and wrap them anew (the queues start empty)."
            )
        spec = {**spec, "format": SPEC_FORMAT}
    return spec


def spec_difference(expected, received):
    """ "Expected: ... Received: ..." over the entries of two specs that
    differ (`batch_size=8`, the queued leaves' shapes)."""
    keys = [k for k in received if received[k] != expected.get(k)]
    return (
        "Expected: "
        + ", ".join(f"{k}={expected.get(k)}" for k in keys)
        + ". Received: "
        + ", ".join(f"{k}={received[k]}" for k in keys)
    )
