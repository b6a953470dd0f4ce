"""`SkipMasked`'s break-even, measured during `fit`.

Scoring a batch costs a forward pass, `b` seconds; each training pass it
avoids saves `c`. With a share `m` of the scored samples masked, scoring
saves `m` training passes per scored batch, so it pays once `m > b / c`.
`BreakEvenMeter` times every step, reads from the logs whether it scored
and trained, fits `seconds = a_k * steps + b * scored + c * trained` over
the steps seen so far, and sets `ASSpeed`'s `min_masked_ratio` weight to
`b / c` as soon as the timings can tell, then every `REFIT_EVERY` steps
and at each epoch's start.

The intercept `a_k` is one per accumulation length `k`: one step in `k`
ends a window (the optimizer, the reset of the sums), so steps are
compared with steps that end windows as often. With one intercept, the
first epoch's steps (unscored, a window ending at each) made every step
that does not score look a window's cost dearer, and `b` that much
cheaper, more so as scored steps at a longer `k` piled up (on MiniLM on
JAX the measured break-even fell to 0.07 over a fit, where the scoring and
training passes' own times give 0.29).
"""

import time

import keras
import numpy as np

# The range a measured break-even is clipped to.
SHARE_RANGE = (0.05, 0.95)
# Timed steps needed on each side of each flag (scored or not, trained
# or not) before a measurement counts.
MIN_STEPS = 8
# Timed steps between two fits within an epoch.
REFIT_EVERY = 16


def _sides(steps, scored, trained):
    """How many calls fall on each side of each flag: scored or not,
    trained or not (arrays of calls, or one call's scalars)."""
    return np.array(
        [
            np.sum(scored > 0),
            np.sum(scored < steps),
            np.sum(trained > 0),
            np.sum(trained < steps),
        ]
    )


def _measurable(sides):
    """Whether some accumulation length has `MIN_STEPS` calls on each side
    of `scored`, and some (maybe another) on each side of `trained`, from
    `{k: _sides(...)}`: the contrasts that the fit reads `b` and `c` from
    are taken within one `k`."""
    counts = np.array(list(sides.values())).reshape(-1, 4)
    return bool(
        np.any(counts[:, :2].min(axis=1) >= MIN_STEPS)
        and np.any(counts[:, 2:].min(axis=1) >= MIN_STEPS)
    )


def break_even_share(seconds, steps, scored, trained, accumulation=None):
    """The masked share from which scoring pays, from timed steps.

    Fits `seconds = a_k * steps + b * scored + c * trained` by least
    squares, with one `a_k` per accumulation length `k`, once more without
    the steps whose residual is beyond three robust standard deviations (a
    step stalled by the machine).

    Args:
        seconds: float per timed call of the train function.
        steps, scored, trained: how many steps that call ran, scored and
            ran a training pass in.
        accumulation: the accumulation length `k` of each call (`None`:
            one for all).

    Returns:
        `b / c` clipped to `SHARE_RANGE`, or `None` while the timings cannot
        tell: no `k` with `MIN_STEPS` calls on either side of `scored`, or
        none on either side of `trained`, or a training pass that does not
        cost more than nothing.
    """
    seconds, steps, scored, trained = (
        np.asarray(v, "float64") for v in (seconds, steps, scored, trained)
    )
    if accumulation is None:
        accumulation = np.ones_like(steps)
    lengths, group = np.unique(accumulation, return_inverse=True)
    sides = {
        k: _sides(steps[group == i], scored[group == i], trained[group == i])
        for i, k in enumerate(lengths)
    }
    if not _measurable(sides):
        return None
    intercepts = steps[:, None] * (group[:, None] == np.arange(len(lengths)))
    design = np.concatenate(
        [intercepts, np.stack([scored, trained], axis=1)], axis=1
    )
    coefficients = np.linalg.lstsq(design, seconds, rcond=None)[0]
    residual = seconds - design @ coefficients
    spread = 1.4826 * np.median(np.abs(residual - np.median(residual)))
    keep = np.abs(residual) <= 3 * max(spread, 1e-9)
    fit = np.linalg.lstsq(design[keep], seconds[keep], rcond=None)[0]
    score, train = fit[-2:]
    if train <= 0:
        return None
    return float(np.clip(score / train, *SHARE_RANGE))


class BreakEvenMeter(keras.callbacks.Callback):
    """Times `fit`'s steps and sets the `min_masked_ratio` weight to the
    measured break-even (see `break_even_share`): as soon as it can be
    measured, then every `REFIT_EVERY` timed steps and at each epoch's
    start.

    Reads the cumulative `scored_fraction` and `trained_fraction` logs and
    `accum_steps`, so the logs are synced once per step. The first call of
    each epoch (tracing, a new iterator) is left out.
    """

    def __init__(self, variable):
        super().__init__()
        self.variable = variable
        # (seconds, steps, scored, trained, accumulation length) per call
        self.timings = []
        self._start = None
        self._previous = (0, 0.0, 0.0)
        self._sides = {}  # {accumulation length: `_sides` of its timings}
        self._fitted = 0  # len(self.timings) at the last measurement
        self._assigned = None  # the share last written

    def on_epoch_begin(self, epoch, logs=None):
        self._refit()
        self._previous = (0, 0.0, 0.0)

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        seconds = time.perf_counter() - self._start
        steps = batch + 1  # steps this epoch, as the logs' means count
        scored = float(logs["scored_fraction"]) * steps
        trained = float(logs["trained_fraction"]) * steps
        before, scored_before, trained_before = self._previous
        self._previous = (steps, scored, trained)
        if before == 0:
            return
        timing = (
            seconds,
            steps - before,
            round(scored - scored_before),
            round(trained - trained_before),
            int(logs.get("accum_steps", 1)),
        )
        self.timings.append(timing)
        # Counted as they come, so that no step refits before the timings
        # can tell.
        k = timing[-1]
        self._sides[k] = self._sides.get(k, 0) + _sides(*timing[1:4])
        since = len(self.timings) - self._fitted
        if (since >= REFIT_EVERY or not self._fitted) and _measurable(
            self._sides
        ):
            self._refit()

    def _refit(self):
        if len(self.timings) == self._fitted:
            return
        share = break_even_share(*np.transpose(self.timings))
        if share is None:
            return
        self._fitted = len(self.timings)
        if self._assigned is not None and abs(share - self._assigned) < 1e-3:
            return
        self._assigned = share
        # On JAX, `fit` holds the weights' values in its own state during
        # an epoch: reading `self.model` writes them back to the variables,
        # and the next step reads them again, this one's new value with
        # them.
        _ = self.model
        self.variable.assign(share)
