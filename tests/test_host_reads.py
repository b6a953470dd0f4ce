"""A training step reads no device value on the host (issue 88).

JAX: `fit` runs with each dispatch of its train function under a guard
that fails on a read of a `jax.Array`'s value on the host. TensorFlow: the
graph of the train function that `fit` ran holds no operation that reads
a tensor's value on the host. Each has a positive control: a step that
reads a value is caught. (PyTorch runs eagerly and decides each pass on
the host by design: `keras_as_softmax/training/_torch.py`.)
"""

import contextlib
import ctypes
import inspect
import os
import threading
import traceback

import keras
import numpy as np
import pytest

import keras_as_softmax as kas
from keras_as_softmax import filters
from tests.backend_utils import BACKEND

NUM_CLASSES = 4
N = 64
BATCH = 8
EPOCHS = 3


def classifier_data(n=N, seed=0):
    """Rows whose label is their largest of the first 4 features: a small
    Dense classifier fits them within a few epochs, and AS-Softmax masks
    most rows, so that the filters skip samples."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 6)).astype("float32")
    return x, x[:, :NUM_CLASSES].argmax(-1).astype("int32")


def classifier(seed=1):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(NUM_CLASSES)(hidden))


# The filters of a step: none, one that scores, one that decides from its
# memory followed by one that scores, one that draws by loss rank.
FILTERS = {
    "none": lambda: None,
    "skip": lambda: filters.SkipMasked(warmup_epochs=0),
    "pair": lambda: [
        filters.SkipMaskedLastSeen(N, seed=0, warmup_epochs=0),
        filters.SkipMasked(warmup_epochs=0),
    ],
    "selective": lambda: filters.SelectiveBackprop(seed=0, warmup_epochs=0),
}


def as_speed(name, **compile_kwargs):
    """`ASSpeed` over `classifier()` with the filter `name`, compiled with
    AS-Softmax and Adam."""
    wrapped = kas.ASSpeed(classifier(), sample_filter=FILTERS[name]())
    wrapped.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=kas.ASSoftmaxLoss(0.3),
        **compile_kwargs,
    )
    return wrapped


def training_data(name):
    x, y = classifier_data()
    return (filters.with_sample_ids(x) if name == "pair" else x), y


def wrap_train_function(model, wrap):
    """Has `model.make_train_function` replace the train function it makes
    with `wrap(train_function)`, so that `fit` runs the wrapped one."""
    make = model.make_train_function

    def make_wrapped(force=False):
        made = make(force)
        step = model.train_function
        if not getattr(step, "wrapped", False):
            wrapped = wrap(step)
            wrapped.wrapped = True
            wrapped.step = step
            model.train_function = wrapped
        return made

    model.make_train_function = make_wrapped


def check_filters_skipped(name, history):
    if name != "none":
        # The filters left samples out of some training passes: the step
        # took the paths that decide without a pass.
        assert min(history["trained_fraction"]) < 1.0, history


# -------------------------------------------------------------------- JAX


class HostRead(AssertionError):
    """A guarded step read a device value on the host."""


class HostReads:
    """Records the reads of a `jax.Array`'s value on the host that the
    thread running a guarded block makes, and fails the block on them.

    `jax.transfer_guard_device_to_host("disallow")` fails such a read on a
    GPU or TPU, but not on a CPU, where host and device share memory and no
    transfer takes place (jax 0.10.2, measured), so the reads are recorded
    where they happen on the concrete array class, `ArrayImpl`:

    - `_value`, the NumPy copy behind `float`, `int`, `bool`, `complex`,
      `operator.index`, `.tolist()`, `str`, `format`, `__array__` (and so
      `jax.device_get`), `.tobytes()`, and a compiled program's constants;
    - its buffer protocol, through which NumPy takes a CPU array's memory
      (`np.asarray`, `np.array`, `.item()`, `memoryview`) without calling
      any Python method, hooked in the type's `bf_getbuffer` slot;
    - `copy_to_host_async`, a transfer started ahead of a read.

    The transfer guard stays on where a step compiles nothing, for what
    these miss off the CPU. Reads on other threads are not counted: Keras
    turns each step's logs into floats on a thread of its own
    (`CallbackList.on_train_batch_end`, `pythonify_logs`).
    """

    # A read made while JAX lowers a program: a value the program embeds as
    # a constant (on JAX, a loss's `delta` variable is one), read once when
    # the step compiles.
    LOWERING = ("jax/_src/interpreters/mlir.py", "_array_mlir_constant_handler")

    def __init__(self):
        self.reads = []
        self._thread = None

    def record(self, how):
        if self._thread != threading.get_ident():
            return
        stack = traceback.extract_stack()[:-2]
        embedded = any(
            frame.filename.replace(os.sep, "/").endswith(self.LOWERING[0])
            or frame.name == self.LOWERING[1]
            for frame in stack
        )
        self.reads.append((how, embedded, stack))

    @contextlib.contextmanager
    def guard(self, compiling=False):
        """Fails the block on a read of a device value on the host; with
        `compiling`, a block that may compile a program, but for the
        constants the program embeds."""
        import jax

        start = len(self.reads)
        self._thread = threading.get_ident()
        transfers = (
            contextlib.nullcontext()
            if compiling
            else jax.transfer_guard_device_to_host("disallow")
        )
        try:
            with transfers:
                yield
        finally:
            self._thread = None
        reads = [
            (how, stack)
            for how, embedded, stack in self.reads[start:]
            if not (compiling and embedded)
        ]
        if reads:
            raise HostRead(
                f"{len(reads)} read(s) of a device value on the host:\n"
                + "\n".join(
                    f"{how} at\n" + "".join(traceback.format_list(stack[-6:]))
                    for how, stack in reads
                )
            )


# `PyTypeObject.tp_as_buffer`: after the `PyVarObject` head (three words)
# and 17 pointer-sized fields, in CPython 3.10 to 3.13.
_TP_AS_BUFFER = (3 + 17) * ctypes.sizeof(ctypes.c_void_p)
_PY_BF_GETBUFFER = 1  # the slot id of `bf_getbuffer` (typeslots.h)
_PY_TPFLAGS_HEAPTYPE = 1 << 9
_GETBUFFER = ctypes.PYFUNCTYPE(
    ctypes.c_int, ctypes.py_object, ctypes.c_void_p, ctypes.c_int
)


@contextlib.contextmanager
def _buffer_protocol_hooked(cls, on_buffer):
    """Calls `on_buffer()` before each export of a `cls` object's buffer
    (`np.asarray` of a CPU `jax.Array`), by swapping the `bf_getbuffer`
    function of the heap type `cls` for one that calls it, then the
    original. The slot's address is checked against `PyType_GetSlot`
    before anything is written; a layout that does not match fails."""
    get_slot = ctypes.PYFUNCTYPE(
        ctypes.c_void_p, ctypes.py_object, ctypes.c_int
    )(("PyType_GetSlot", ctypes.pythonapi))
    original = get_slot(cls, _PY_BF_GETBUFFER)
    if not original:  # no buffer protocol: NumPy calls `__array__`
        yield
        return
    if not cls.__flags__ & _PY_TPFLAGS_HEAPTYPE:
        pytest.fail(f"{cls} is not a heap type: its buffer slot is not hooked")
    procs = ctypes.c_void_p.from_address(id(cls) + _TP_AS_BUFFER).value
    # A heap type holds its buffer functions within its own object.
    inside = procs and id(cls) < procs < id(cls) + type(cls).__basicsize__
    if not inside or ctypes.c_void_p.from_address(procs).value != original:
        pytest.fail(
            "This Python's type layout differs from CPython 3.10-3.13's: "
            "the buffer protocol of jax.Array cannot be hooked, and "
            "np.asarray on a CPU array would go unseen"
        )
    slot = ctypes.c_void_p.from_address(procs)
    forward = _GETBUFFER(original)

    @_GETBUFFER
    def getbuffer(obj, view, flags):
        on_buffer()
        return forward(obj, view, flags)

    slot.value = ctypes.cast(getbuffer, ctypes.c_void_p).value
    try:
        yield
    finally:
        slot.value = original


@pytest.fixture
def host_reads(monkeypatch):
    """A `HostReads`, its hooks on `jax.Array` for the test's duration."""
    import jax

    reads = HostReads()
    cls = type(jax.numpy.zeros(()))
    value = cls._value
    copy_to_host_async = cls.copy_to_host_async

    def read_value(array):
        reads.record("_value (float, int, bool, tolist, __array__)")
        return value.__get__(array)

    def start_copy(array):
        reads.record("copy_to_host_async")
        return copy_to_host_async(array)

    monkeypatch.setattr(cls, "_value", property(read_value))
    monkeypatch.setattr(cls, "copy_to_host_async", start_copy)
    with _buffer_protocol_hooked(
        cls, lambda: reads.record("buffer (np.asarray, np.array, .item())")
    ):
        yield reads


def guard_each_dispatch(model, reads, then=None):
    """Has `fit` run each dispatch of the train function under
    `reads.guard()` (the first, which compiles, allowed the constants the
    program embeds), and `then(logs)` inside it after the step. Returns
    the list of dispatches made."""
    dispatches = []

    def wrap(step):
        def guarded(state, iterator):
            with reads.guard(compiling=not dispatches):
                logs, state = step(state, iterator)
                if then is not None:
                    then(logs)
            dispatches.append(logs)
            return logs, state

        return guarded

    wrap_train_function(model, wrap)
    return dispatches


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's compiled train step")
@pytest.mark.parametrize("steps_per_execution", [1, 4])
@pytest.mark.parametrize("name", list(FILTERS))
def test_a_fit_step_reads_no_device_value_on_the_host(
    host_reads, name, steps_per_execution
):
    """`fit` dispatches each drawn batch (with `steps_per_execution=4`,
    each group of 4 in one `lax.scan`) as one compiled program without
    reading a device value on the host, with a filter that skips samples
    and without one. The first dispatch compiles the program, which reads
    the constants it embeds, once."""
    x, y = training_data(name)
    wrapped = as_speed(
        name, jit_compile=True, steps_per_execution=steps_per_execution
    )
    dispatches = guard_each_dispatch(wrapped, host_reads)
    history = wrapped.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0
    ).history
    # Every dispatch of every epoch ran under the guard.
    assert len(dispatches) == EPOCHS * N // BATCH // steps_per_execution
    check_filters_skipped(name, history)
    assert np.all(np.isfinite(history["loss"]))
    # The guard saw the compiling dispatch's reads, and allowed only those.
    assert all(embedded for _, embedded, _ in host_reads.reads)


# Reads of a step's loss on the host: each must be caught on its own.
READERS = {
    "np.asarray": np.asarray,
    "np.array": np.array,
    "float": float,
    "int": int,
    "bool": bool,
    ".item()": lambda a: a.item(),
    ".tolist()": lambda a: a.tolist(),
    "jax.device_get": lambda a: __import__("jax").device_get(a),
    "keras.ops.convert_to_numpy": keras.ops.convert_to_numpy,
}


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's compiled train step")
def test_the_step_guard_catches_each_way_to_read_a_device_value(host_reads):
    """Positive control: in a guarded dispatch, each of `READERS` applied
    to the step's loss, a device array, is recorded as a read, and the
    guard fails the dispatch, and so `fit`."""
    x, y = training_data("skip")
    wrapped = as_speed("skip", jit_compile=True)
    missed = []

    def read_each_way(logs):
        for how, read in READERS.items():
            before = len(host_reads.reads)
            read(logs["loss"])
            if len(host_reads.reads) == before:
                missed.append(how)

    guard_each_dispatch(wrapped, host_reads, then=read_each_way)
    with pytest.raises(HostRead, match="read"):
        wrapped.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert not missed, f"reads the guard did not see: {missed}"


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's compiled train step")
@pytest.mark.parametrize("how", ["np.asarray", "float", "bool"])
def test_the_step_guard_fails_a_fit_whose_step_reads_a_value(host_reads, how):
    """Positive control: a later dispatch (the program compiled) that
    reads its loss on the host in one way fails `fit`, naming the read."""
    x, y = training_data("skip")
    wrapped = as_speed("skip", jit_compile=True)
    calls = []

    def read_after_the_first(logs):
        calls.append(None)
        if len(calls) > 1:
            READERS[how](logs["loss"])

    guard_each_dispatch(wrapped, host_reads, then=read_after_the_first)
    kind = "buffer" if how == "np.asarray" else "_value"
    with pytest.raises(HostRead, match=f"1 read.*\n{kind}"):
        wrapped.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert len(calls) == 2


# ------------------------------------------------------------- TensorFlow

# Operations that read a tensor's value on the host, wherever TensorFlow
# places the step:
HOST_READ_OPS = {
    # Python on the host: `tf.py_function`, `tf.numpy_function`.
    "EagerPyFunc",
    "PyFunc",
    "PyFuncStateless",
    # Values formatted or printed on the host: `tf.print`, `tf.strings`.
    "Print",
    "PrintV2",
    "StringFormat",
    "AsString",
    # Checks whose flag or data the host reads: `tf.debugging`.
    "CheckNumerics",
    "CheckNumericsV2",
    # Outputs whose shape the values set: a GPU kernel copies the count
    # to the host before it allocates them (`tf.where(c)`, `boolean_mask`).
    "Where",
    "Unique",
    "UniqueV2",
    "UniqueWithCounts",
    "UniqueWithCountsV2",
    "DynamicPartition",
    "ListDiff",
    # Explicit transfers (TensorFlow adds them when it partitions a graph
    # across devices; a traced step holds none of its own).
    "_Send",
    "_Recv",
    "_HostSend",
    "_HostRecv",
}
# `tf.debugging.assert_*`: `Assert` runs on the host and reads its inputs
# there; one that checks only shapes (static metadata) reads no value.
SHAPE_OPS = {
    "Shape",
    "ShapeN",
    "Size",
    "Rank",
    "Const",
    "Identity",
    "Cast",
    "StridedSlice",
    "Pack",
    "Range",
    "Less",
    "LessEqual",
    "Greater",
    "GreaterEqual",
    "Equal",
    "NotEqual",
    "LogicalAnd",
    "LogicalOr",
    "LogicalNot",
    "All",
}
CONDITIONALS = {"If", "StatelessIf", "While", "StatelessWhile", "Case"}
FUNCTION_ATTRS = ("f", "then_branch", "else_branch", "cond", "body")


def _functions_called(node):
    names = []
    for key, value in node.attr.items():
        if key in FUNCTION_ATTRS and value.func.name:
            names.append(value.func.name)
        elif key == "branches":
            names += [f.name for f in value.list.func]
    return names


class StepGraph:
    """The nodes of a traced train function: its graph's and those of
    every function it calls (passes, conditionals' branches), each with
    the name of the function that holds it (`None`: the outer graph)."""

    def __init__(self, concrete_function):
        graph_def = concrete_function.graph.as_graph_def()
        self.functions = {
            f.signature.name: f for f in graph_def.library.function
        }
        self.nodes = [(None, node) for node in graph_def.node]
        for name, function in self.functions.items():
            self.nodes += [(name, node) for node in function.node_def]

    def ops(self):
        return {node.op for _, node in self.nodes}

    def host_reads(self):
        """`(function, op, node name)` of each node that reads a value on
        the host."""
        found = []
        for function, node in self.nodes:
            if node.op in HOST_READ_OPS or (
                node.op == "Assert" and not self._from_shapes(function, node)
            ):
                found.append((function, node.op, node.name))
        return found

    def _from_shapes(self, function, node):
        """Whether the data inputs of `node` come from shapes only."""
        nodes = (
            self.functions[function].node_def
            if function is not None
            else [n for f, n in self.nodes if f is None]
        )
        by_name = {n.name: n for n in nodes}
        pending, seen = list(node.input), set()
        while pending:
            name = pending.pop()
            if name.startswith("^"):
                continue  # a control input passes no value
            name = name.split(":")[0]
            if name in seen:
                continue
            seen.add(name)
            source = by_name.get(name)
            if source is None or source.op not in SHAPE_OPS:
                return False  # an argument, or a value-reading op
            if source.op not in ("Shape", "ShapeN", "Size", "Rank"):
                pending += source.input
        return True

    def xla_functions(self):
        """The functions that XLA compiles: those marked to compile, those
        a node calls with that mark, and every function they call."""
        marked = {
            name
            for name, function in self.functions.items()
            if function.attr["_XlaMustCompile"].b
        }
        marked |= {
            called
            for _, node in self.nodes
            if node.attr["_XlaMustCompile"].b
            for called in _functions_called(node)
        }
        pending = list(marked)
        while pending:
            for node in self.functions[pending.pop()].node_def:
                for called in _functions_called(node):
                    if called not in marked and called in self.functions:
                        marked.add(called)
                        pending.append(called)
        return marked


def _step_function(model):
    """The `tf.function` inside Keras's train function: the one that
    `fit` calls with the epoch's iterator."""
    import tensorflow as tf

    step = getattr(model.train_function, "step", model.train_function)
    closure = inspect.getclosurevars(step)
    found = [
        v
        for v in closure.nonlocals.values()
        if isinstance(v, tf.types.experimental.PolymorphicFunction)
    ]
    assert len(found) == 1, closure.nonlocals
    return found[0]


def _tf_step_mode(model, jit_compile):
    """Compiles with `jit_compile` False, True (on CPUs a graph whose
    passes are XLA functions) or "one_program" (one XLA program, as on a
    GPU)."""
    if jit_compile == "one_program":
        from keras_as_softmax.training import _tensorflow

        assert hasattr(_tensorflow.ASSpeedTrainer, "_tf_filtered_step")
        model._tf_filtered_step = "one_program"
        return True
    return jit_compile


def fitted_step_graph(name, jit_compile):
    """The `StepGraph` of the train function that `fit` ran for 2 epochs,
    the model, and its history."""
    x, y = training_data(name)
    wrapped = kas.ASSpeed(classifier(), sample_filter=FILTERS[name]())
    jit = _tf_step_mode(wrapped, jit_compile)
    wrapped.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=kas.ASSoftmaxLoss(0.3),
        jit_compile=jit,
    )
    iterators = []

    def wrap(step):
        def recording(iterator):
            iterators.append(iterator)
            return step(iterator)

        return recording

    wrap_train_function(wrapped, wrap)
    history = wrapped.fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0
    ).history
    function = _step_function(wrapped)
    traces = function.experimental_get_tracing_count()
    concrete = function.get_concrete_function(iterators[0])
    # No new trace: the graph is the one `fit` ran.
    assert function.experimental_get_tracing_count() == traces
    return StepGraph(concrete), wrapped, history


TF_MODES = [False, True, "one_program"]


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's graphs")
@pytest.mark.parametrize("jit_compile", TF_MODES)
@pytest.mark.parametrize("name", list(FILTERS))
def test_a_graph_step_reads_no_device_value_on_the_host(name, jit_compile):
    """The train function that `fit` runs, every function it calls
    included (the passes, XLA's or not, and the conditionals' branches),
    holds no operation that reads a value on the host (`HOST_READ_OPS`,
    and an `Assert` on values).

    TensorFlow's own conditionals outside XLA (`If`, `While`) read their
    predicate on the host, by design of a graph step (jit_compile=False,
    and the passes as XLA functions that CPUs run): the one-program step,
    as on a GPU, is checked to hold them all inside XLA below."""
    graph, wrapped, history = fitted_step_graph(name, jit_compile)
    check_filters_skipped(name, history)
    assert "MatMul" in graph.ops()  # the walk reached the passes
    if name != "none":
        assert graph.ops() & CONDITIONALS  # and the filtered step's branches
    assert not graph.host_reads(), graph.host_reads()


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's graphs")
@pytest.mark.parametrize("name", list(FILTERS))
def test_a_one_program_step_decides_its_passes_on_the_device(name):
    """As one XLA program (the default on one GPU), the filtered step's
    conditionals all lie inside the program, where the device decides
    them: none reads its predicate on the host."""
    graph, wrapped, _ = fitted_step_graph(name, "one_program")
    xla = graph.xla_functions()
    assert xla  # the step is compiled
    outside = [
        (function, node.op, node.name)
        for function, node in graph.nodes
        if node.op in CONDITIONALS and function not in xla
    ]
    assert not outside, outside
    if name != "none":
        assert any(
            node.op in CONDITIONALS for f, node in graph.nodes if f in xla
        )


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's graphs")
def test_an_assert_on_values_is_a_host_read_and_one_on_shapes_is_not():
    """`tf.debugging` checks: one of a batch's size (the filters check a
    batch of unknown size so) reads only shapes, one of values reads them
    on the host."""
    import tensorflow as tf

    def check(x, values):
        if values:
            tf.debugging.assert_non_negative(x)
        else:
            tf.debugging.assert_less_equal(tf.shape(x)[0], 8)
        return x * 2.0

    spec = tf.TensorSpec((None, 6), tf.float32)
    for values in (False, True):
        traced = tf.function(lambda x, v=values: check(x, v))
        graph = StepGraph(traced.get_concrete_function(spec))
        assert "Assert" in graph.ops()
        found = [op for _, op, _ in graph.host_reads()]
        assert found == (["Assert"] if values else []), found


def _host_metric():
    """A metric whose update reads the predictions on the host."""
    import tensorflow as tf

    def host_mean(y_true, y_pred):
        means = tf.py_function(
            lambda t: np.mean(t.numpy(), axis=-1), [y_pred], tf.float32
        )
        return tf.ensure_shape(means, y_pred.shape[:-1])

    return keras.metrics.MeanMetricWrapper(host_mean, name="host_mean")


class _HostLoss(kas.ASSoftmaxLoss):
    """AS-Softmax whose values make a round trip through NumPy."""

    def call(self, y_true, y_pred):
        import tensorflow as tf

        values = super().call(y_true, y_pred)
        copied = tf.numpy_function(lambda v: v, [values], values.dtype)
        return tf.ensure_shape(copied, values.shape)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's graphs")
@pytest.mark.parametrize("jit_compile", TF_MODES)
@pytest.mark.parametrize(
    "where, op", [("metric", "EagerPyFunc"), ("loss", "PyFunc")]
)
def test_the_graph_walk_finds_a_host_read_in_the_step(where, op, jit_compile):
    """Positive control: a `tf.py_function` in a metric (in the step's
    graph) and a `tf.numpy_function` in the loss (inside the training
    pass, an XLA function or a conditional's branch) are found. Traced
    only: XLA cannot compile either."""
    import tensorflow as tf

    x, y = classifier_data()
    wrapped = kas.ASSpeed(
        classifier(), sample_filter=filters.SkipMasked(warmup_epochs=0)
    )
    jit = _tf_step_mode(wrapped, jit_compile)
    wrapped.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=_HostLoss(0.3) if where == "loss" else kas.ASSoftmaxLoss(0.3),
        metrics=[_host_metric()] if where == "metric" else None,
        jit_compile=jit,
    )
    # No epoch: the filters' state and the train function, not traced.
    wrapped.fit(x, y, batch_size=BATCH, epochs=0, verbose=0)
    function = _step_function(wrapped)
    assert function.experimental_get_tracing_count() == 0
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    graph = StepGraph(function.get_concrete_function(iter(batches)))
    found = graph.host_reads()
    assert {f_op for _, f_op, _ in found} == {op}, found
    if where == "loss":
        # Inside the training pass: a function the step calls.
        assert any(function is not None for function, _, _ in found)
