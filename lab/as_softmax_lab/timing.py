"""The timing loop that the speed benchmarks (`benchmarks/`) and the
lab's timing scripts share: epochs of several models timed in turn, in one
process, so that a stretch of machine load slows every model of a round
alike."""

import statistics
import time

TF_FILTERED_STEPS = ("one_program", "xla_passes")


def split_variant(variant):
    """`(name, step)` of a variant `NAME` or `NAME@STEP`: on TensorFlow,
    `@one_program` or `@xla_passes` compiles a filtered step so under
    `jit_compile=True` (`keras_as_softmax.training._tensorflow.xla_passes`),
    where `NAME` alone leaves the choice to the platform (`auto`)."""
    name, _, step = variant.partition("@")
    if step and step not in TF_FILTERED_STEPS:
        raise ValueError(
            f"{variant}: expected NAME or NAME@STEP with STEP one of "
            f"{TF_FILTERED_STEPS}"
        )
    return name, step or "auto"


def epoch_fit(model, x, y, batch_size):
    """A `fit(epoch)` for `time_epochs`: one more epoch of `model.fit` on
    arrays, shuffled, returning that epoch's logs."""

    def fit(epoch):
        history = model.fit(
            x,
            y,
            batch_size=batch_size,
            initial_epoch=epoch,
            epochs=epoch + 1,
            shuffle=True,
            verbose=0,
        )
        return {k: v[-1] for k, v in history.history.items()}

    return fit


def time_epochs(fits, warmup, rounds):
    """Times one epoch of each model in turn, `rounds` times.

    Args:
        fits: `{name: fit}`, where `fit(epoch)` trains one more epoch
            (`epoch`, 0-based, counts that model's epochs) and returns
            that epoch's logs.
        warmup: epochs each model trains first, untimed (compilation, a
            filter's warm-up).
        rounds: timed epochs of each model.

    Returns:
        `(seconds, logs, host)`: `{name: [seconds of each timed epoch]}`,
        `{name: logs of its last epoch}` and `{name: [the calling thread's
        CPU seconds in each timed epoch]}`. The last is the host's share
        of an epoch on an accelerator (Keras's loop, dispatching the
        steps, the data): where it is close to the wall time, the steps
        wait for the host. On a CPU it also holds whatever compute runs
        in the calling thread.
    """
    epoch = dict.fromkeys(fits, 0)
    logs = {}

    def run(name):
        start, cpu = time.perf_counter(), time.thread_time()
        logs[name] = fits[name](epoch[name])
        epoch[name] += 1
        return time.perf_counter() - start, time.thread_time() - cpu

    for name in fits:
        for _ in range(warmup):
            run(name)
    seconds = {name: [] for name in fits}
    host = {name: [] for name in fits}
    for _ in range(rounds):
        for name in fits:
            wall, cpu = run(name)
            seconds[name].append(wall)
            host[name].append(cpu)
    return seconds, logs, host


def print_table(seconds, logs, steps, reference, host=None):
    """Per-step medians and their ratios to `reference`'s, with the
    filters' shares of the last epoch, and with `host` (`time_epochs`'s)
    the median host milliseconds a step."""
    base = statistics.median(seconds[reference]) / steps
    print(
        f"{'variant':<28}{'ms/step':>9}{'ratio':>8}"
        f"{'trained':>9}{'scored':>8}{'masked':>8}"
        + (f"{'host ms':>9}" if host else "")
    )
    for name, times in seconds.items():
        median = statistics.median(times) / steps
        last = logs[name]
        print(
            f"{name:<28}{1e3 * median:>9.3f}{median / base:>7.2f}x"
            f"{last.get('trained_fraction', 1.0):>9.2f}"
            f"{last.get('scored_fraction', 0.0):>8.2f}"
            f"{last.get('masked_ratio', float('nan')):>8.2f}"
            + (
                f"{1e3 * statistics.median(host[name]) / steps:>9.3f}"
                if host
                else ""
            )
        )
