"""Investigation: where the calling thread's CPU time goes in Keras's JAX
`fit`, step by step, for `benchmarks/gpu_check.py`'s models.

On a fast GPU the host's time a step bounds the step: `gpu_check.py`'s
`host ms` column measures it whole, this splits it. Each component is the
thread's CPU time (`time.thread_time_ns`) inside Keras's or the package's
functions, wrapped for the run, exclusive of the wrapped functions they
call: the data (the array adapter's slicing and conversion; the batch's
`device_put`, on a GPU only), the compiled step's dispatch (`jit dispatch`:
the call of the jitted step, or of `ASSpeed`'s `lax.scan` of N steps with
`steps_per_execution=N`, which on the CPU includes the conversion of the
batch's NumPy arrays), the assignment of the step's state to
`model._jax_state` (it frees the last step's donated arrays; on a plain
model also `Layer.__setattr__`'s walk), the per-batch callbacks, and what
each `fit` call costs once (setup, metrics, state sync), spread over its
steps as `gpu_check.py` spreads it. One timed epoch is one `fit` call of
`--samples / 32` steps, after one epoch of warm-up; the table shows the
last of `--rounds`.

    KERAS_BACKEND=jax python lab/host_time.py
    KERAS_BACKEND=jax taskset -c 1 python lab/host_time.py --spe 1,8
    KERAS_BACKEND=jax python lab/host_time.py --quick   # a smoke test

Patches Keras's private modules (`keras.src`): an investigation tool for
the Keras it was written against (3.15), not part of the package.
"""

import argparse
import collections
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.modules["tensorflow"] = None  # as on a GPU image without it

import keras  # noqa: E402
from keras.src import callbacks as callbacks_module  # noqa: E402
from keras.src.backend.jax import trainer as jax_trainer  # noqa: E402
from keras.src.trainers.data_adapters import array_data_adapter  # noqa: E402

import keras_as_softmax as kas  # noqa: E402
from as_softmax_lab import random_bert  # noqa: E402
from keras_as_softmax.training import _jax as kas_jax  # noqa: E402

clock = time.thread_time_ns
spent = collections.defaultdict(int)
stack = []  # [name, start, time in wrapped callees]
active = [False]


def timed(name, fn):
    def wrapper(*args, **kwargs):
        if not active[0]:
            return fn(*args, **kwargs)
        stack.append([name, clock(), 0])
        try:
            return fn(*args, **kwargs)
        finally:
            _, start, inner = stack.pop()
            total = clock() - start
            spent[name] += total - inner
            if stack:
                stack[-1][2] += total

    return wrapper


def patch(owner, attribute, name):
    setattr(owner, attribute, timed(name, getattr(owner, attribute)))


DATA = "data: slice and convert"
DISPATCH = "jit dispatch"
STATE = "model._jax_state ="
CALLBACKS = "callbacks, per batch"
ONCE = "once per fit call"


def install():
    get_iterator = array_data_adapter.ArrayDataAdapter.get_jax_iterator

    def timed_iterator(self):
        batches = iter(get_iterator(self))
        take = timed(DATA, batches.__next__)
        while True:
            try:
                yield take()
            except StopIteration:
                return

    array_data_adapter.ArrayDataAdapter.get_jax_iterator = timed_iterator
    patch(jax_trainer, "_distribute_data", "data: device_put (GPU only)")
    patch(array_data_adapter.ArrayDataAdapter, "__init__", ONCE)
    callbacks = callbacks_module.CallbackList
    patch(callbacks, "on_train_batch_begin", CALLBACKS)
    patch(callbacks, "on_train_batch_end", CALLBACKS)
    for hook in ("__init__", "on_train_begin", "on_train_end"):
        patch(callbacks, hook, ONCE)
    for hook in ("on_epoch_begin", "on_epoch_end"):
        patch(callbacks, hook, ONCE)
    for method in (
        "_get_jax_state",
        "jax_state_sync",
        "_symbolic_build",
        "reset_metrics",
        "_get_metrics_result_or_logs",
    ):
        patch(jax_trainer.JAXTrainer, method, ONCE)
    patch(jax_trainer.JAXEpochIterator, "__init__", ONCE)
    for method in ("_prepare_filters", "_check_compiled"):
        patch(kas.ASSpeed, method, ONCE)
    jit = jax_trainer.jit
    jax_trainer.jit = lambda *a, **k: timed(DISPATCH, jit(*a, **k))
    scan = kas_jax.scan
    kas_jax.scan = lambda *a, **k: timed(DISPATCH, scan(*a, **k))
    for cls in (keras.Model, kas.ASSpeed):
        setattr_ = cls.__setattr__
        timed_setattr = timed(STATE, setattr_)

        def assign(self, name, value, plain=setattr_, timed_=timed_setattr):
            (timed_ if name == "_jax_state" else plain)(self, name, value)

        cls.__setattr__ = assign


def profile(variant, spe, args):
    """The components' microseconds a step, and the thread's total."""
    model_args = argparse.Namespace(
        samples=args.samples,
        sequence_length=args.sequence_length,
        batch_size=32,
        learning_rate=1e-4,
        jit_compile="true",
        steps_per_execution=spe,
        backbone="keras",
    )
    x, y = random_bert.make_data(args.shape["vocabulary_size"], model_args)
    model = random_bert.make_variant(variant, args.shape, model_args)
    steps = -(-args.samples // 32)
    for epoch in range(args.rounds + 1):
        timing = epoch > 0
        spent.clear()
        active[0] = timing
        start = clock()
        model.fit(
            x,
            y,
            batch_size=32,
            initial_epoch=epoch,
            epochs=epoch + 1,
            verbose=0,
        )
        total = clock() - start
        active[0] = False
    parts = {k: v / steps / 1e3 for k, v in spent.items()}
    parts["the loop, not wrapped"] = (total - sum(spent.values())) / steps / 1e3
    parts["total"] = total / steps / 1e3
    return parts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="softmax,as_speed,skip_masked")
    parser.add_argument("--spe", default="1,8", help="steps_per_execution")
    parser.add_argument("--shape", default="minilm", choices=random_bert.SHAPES)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--sequence-length", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    name = "tiny" if args.quick else args.shape
    args.shape = random_bert.TINY if args.quick else random_bert.SHAPES[name]
    if args.quick:
        args.samples, args.rounds = 128, 1
    import jax

    print(f"keras {keras.__version__}, jax {jax.__version__}, {jax.devices()}")
    print(
        f"samples={args.samples} sequence_length={args.sequence_length} "
        f"rounds={args.rounds} shape={name}"
    )
    install()
    columns = {}
    for spe in (int(s) for s in args.spe.split(",")):
        for variant in args.variants.split(","):
            columns[f"{variant} spe{spe}"] = profile(variant, spe, args)
    rows = [DISPATCH, STATE, DATA, "data: device_put (GPU only)", CALLBACKS]
    rows += [ONCE, "the loop, not wrapped", "total"]
    print(f"{'host us a step':<32}" + "".join(f"{c:>18}" for c in columns))
    for row in rows:
        cells = "".join(
            f"{col.get(row, 0.0):>18.0f}" for col in columns.values()
        )
        print(f"{row:<32}{cells}")


if __name__ == "__main__":
    main()
